"""Seeing what a DataLoader draws: the sampler chain, and taps on the sampler that yields the indices.

Lightning prepares a DataLoader (injecting a ``DistributedSampler``) and iterates it within the same
loop method, before any callback hook runs. :func:`add_dataloader_hook` therefore hooks the strategy's
``process_dataloader`` (called on every prepared DataLoader) to reach the DataLoader before its first
iteration. A *tap* is then put on the DataLoader's index sampler (its ``batch_sampler``, or its
``sampler`` when it has no batch sampler) by giving that one object a subclass of its own class whose
``__iter__`` passes the indices through the tap. The object keeps its identity and its type checks, and
pickles as its original class.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, RandomSampler, Sampler

# tap(sampler, iterator_of_items) -> iterator_of_items
Tap = Callable[[Any, Iterator[Any]], Iterator[Any]]

_TAPPED_CLASSES: dict[type, type] = {}


def _rebuild_untapped(cls: type, state: dict) -> Any:
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    return obj


def _tapped_class(cls: type) -> type:
    sub = _TAPPED_CLASSES.get(cls)
    if sub is not None:
        return sub

    def __iter__(self):  # noqa: N807
        it = super(sub, self).__iter__()
        for tap in tuple(self.__dict__.get("_lp_taps", ())):
            it = tap(self, it)
        return it

    def __reduce_ex__(self, protocol):  # noqa: N807
        state = {k: v for k, v in self.__dict__.items() if k != "_lp_taps"}
        return (_rebuild_untapped, (cls, state))

    sub = type(
        cls.__name__,
        (cls,),
        {
            "__iter__": __iter__,
            "__reduce_ex__": __reduce_ex__,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "_lp_untapped_class": cls,
        },
    )
    _TAPPED_CLASSES[cls] = sub
    return sub


def add_tap(sampler: Any, tap: Tap) -> bool:
    """Pass every item ``sampler`` yields through ``tap``; ``False`` if this object cannot be tapped."""
    if sampler is None or not hasattr(sampler, "__dict__"):
        return False
    cls = type(sampler)
    if "_lp_untapped_class" not in cls.__dict__:
        try:
            sampler.__class__ = _tapped_class(cls)
        except TypeError:  # __slots__, extension types
            return False
    taps = sampler.__dict__.setdefault("_lp_taps", [])
    if tap not in taps:
        taps.append(tap)
    return True


def remove_tap(sampler: Any, tap: Tap) -> None:
    taps = getattr(sampler, "__dict__", {}).get("_lp_taps")
    if taps is None:
        return
    if tap in taps:
        taps.remove(tap)
    if not taps:
        del sampler.__dict__["_lp_taps"]
        original = type(sampler).__dict__.get("_lp_untapped_class")
        if original is not None:
            sampler.__class__ = original


def find_tap(sampler: Any, kind: type) -> Any:
    for tap in getattr(sampler, "__dict__", {}).get("_lp_taps", ()):
        if isinstance(tap, kind):
            return tap
    return None


def index_sampler(dataloader: Any) -> Any:
    """The object a DataLoader iterates to get its indices, or ``None`` when there are no indices."""
    if not isinstance(dataloader, DataLoader) or isinstance(dataloader.dataset, IterableDataset):
        return None
    return dataloader.batch_sampler if dataloader.batch_sampler is not None else dataloader.sampler


def add_dataloader_hook(trainer: Any, hook: Callable[[Any, Any], None]) -> None:
    """Call ``hook(dataloader, stage)`` on every DataLoader Lightning prepares, before it is iterated.

    ``stage`` is the trainer's ``RunningStage`` at that moment (training, validating, sanity checking,
    testing, predicting).
    """
    strategy = trainer.strategy
    hooks = strategy.__dict__.get("_lp_dataloader_hooks")
    if hooks is None:
        hooks = []
        original = strategy.process_dataloader

        def process_dataloader(dataloader: object) -> object:
            dataloader = original(dataloader)
            for h in tuple(hooks):
                h(dataloader, trainer.state.stage)
            return dataloader

        strategy.process_dataloader = process_dataloader
        strategy._lp_dataloader_hooks = hooks
    if hook not in hooks:
        hooks.append(hook)


def remove_dataloader_hook(trainer: Any, hook: Callable[[Any, Any], None]) -> None:
    strategy = trainer.strategy
    hooks = strategy.__dict__.get("_lp_dataloader_hooks")
    if hooks is None:
        return
    if hook in hooks:
        hooks.remove(hook)
    if not hooks:
        del strategy.__dict__["_lp_dataloader_hooks"]
        strategy.__dict__.pop("process_dataloader", None)


@dataclass
class ChainLink:
    """One object of a DataLoader's sampler chain and the attribute path that reaches it."""

    path: str
    obj: Any

    @property
    def type_name(self) -> str:
        return type(self.obj).__name__

    @property
    def has_set_epoch(self) -> bool:
        return callable(getattr(self.obj, "set_epoch", None))

    @property
    def shuffles(self) -> bool:
        """Whether the object's order is meant to change between epochs."""
        if isinstance(self.obj, RandomSampler):
            return True
        shuffle = getattr(self.obj, "shuffle", None)
        if shuffle is not None:
            return bool(shuffle)
        return self.has_set_epoch  # set_epoch exists to reshuffle

    @property
    def epoch(self) -> int | None:
        value = getattr(self.obj, "epoch", getattr(self.obj, "_epoch", None))
        return value if isinstance(value, int) and not isinstance(value, bool) else None


_SKIP_TYPES = (torch.Tensor, torch.nn.Module, str, bytes, int, float, bool, type(None))


def _is_chain_object(value: Any) -> bool:
    if isinstance(value, _SKIP_TYPES) or isinstance(value, type):
        return False
    return isinstance(value, (Sampler, Dataset)) or callable(getattr(value, "set_epoch", None))


def sampler_chain(dataloader: Any, root: str = "dataloader", max_depth: int = 4) -> list[ChainLink]:
    """Every sampler, batch sampler, dataset and object with ``set_epoch`` reachable from ``dataloader``.

    Walks attributes (and short lists/tuples/dicts of them), so samplers kept under any name inside a
    custom batch sampler or wrapper dataset are found.
    """
    links: list[ChainLink] = []
    seen: set[int] = set()
    start = [
        (f"{root}.{name}", getattr(dataloader, name, None))
        for name in ("sampler", "batch_sampler", "dataset")
    ]
    frontier = [(path, obj, 0) for path, obj in start if obj is not None]
    while frontier:
        path, obj, depth = frontier.pop(0)
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        links.append(ChainLink(path, obj))
        if depth >= max_depth:
            continue
        for name, value in _children(obj):
            child_path = f"{path}.{name}" if not name.startswith("[") else f"{path}{name}"
            if _is_chain_object(value) and id(value) not in seen:
                frontier.append((child_path, value, depth + 1))
    return links


def _children(obj: Any) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    attrs = getattr(obj, "__dict__", None)
    if not isinstance(attrs, dict):
        return out
    for name, value in attrs.items():
        if name.startswith("_lp_"):
            continue
        if isinstance(value, (list, tuple)) and len(value) <= 32:
            out.extend((f"{name}[{i}]", v) for i, v in enumerate(value))
        elif isinstance(value, dict) and len(value) <= 32:
            out.extend((f"{name}[{k!r}]", v) for k, v in value.items())
        else:
            out.append((name, value))
    return out


def reached_by_lightning(dataloader: Any) -> set[int]:
    """Ids of the objects Lightning calls ``set_epoch`` on (``sampler`` and ``batch_sampler.sampler``)."""
    ids = set()
    sampler = getattr(dataloader, "sampler", None)
    if sampler is not None:
        ids.add(id(sampler))
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    inner = getattr(batch_sampler, "sampler", None) if batch_sampler is not None else None
    if inner is not None:
        ids.add(id(inner))
    return ids


def distributed_sampler(links: list[ChainLink]) -> ChainLink | None:
    """The first ``DistributedSampler`` (or object with ``num_replicas`` and ``rank``) in the chain."""
    for link in links:
        if isinstance(link.obj, DistributedSampler):
            return link
    for link in links:
        if isinstance(link.obj, Sampler) and hasattr(link.obj, "num_replicas") and hasattr(link.obj, "rank"):
            return link
    return None


def dataloader_name(stage_prefix: str, index: int, count: int) -> str:
    return f"{stage_prefix}_dataloader" if count == 1 else f"{stage_prefix}_dataloader[{index}]"
