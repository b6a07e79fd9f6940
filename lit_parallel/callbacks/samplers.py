"""Seeing what a DataLoader draws: the sampler chain, and taps on the sampler that yields the indices.

Lightning prepares a DataLoader (injecting a ``DistributedSampler``) and iterates it within the same
loop method, before any callback hook runs. :func:`add_dataloader_hook` therefore hooks the strategy's
``process_dataloader`` (called on every prepared DataLoader) to reach the DataLoader before its first
iteration. A *tap* is then put on the DataLoader's index sampler (its ``batch_sampler``, or its
``sampler`` when it has no batch sampler): the DataLoader's reference to it is replaced by a
:class:`TappedSampler` that iterates the same object through the taps and delegates everything else to
it, so the user's sampler keeps its class, identity and pickling, and Lightning's ``set_epoch`` calls
reach it. :func:`remove_tap` puts the original reference back.

``DataLoader.__setattr__`` refuses new ``sampler``/``batch_sampler`` values after ``__init__`` because
its copies of ``batch_size`` and ``drop_last`` and a persistent-workers iterator would no longer match
them. A :class:`TappedSampler` yields the same items and reports the same length and attributes, and it
is installed before the DataLoader's first iterator, so :func:`_set_index_sampler` sets it past that
check (``object.__setattr__``): the one place this module goes around the DataLoader's interface.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, RandomSampler, Sampler

from lit_parallel.callbacks.patching import patch_attribute

# tap(sampler, iterator_of_items) -> iterator_of_items
Tap = Callable[[Any, Iterator[Any]], Iterator[Any]]


class TappedSampler:
    """Stands in for a DataLoader's index sampler: iterates it through taps, delegates everything else."""

    __slots__ = ("_lp_sampler", "_lp_taps")

    def __init__(self, sampler: Any) -> None:
        self._lp_sampler = sampler
        self._lp_taps: list[Tap] = []

    def __iter__(self) -> Iterator[Any]:
        it = iter(self._lp_sampler)
        for tap in tuple(self._lp_taps):
            it = tap(self._lp_sampler, it)
        return it

    def __len__(self) -> int:
        return len(self._lp_sampler)

    def __getattr__(self, name: str) -> Any:
        # only called for names not found on the wrapper: ``sampler``, ``set_epoch``, ``batch_size``, ...
        if name.startswith("__") or name in TappedSampler.__slots__:
            raise AttributeError(name)
        return getattr(self._lp_sampler, name)

    def __reduce__(self) -> tuple:
        # a pickled or copied DataLoader holds the user's sampler again, without taps
        return (_untapped, (self._lp_sampler,))


def _untapped(sampler: Any) -> Any:
    return sampler


def unwrap(obj: Any) -> Any:
    """The user's object behind a :class:`TappedSampler` (``obj`` itself otherwise)."""
    return obj._lp_sampler if isinstance(obj, TappedSampler) else obj


def _index_sampler_attr(dataloader: Any) -> str | None:
    if not isinstance(dataloader, DataLoader) or isinstance(dataloader.dataset, IterableDataset):
        return None
    return "batch_sampler" if dataloader.batch_sampler is not None else "sampler"


def _set_index_sampler(dataloader: DataLoader, attr: str, value: Any) -> None:
    object.__setattr__(dataloader, attr, value)  # past DataLoader's guard: see the module docstring


def index_sampler(dataloader: Any) -> Any:
    """The object a DataLoader iterates to get its indices, or ``None`` when there are no indices."""
    attr = _index_sampler_attr(dataloader)
    return unwrap(getattr(dataloader, attr)) if attr is not None else None


def add_tap(dataloader: Any, tap: Tap) -> bool:
    """Pass every item ``dataloader``'s index sampler yields through ``tap``; ``False`` if it has none."""
    attr = _index_sampler_attr(dataloader)
    if attr is None:
        return False
    tapped = getattr(dataloader, attr)
    if not isinstance(tapped, TappedSampler):
        tapped = TappedSampler(tapped)
        _set_index_sampler(dataloader, attr, tapped)
    if tap not in tapped._lp_taps:
        tapped._lp_taps.append(tap)
    return True


def remove_tap(dataloader: Any, tap: Tap) -> None:
    """Undo :func:`add_tap`; the DataLoader gets its own index sampler back with its last tap."""
    attr = _index_sampler_attr(dataloader)
    tapped = getattr(dataloader, attr) if attr is not None else None
    if not isinstance(tapped, TappedSampler):
        return
    if tap in tapped._lp_taps:
        tapped._lp_taps.remove(tap)
    if not tapped._lp_taps:
        _set_index_sampler(dataloader, attr, tapped._lp_sampler)


def find_tap(dataloader: Any, kind: type) -> Any:
    """The tap of type ``kind`` on ``dataloader``'s index sampler, or ``None``."""
    attr = _index_sampler_attr(dataloader)
    tapped = getattr(dataloader, attr) if attr is not None else None
    if not isinstance(tapped, TappedSampler):
        return None
    return next((tap for tap in tapped._lp_taps if isinstance(tap, kind)), None)


def add_dataloader_hook(trainer: Any, hook: Callable[[Any, Any], None]) -> None:
    """Call ``hook(dataloader, stage)`` on every DataLoader Lightning prepares, before it is iterated.

    ``stage`` is the trainer's ``RunningStage`` at that moment (training, validating, sanity checking,
    testing, predicting).
    """
    strategy = trainer.strategy
    hooks = getattr(strategy.process_dataloader, "lp_hooks", None)
    if hooks is None:
        hooks = []
        original = strategy.process_dataloader

        def process_dataloader(dataloader: object) -> object:
            dataloader = original(dataloader)
            for h in tuple(hooks):
                h(dataloader, trainer.state.stage)
            return dataloader

        process_dataloader.lp_hooks = hooks
        process_dataloader.lp_undo = patch_attribute(strategy, "process_dataloader", process_dataloader)
    if hook not in hooks:
        hooks.append(hook)


def remove_dataloader_hook(trainer: Any, hook: Callable[[Any, Any], None]) -> None:
    patched = trainer.strategy.process_dataloader
    hooks = getattr(patched, "lp_hooks", None)
    if hooks is None:
        return
    if hook in hooks:
        hooks.remove(hook)
    if not hooks:
        patched.lp_undo()


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
        (f"{root}.{name}", unwrap(getattr(dataloader, name, None)))
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
    sampler = unwrap(getattr(dataloader, "sampler", None))
    if sampler is not None:
        ids.add(id(sampler))
    batch_sampler = unwrap(getattr(dataloader, "batch_sampler", None))
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
