"""SetEpochCheck: prove from the data drawn that every rank reads its own shard and a new order each epoch."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from lightning.pytorch import Callback
from lightning.pytorch.trainer.states import RunningStage
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from lit_parallel._logging import info
from lit_parallel.callbacks.data_parallel import (
    DataParallelGroup,
    all_gather_object,
    all_gather_tensor,
    all_reduce,
    check_mode,
    data_parallel_group,
    report,
)
from lit_parallel.callbacks.fingerprints import batch_fingerprints, bottom_k
from lit_parallel.callbacks.samplers import (
    ChainLink,
    add_dataloader_hook,
    add_tap,
    distributed_sampler,
    find_tap,
    reached_by_lightning,
    remove_dataloader_hook,
    remove_tap,
    sampler_chain,
    unwrap,
)

_SENTINEL = torch.iinfo(torch.int64).max
# Share of sampled fingerprints seen on several ranks above which ranks are said to read the same data
# (a few exact duplicates in a real dataset stay far below it).
_SHARED_FINGERPRINT_LIMIT = 0.25
_ORDER_PREFIX = 64


class _IndexRecorder:
    """Tap that keeps every item the index sampler yields in the current iteration."""

    def __init__(self) -> None:
        self.items: list[Any] = []
        self.exhausted = False
        self.expected: int | None = None

    def __call__(self, sampler: Any, it: Any) -> Any:
        self.items = []
        self.exhausted = False
        try:
            self.expected = len(sampler)
        except TypeError:
            self.expected = None
        return self._record(it, self.items)

    @property
    def complete(self) -> bool:
        """Whether this iteration drew everything (Lightning stops at ``len`` without exhausting it)."""
        return self.exhausted or (self.expected is not None and len(self.items) >= self.expected)

    def _record(self, it: Any, items: list) -> Any:
        for item in it:
            items.append(item)
            yield item
        self.exhausted = True

    def indices(self) -> torch.Tensor | None:
        flat: list[int] = []
        try:
            for item in self.items:
                if isinstance(item, (list, tuple)):
                    flat.extend(operator.index(i) for i in item)
                elif isinstance(item, torch.Tensor):
                    flat.extend(int(i) for i in item.reshape(-1).tolist())
                else:
                    flat.append(operator.index(item))
        except TypeError:  # the sampler yields keys that are not integer indices
            return None
        return torch.tensor(flat, dtype=torch.int64)


@dataclass
class _LoaderState:
    """What this rank remembers about one train dataloader between epochs."""

    previous_order: torch.Tensor | None = None
    fingerprints: list[torch.Tensor] = field(default_factory=list)
    n_fingerprints: int = 0
    n_pending: int = 0
    first_fingerprints: list[torch.Tensor] = field(default_factory=list)
    n_first: int = 0

    def add(self, fp: torch.Tensor, keep: int) -> None:
        """Keep the epoch's sketch (the ``keep`` smallest fingerprints) bounded as batches arrive."""
        self.fingerprints.append(fp)
        self.n_fingerprints += len(fp)
        self.n_pending += len(fp)
        if self.n_pending > 64 * keep:
            self.fingerprints = [bottom_k(torch.cat(self.fingerprints), keep)]
            self.n_pending = 0
        if self.n_first < _ORDER_PREFIX:
            self.first_fingerprints.append(fp[: _ORDER_PREFIX - self.n_first])
            self.n_first += min(len(fp), _ORDER_PREFIX - self.n_first)

    def repeats_order(self, order: torch.Tensor | None, exact: bool) -> bool | None:
        """Whether ``order`` starts as the previous epoch's did (``None``: nothing to compare); remembers it.

        ``exact`` compares the whole of both orders (indices), otherwise their first fingerprints.
        """
        repeated = None
        if order is not None and self.previous_order is not None:
            n = min(len(order), len(self.previous_order), len(order) if exact else _ORDER_PREFIX)
            if n >= 2:
                repeated = bool(torch.equal(order[:n], self.previous_order[:n]))
        self.previous_order = order
        return repeated

    def reset_epoch(self) -> None:
        self.fingerprints, self.first_fingerprints = [], []
        self.n_fingerprints = self.n_pending = self.n_first = 0


class SetEpochCheck(Callback):
    """Checks each training epoch, from the data actually drawn on every rank, that the data is sharded.

    At the end of every training epoch the ranks of the data-parallel group exchange what they drew
    (dataset indices where the sampler yields them, per-sample fingerprints of the batches otherwise, e.g.
    for an ``IterableDataset``) and check that

    - the ranks' shards are disjoint (up to the padding a ``DistributedSampler`` documents),
    - together they cover the dataset (up to ``drop_last``), when the epoch ran to its end,
    - the order changes from one epoch to the next when shuffling is on.

    The whole sampler chain is walked (``sampler``, ``batch_sampler``, samplers held under any attribute
    of custom batch samplers or wrapper datasets, ``IterableDataset.set_epoch``) to name the object that
    never receives ``set_epoch``: Lightning calls it only on ``dataloader.sampler`` and
    ``dataloader.batch_sampler.sampler``. A correct setup produces no warning.

    Args:
        mode: ``"warn"`` (a :class:`~lit_parallel.callbacks.ParallelTrainingWarning` on global rank 0, once
            per problem and dataloader) or ``"raise"`` (a
            :class:`~lit_parallel.callbacks.ParallelTrainingError` with the same message on every rank).
        fix: call ``set_epoch(epoch)`` each epoch on the objects of the chain that need it and that
            Lightning does not reach, and say so once.
        max_exact_indices: datasets up to this length are checked index by index (one all-reduce of an
            int32 vector of that length per epoch); longer ones on an evenly spaced subset of indices.
        sketch_size: fingerprints per rank exchanged when there are no indices.
    """

    def __init__(
        self,
        mode: Literal["warn", "raise"] = "warn",
        fix: bool = False,
        max_exact_indices: int = 2**24,
        sketch_size: int = 1024,
    ) -> None:
        self.mode = check_mode(mode, "SetEpochCheck")
        self.fix = fix
        self.max_exact_indices = max_exact_indices
        self.sketch_size = sketch_size
        self.findings: list[str] = []
        self.fixed: list[str] = []
        self._reported: set[tuple[str, str]] = set()
        self._states: dict[int, _LoaderState] = {}
        self._tapped: list[tuple[Any, _IndexRecorder]] = []
        self._dp: DataParallelGroup | None = None
        self._epoch = 0
        self._by_content: list[tuple[int, int]] = []

    # ----------------------------------------------------------------------------------------- hooks
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            add_dataloader_hook(trainer, self._on_dataloader)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            remove_dataloader_hook(trainer, self._on_dataloader)
            for dataloader, tap in self._tapped:
                remove_tap(dataloader, tap)
            self._tapped.clear()

    def _on_dataloader(self, dataloader: Any, stage: Any) -> None:
        if stage != RunningStage.TRAINING:
            return
        if find_tap(dataloader, _IndexRecorder) is None:
            tap = _IndexRecorder()
            if add_tap(dataloader, tap):
                self._tapped.append((dataloader, tap))

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._dp = data_parallel_group(trainer.strategy)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        for state in self._states.values():
            state.reset_epoch()
        # loaders without an index sampler to tap (IterableDataset, ...) are checked by content
        loaders = self._train_loaders(trainer)
        self._by_content = [
            (i, len(loaders)) for i, (_, dl) in enumerate(loaders) if find_tap(dl, _IndexRecorder) is None
        ]
        if not self.fix:
            return
        for name, dl in self._train_loaders(trainer):
            for link in self._missed(dl, name):
                link.obj.set_epoch(trainer.current_epoch)
                if link.path not in self.fixed:
                    self.fixed.append(link.path)
                    info(
                        f"SetEpochCheck(fix=True): calling {link.path}.set_epoch(epoch) at the start of every"
                        f" epoch: this {link.type_name} reshuffles per epoch, but Lightning calls set_epoch only"
                        " on dataloader.sampler and dataloader.batch_sampler.sampler."
                    )

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        for i, count in self._by_content:
            fp = batch_fingerprints(batch if count == 1 else _sub_batch(batch, i))
            if fp is not None:
                self._states.setdefault(i, _LoaderState()).add(fp, self.sketch_size)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._epoch = trainer.current_epoch
        dp = self._dp or data_parallel_group(trainer.strategy)
        messages = []
        for i, (name, dl) in enumerate(self._train_loaders(trainer)):
            messages += self._check_loader(trainer, dp, i, name, dl)
        fresh = []
        for kind_and_name, message in messages:
            self.findings.append(message)
            if kind_and_name not in self._reported:
                self._reported.add(kind_and_name)
                fresh.append(message)
        report(
            fresh if self.mode == "warn" else [m for _, m in messages],
            mode=self.mode,
            is_global_zero=trainer.is_global_zero,
        )

    # -------------------------------------------------------------------------------------- analysis
    def _train_loaders(self, trainer: Any) -> list[tuple[str, Any]]:
        loaders = trainer.train_dataloader
        if loaders is None:
            return []
        if isinstance(loaders, dict):
            items = list(loaders.values())
        elif isinstance(loaders, (list, tuple)):
            items = list(loaders)
        else:
            items = getattr(loaders, "flattened", None) or [loaders]
        if len(items) == 1:
            return [("train_dataloader", items[0])]
        return [(f"train_dataloader[{i}]", dl) for i, dl in enumerate(items)]

    def _missed(self, dataloader: Any, name: str) -> list[ChainLink]:
        """Objects of the chain that reshuffle per epoch through set_epoch but that Lightning never reaches."""
        if not isinstance(dataloader, DataLoader):
            return []
        reached = reached_by_lightning(dataloader)
        return [
            link
            for link in sampler_chain(dataloader, name)
            if link.has_set_epoch and link.shuffles and id(link.obj) not in reached
        ]

    def _check_loader(self, trainer: Any, dp: DataParallelGroup, i: int, name: str, dl: Any) -> list:
        epoch = trainer.current_epoch
        state = self._states.setdefault(i, _LoaderState())
        recorder = find_tap(dl, _IndexRecorder)
        indices = recorder.indices() if recorder is not None else None
        links = sampler_chain(dl, name) if isinstance(dl, DataLoader) else []
        ds_link = distributed_sampler(links)

        if indices is not None:
            mode, order = "indices", indices
        elif state.fingerprints:
            mode, order = "fingerprints", torch.cat([f.cpu() for f in state.first_fingerprints])
        else:
            mode, order = "none", None
        repeated = state.repeats_order(order, exact=mode == "indices")

        missed = [link for link in self._missed(dl, name) if link.path not in self.fixed]
        stale = [
            link.path for link in missed if epoch >= 1 and link.epoch is not None and link.epoch != epoch
        ]
        try:
            dataset_len = len(dl.dataset) if mode == "indices" else None
        except TypeError:
            dataset_len = None
        summary = {
            "mode": mode,
            "n": len(indices) if indices is not None else state.n_fingerprints,
            "exhausted": bool(recorder is not None and recorder.complete),
            "repeated": repeated,
            "stale": stale,
            "len": dataset_len,
            "max_index": int(indices.max()) if indices is not None and len(indices) else -1,
            "ds": None
            if ds_link is None
            else (getattr(ds_link.obj, "num_replicas", None), getattr(ds_link.obj, "rank", None)),
        }
        gathered = all_gather_object(summary, dp)
        modes = {g["mode"] for g in gathered}
        findings: list[tuple[tuple[str, str], str]] = []

        if modes == {"indices"}:
            findings += self._check_indices(dp, name, dl, links, ds_link, indices, gathered)
        elif modes == {"fingerprints"}:
            findings += self._check_fingerprints(dp, name, dl, state, gathered)

        shuffles = [link for link in links if link.shuffles] or [
            link for link in links if isinstance(link.obj, IterableDataset) and link.has_set_epoch
        ]
        any_stale = sorted({p for g in gathered for p in g["stale"]})
        all_repeated = (
            epoch >= 1
            and all(g["repeated"] for g in gathered)
            and any(g["repeated"] is not None for g in gathered)
        )
        if any_stale or (all_repeated and shuffles):
            findings.append(
                (("order", name), self._order_message(name, epoch, missed, any_stale, all_repeated, shuffles))
            )
        return findings

    def _check_indices(self, dp, name, dl, links, ds_link, indices, gathered) -> list:
        lengths = [g["len"] for g in gathered if g["len"] is not None]
        n_total = max(lengths) if lengths else max(g["max_index"] for g in gathered) + 1
        stride = max(1, -(-n_total // self.max_exact_indices))
        mine = indices[(indices >= 0) & (indices < n_total)]
        if stride > 1:
            mine = mine[mine % stride == 0] // stride
        bins = -(-n_total // stride)
        counts = all_reduce(torch.bincount(mine, minlength=bins).to(torch.int32), dp)
        duplicates = int((counts - 1).clamp(min=0).sum()) * stride
        read = int((counts > 0).sum()) * stride
        missing = int((counts == 0).sum()) * stride if all(g["exhausted"] for g in gathered) else 0
        ranks = dp.size
        ds = ds_link.obj if ds_link is not None else None
        padding = _padding(ds)
        dropped = _dropped(ds, dl, n_total, ranks)
        slack = stride - 1 if stride > 1 else 0
        out = []
        if duplicates > padding + slack * ranks:
            readers = counts[counts > 0].float().mean().item()
            evidence = (
                f"{name}: in epoch {self._epoch}, {duplicates} of the"
                f" {int(counts.sum()) * stride} samples drawn by the {ranks} data-parallel ranks had also been"
                f" drawn by another rank ({read} distinct dataset indices, each drawn by {readers:.2f} ranks on"
                f" average; DistributedSampler padding explains {padding} repeats)."
            )
            out.append(
                (("overlap", name), evidence + " " + _overlap_cause(name, links, ds_link, gathered, ranks))
            )
        if missing > dropped + slack * ranks:
            out.append(
                (
                    ("coverage", name),
                    f"{name}: the {ranks} data-parallel ranks together read {read} of the {n_total} samples in"
                    f" epoch {self._epoch}; {missing} were never read"
                    f" (drop_last explains at most {dropped}). "
                    + (
                        f"{ds_link.path} is {ds_link.type_name}(num_replicas={ds.num_replicas}, rank={ds.rank})"
                        f" on this rank; every data-parallel rank needs num_replicas={ranks} and its own rank."
                        if ds_link is not None
                        else "The sampler chain has no distributed sampler."
                    )
                    + " Fix: let Lightning insert the DistributedSampler (Trainer(use_distributed_sampler=True),"
                    " the default) or build it with num_replicas=<data-parallel size>, rank=<data-parallel rank>.",
                )
            )
        return out

    def _check_fingerprints(self, dp, name, dl, state, gathered) -> list:
        k = self.sketch_size
        fps = (
            torch.cat([f.cpu() for f in state.fingerprints])
            if state.fingerprints
            else torch.empty(0, dtype=torch.int64)
        )
        sketch = bottom_k(fps, k)
        padded = torch.full((k,), _SENTINEL, dtype=torch.int64)
        padded[: len(sketch)] = sketch
        table = all_gather_tensor(padded, dp).view(dp.size, k)
        union = torch.unique(table[table != _SENTINEL])[:k]
        if len(union) == 0:
            return []
        holders = torch.stack([torch.isin(union, table[r]) for r in range(dp.size)]).sum(0)
        shared = float((holders >= 2).float().mean())
        if shared <= _SHARED_FINGERPRINT_LIMIT:
            return []
        dataset = getattr(dl, "dataset", None)
        what = f"{name}.dataset ({type(dataset).__name__})" if dataset is not None else name
        return [
            (
                ("overlap", name),
                f"{name}: the data-parallel ranks read the same data: {shared:.0%} of the sampled per-sample"
                f" fingerprints of epoch {self._epoch} were drawn on"
                f" more than one rank (batch contents compared; {len(union)} samples in the sketch). {what}"
                " yields the same samples on every rank. Fix: shard it by rank inside __iter__ (keep every"
                " world_size-th sample from torch.distributed.get_rank(), and split across DataLoader workers"
                " with torch.utils.data.get_worker_info()), or use a map-style dataset so that Lightning's"
                " DistributedSampler shards it.",
            )
        ]

    def _order_message(self, name, epoch, missed, stale, repeated, shuffles) -> str:
        evidence = []
        if repeated:
            evidence.append(
                f"epoch {epoch} drew its samples in the same order as epoch {epoch - 1} on every data-parallel"
                " rank although the sampler chain shuffles"
            )
        if stale:
            evidence.append("the epoch of " + ", ".join(stale) + f" is not {epoch}")
        text = f"{name}: " + "; ".join(evidence) + "."
        if missed:
            objs = ", ".join(f"{link.path} ({link.type_name})" for link in missed)
            first = missed[0].path
            text += (
                f" {objs} has set_epoch() but never receives it: Lightning calls set_epoch only on"
                " dataloader.sampler and dataloader.batch_sampler.sampler, so every epoch repeats the same"
                f" order. Fix: call {first}.set_epoch(self.current_epoch) in on_train_epoch_start, keep the"
                " sampler under batch_sampler.sampler, or use SetEpochCheck(fix=True)."
            )
        else:
            which = ", ".join(f"{link.path} ({link.type_name})" for link in shuffles[:2])
            text += (
                f" The shuffling object ({which}) yields the same order each epoch. Fix: seed its shuffle from"
                " the epoch (a set_epoch(epoch) method that Lightning calls on dataloader.sampler) instead of a"
                " fixed seed."
            )
        return text


def _sub_batch(batch: Any, i: int) -> Any:
    if isinstance(batch, dict):
        return list(batch.values())[i]
    if isinstance(batch, (list, tuple)):
        return batch[i]
    return None


def _padding(ds: Any) -> int:
    """Repeated indices a DistributedSampler adds to make the dataset divisible by its replicas."""
    if ds is None or getattr(ds, "drop_last", False):
        return 0
    total, dataset = getattr(ds, "total_size", None), getattr(ds, "dataset", None)
    try:
        return max(0, int(total) - len(dataset))
    except TypeError:
        return max(0, int(getattr(ds, "num_replicas", 1)) - 1)


def _dropped(ds: Any, dl: Any, n_total: int, ranks: int) -> int:
    """Samples drop_last may leave out: the sampler's tail plus each rank's incomplete last batch."""
    per_rank = n_total
    dropped = 0
    if ds is not None:
        per_rank = int(getattr(ds, "num_samples", n_total))
        if getattr(ds, "drop_last", False):
            dropped += max(0, n_total - int(getattr(ds, "total_size", n_total)))
    batch_sampler = unwrap(getattr(dl, "batch_sampler", None))
    if isinstance(batch_sampler, BatchSampler) and batch_sampler.drop_last:
        dropped += ranks * (per_rank % batch_sampler.batch_size)
    return dropped


def _overlap_cause(
    name: str, links: list[ChainLink], ds_link: ChainLink | None, gathered: list, ranks: int
) -> str:
    if ds_link is None:
        sampler = next((link for link in links if link.path.endswith(".sampler")), None)
        what = f"{sampler.path} is {sampler.type_name}, not" if sampler is not None else "there is no"
        return (
            f"{what} a distributed sampler, so every rank reads the whole dataset. Fix: keep"
            " Trainer(use_distributed_sampler=True) (the default), or give the DataLoader"
            " sampler=DistributedSampler(dataset) (num_replicas and rank of the data-parallel group)."
        )
    settings = [g["ds"] for g in gathered]
    return (
        f"{ds_link.path} is {ds_link.type_name} with (num_replicas, rank) = {settings} on the ranks, but the"
        f" data-parallel group has {ranks} ranks and each needs its own rank. Fix: build it with"
        f" num_replicas={ranks} and rank=<data-parallel rank>, or let Lightning insert it"
        " (Trainer(use_distributed_sampler=True), the default)."
    )
