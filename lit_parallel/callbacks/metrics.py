"""CrossRankMetrics: validation and test metrics that equal the single-process value on the same data."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import BatchSampler, DistributedSampler

from lit_parallel._compat import combined_loader, metric_progress, restore_metric_progress
from lit_parallel.callbacks.data_parallel import (
    DataParallelGroup,
    ParallelTrainingWarning,
    data_parallel_group,
)
from lit_parallel.callbacks.patching import patch_attribute
from lit_parallel.callbacks.samplers import (
    add_dataloader_hook,
    add_tap,
    distributed_sampler,
    find_tap,
    index_sampler,
    remove_dataloader_hook,
    remove_tap,
    sampler_chain,
)

_EVAL_STAGES = (RunningStage.VALIDATING, RunningStage.SANITY_CHECKING, RunningStage.TESTING)


@dataclass(frozen=True)
class _Padding:
    """Which positions of a DistributedSampler's shard are padding: ``rank + pos * replicas >= length``.

    ``DistributedSampler`` appends the first indices again until the dataset divides evenly, then gives
    rank ``r`` the positions ``r, r + R, r + 2R, ...`` of that list; whatever lands past the dataset's
    length is a repeat, evaluated already elsewhere.
    """

    rank: int
    replicas: int
    length: int

    def is_padding(self, pos: int) -> bool:
        return self.rank + pos * self.replicas >= self.length


@dataclass(frozen=True)
class BatchSamples:
    """The dataset indices of one evaluation batch and how many of its samples count."""

    indices: tuple[int, ...]
    counted: int


class _EvalTap:
    """Tap on an evaluation index sampler: drops padding repeats from partly padded batches.

    A batch made only of repeats is yielded whole (every rank keeps the same number of batches, which
    sharded strategies need) and marked as counting nothing.
    """

    def __init__(self, padding: _Padding | None, counts_samples: bool) -> None:
        self.padding = padding
        self.counts_samples = counts_samples
        self.batches: list[BatchSamples] = []

    def __call__(self, sampler: Any, it: Any) -> Any:
        self.batches = []
        return self._run(it, self.batches)

    def _run(self, it: Any, batches: list[BatchSamples]) -> Any:
        pos = 0
        for item in it:
            single = not isinstance(item, (list, tuple))
            idx = [item] if single else list(item)
            kept = idx
            if self.padding is not None:
                kept = [i for j, i in enumerate(idx) if not self.padding.is_padding(pos + j)]
                pos += len(idx)
            if kept and len(kept) < len(idx):
                item, idx = kept, kept
            try:
                indices = tuple(int(i) for i in idx)
            except (TypeError, ValueError):
                indices = ()
            batches.append(BatchSamples(indices, len(kept) if self.counts_samples else 0))
            yield item


class _Exclusion:
    """Leaves the current batch's repeats out of torchmetrics states and of ``self.log`` reductions.

    While a batch counts nothing, torchmetrics ``update`` calls are skipped, and ``forward`` still
    returns the batch value but the metric states are restored afterwards. During the whole evaluation
    ``self.log`` is wrapped: plain values of a batch that counts nothing get weight 0 (``"mean"``) or
    add 0 (``"sum"``); max/min pass unchanged, as repeats cannot change them. Mean-reduced values get a
    float batch size, because Lightning keeps the summed batch size as an integer and, with
    ``sync_dist=True``, averages it across ranks with integer division: exact per-rank counts such as 4
    and 3 would otherwise give 3 instead of 3.5.
    """

    def __init__(self) -> None:
        self.module: Any = None
        self.undo_log: Callable[[], None] | None = None
        self.undo_metrics: list[Callable[[], None]] = []
        self.inside = 0
        self.batch: Any = None
        self.batch_size: int | None = None
        self.excluded = False

    def attach(self, pl_module: Any) -> None:
        """Wrap ``pl_module.log`` for the evaluation run."""
        if self.module is pl_module:
            return
        self.detach()
        self.module = pl_module
        original_log = pl_module.log
        signature = inspect.signature(original_log)

        def log(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            arguments = bound.arguments
            value = arguments.get("value")
            kind = _reduction(arguments.get("reduce_fx", "mean"))
            if isinstance(value, (torch.Tensor, int, float)) and not isinstance(value, bool):
                if kind == "mean":
                    if self.excluded:
                        arguments["batch_size"] = 0.0
                    else:
                        size = arguments.get("batch_size")
                        if size is None and self.batch is not None:
                            if self.batch_size is None:
                                self.batch_size = extract_batch_size(self.batch)
                            size = self.batch_size
                        if size is not None:
                            arguments["batch_size"] = float(size)
                elif kind == "sum" and self.excluded:
                    arguments["value"] = torch.zeros_like(value) if isinstance(value, torch.Tensor) else 0.0
            return original_log(*bound.args, **bound.kwargs)

        self.undo_log = patch_attribute(pl_module, "log", log)

    def detach(self) -> None:
        self.set_batch(None, excluded=False)
        if self.undo_log is not None:
            self.undo_log()
            self.undo_log = None
        self.module = None

    def set_batch(self, batch: Any, excluded: bool) -> None:
        self.batch = batch
        self.batch_size = None
        if excluded and not self.excluded and self.module is not None:
            from torchmetrics import Metric

            for metric in self.module.modules():
                if isinstance(metric, Metric):
                    self._wrap(metric)
        elif not excluded and self.excluded:
            for undo in reversed(self.undo_metrics):
                undo()
            self.undo_metrics = []
        self.excluded = excluded and self.module is not None

    def _wrap(self, metric: Any) -> None:
        original_update = metric.update
        original_forward = metric.forward

        def update(*args: Any, **kwargs: Any) -> Any:
            if self.inside:
                return original_update(*args, **kwargs)
            return None

        def forward(*args: Any, **kwargs: Any) -> Any:
            if self.inside:
                return original_forward(*args, **kwargs)
            saved = _metric_states(metric)
            self.inside += 1
            try:
                return original_forward(*args, **kwargs)
            finally:
                self.inside -= 1
                _restore_metric_states(saved)

        self.undo_metrics.append(patch_attribute(metric, "update", update))
        self.undo_metrics.append(patch_attribute(metric, "forward", forward))


def _reduction(reduce_fx: Any) -> str:
    if isinstance(reduce_fx, str):
        name = reduce_fx.lower()
        return "mean" if name == "avg" else name
    for name in ("mean", "sum", "max", "min"):
        if reduce_fx is getattr(torch, name) or reduce_fx is {"sum": sum, "max": max, "min": min}.get(name):
            return name
    return "other"


def _metric_states(metric: Any) -> list[tuple[Any, dict, int, Any]]:
    from torchmetrics import Metric

    saved = []
    for m in metric.modules():
        if isinstance(m, Metric):
            states = {}
            for attr in m.metric_state:
                value = getattr(m, attr)
                states[attr] = value.clone() if isinstance(value, torch.Tensor) else list(value)
            saved.append((m, states, metric_progress(m)))
    return saved


def _restore_metric_states(saved: list[tuple[Any, dict, tuple[int, Any]]]) -> None:
    for m, states, progress in saved:
        for attr, value in states.items():
            setattr(m, attr, value)
        restore_metric_progress(m, progress)


class CrossRankMetrics(Callback):
    """Makes validation and test metrics under N ranks equal the single-process value on the same data.

    Under ``DistributedSampler`` every rank evaluates the same number of samples, so the shards are
    padded with repeats (7 samples on 2 ranks are evaluated as 8). This callback removes the repeats:

    - a partly padded batch loses its repeated samples before it is loaded, so the step, the metric
      updates and the batch size Lightning weighs ``self.log`` values with see only real samples;
    - a batch made only of repeats is kept (every rank runs the same number of batches; sharded
      strategies run collectives in every forward) but counts nothing: torchmetrics updates are skipped
      (``forward`` still returns the batch value), plain values logged with ``reduce_fx="mean"`` get
      weight 0 and those with ``"sum"`` add 0.

    Metrics logged as torchmetrics objects (``self.log(name, metric)``) and plain tensors logged with
    ``sync_dist=True`` then equal the single-process value, in ``fit``'s validation, ``validate`` and
    ``test``, for any dataset length and world size. On the ranks of a tensor-parallel group that read
    the same samples as a lower rank, every batch counts nothing, so each sample is counted once.
    Metrics must be submodules of the LightningModule (as torchmetrics recommends).

    For metrics that need every prediction (AUROC, mAP, retrieval), collect per-sample outputs with
    :func:`current_sample_indices` and merge them with :func:`gather_by_index`.
    """

    def __init__(self) -> None:
        self._dp: DataParallelGroup | None = None
        self._tapped: list[tuple[Any, _EvalTap]] = []
        self._exclusion = _Exclusion()
        self._current: BatchSamples | None = None
        self._warned: set[str] = set()
        self._trainer: Any = None

    # ----------------------------------------------------------------------------------------- hooks
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._trainer = trainer
        self._dp = None
        add_dataloader_hook(trainer, self._on_dataloader)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._exclusion.detach()
        self._trainer = None
        remove_dataloader_hook(trainer, self._on_dataloader)
        for dataloader, tap in self._tapped:
            remove_tap(dataloader, tap)
        self._tapped.clear()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._exclusion.detach()

    def _on_dataloader(self, dataloader: Any, stage: Any) -> None:
        if stage not in _EVAL_STAGES:
            return
        dp = self._dp = self._dp or data_parallel_group(self._trainer.strategy)
        sampler = index_sampler(dataloader)
        links = sampler_chain(dataloader, "dataloader") if sampler is not None else []
        ds_link = distributed_sampler(links)
        padding, problem = _padding_plan(sampler, ds_link.obj if ds_link is not None else None)
        if problem:
            self._warn_once(problem)
        if sampler is None:
            return
        if ds_link is None and dp.size > 1 and not isinstance(sampler, DistributedSampler):
            self._warn_once(
                f"CrossRankMetrics: an evaluation dataloader has no distributed sampler ({type(sampler).__name__}"
                f" over {_length(dataloader)} samples), so each of the {dp.size} data-parallel ranks evaluates"
                " every sample and metrics synchronized across ranks count each sample"
                f" {dp.size} times. Fix: keep Trainer(use_distributed_sampler=True) (the default)."
            )
        existing = find_tap(dataloader, _EvalTap)
        if existing is not None:
            remove_tap(dataloader, existing)
        tap = _EvalTap(padding, dp.counts_samples)
        if add_tap(dataloader, tap):
            self._tapped.append((dataloader, tap))

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._dp = data_parallel_group(trainer.strategy)
        self._exclusion.attach(pl_module)

    on_test_start = on_validation_start

    def on_validation_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._exclusion.attach(pl_module)
        self._current = self._batch_samples(trainer, batch_idx, dataloader_idx)
        counts = self._dp.counts_samples if self._dp is not None else True
        excluded = (self._current is not None and self._current.counted == 0) or not counts
        # The exclusion lasts until the next batch or the epoch's end, so that values the module logs in
        # its own on_validation_batch_end (called after this callback's) are covered too.
        self._exclusion.set_batch(batch, excluded)

    on_test_batch_start = on_validation_batch_start

    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        # Callbacks' epoch-end hooks run before the module's, whose own logging is left alone.
        self._exclusion.set_batch(None, excluded=False)
        self._current = None

    on_test_epoch_end = on_validation_epoch_end

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._exclusion.detach()
        self._current = None

    on_test_end = on_validation_end

    # ------------------------------------------------------------------------------------- internals
    def current_samples(self) -> BatchSamples | None:
        return self._current

    def _batch_samples(self, trainer: Any, batch_idx: int, dataloader_idx: int) -> BatchSamples | None:
        loaders = _eval_dataloaders(trainer)
        if dataloader_idx >= len(loaders):
            return None
        tap = find_tap(loaders[dataloader_idx], _EvalTap)
        if tap is None or batch_idx >= len(tap.batches):
            return None
        return tap.batches[batch_idx]

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            rank_zero_warn(message, category=ParallelTrainingWarning)


def _length(dataloader: Any) -> Any:
    try:
        return len(dataloader.dataset)
    except TypeError:
        return "?"


def _padding_plan(sampler: Any, ds: Any) -> tuple[_Padding | None, str | None]:
    """Where the padding repeats of ``ds`` sit in the batches ``sampler`` yields (or why we cannot tell)."""
    if ds is None or getattr(ds, "drop_last", False):
        return None, None
    try:
        length = len(ds.dataset)
    except TypeError:
        return None, None
    if int(ds.total_size) <= length:
        return None, None
    padding = _Padding(int(ds.rank), int(ds.num_replicas), length)
    if sampler is ds:
        return padding, None
    if (
        isinstance(sampler, BatchSampler)
        and type(sampler).__iter__ is BatchSampler.__iter__
        and sampler.sampler is ds
    ):
        return padding, None
    return None, (
        f"CrossRankMetrics: {type(sampler).__name__} batches the evaluation DistributedSampler in its own way,"
        f" so the {int(ds.total_size) - length} padding repeats it adds to {length} samples cannot be located"
        " and stay in the metrics. Fix: evaluate with a plain BatchSampler (DataLoader(batch_size=...))."
    )


def _eval_dataloaders(trainer: Any) -> list[Any]:
    if trainer.testing:
        loop = trainer.test_loop
    elif trainer.state.fn == TrainerFn.VALIDATING:
        loop = trainer.validate_loop
    else:
        loop = trainer.fit_loop.epoch_loop.val_loop
    combined = combined_loader(loop)
    return list(combined.flattened) if combined is not None else []


def current_sample_indices(trainer: Any) -> torch.Tensor:
    """Dataset indices of the samples in the current validation/test batch, in batch order.

    Needs :class:`CrossRankMetrics` in the trainer's callbacks and a map-style dataset. Merge per-sample
    outputs collected with these indices across ranks with :func:`gather_by_index`.
    """
    callback = next((c for c in trainer.callbacks if isinstance(c, CrossRankMetrics)), None)
    if callback is None:
        raise RuntimeError(
            "current_sample_indices() reads the indices CrossRankMetrics records; add it:"
            " Trainer(callbacks=[lit_parallel.CrossRankMetrics(), ...])"
        )
    samples = callback.current_samples()
    if samples is None or not samples.indices:
        raise RuntimeError(
            "current_sample_indices(): no dataset indices for this batch; call it inside validation_step or"
            " test_step of a DataLoader over a map-style dataset (an IterableDataset has no indices)"
        )
    return torch.tensor(samples.indices, dtype=torch.int64)


def gather_by_index(
    indices: torch.Tensor, outputs: Mapping[str, torch.Tensor], group: Any = None
) -> dict[str, torch.Tensor]:
    """Per-sample outputs of every rank, each sample once, in dataset order (identical on every rank).

    Args:
        indices: this rank's dataset indices (1-D), e.g. from :func:`current_sample_indices`.
        outputs: tensors whose first dimension matches ``indices`` (predictions, targets, ...).
        group: process group to gather over; default the whole world. Repeats (DistributedSampler
            padding, tensor-parallel peers that evaluate the same samples) are dropped by index, keeping
            the lowest rank's copy.

    Returns:
        ``{"index": sorted unique indices, **outputs}``, on the devices the inputs were on.
    """
    indices = torch.as_tensor(indices).reshape(-1).to(torch.int64)
    for name, value in outputs.items():
        if value.shape[0] != indices.shape[0]:
            raise ValueError(
                f"gather_by_index: outputs[{name!r}] has {value.shape[0]} rows but there are"
                f" {indices.shape[0]} indices; pass one row per sample"
            )
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        all_indices = _all_gather_rows(indices, group)
        gathered = {name: _all_gather_rows(value, group) for name, value in outputs.items()}
    else:
        all_indices, gathered = indices, dict(outputs)
    order = torch.sort(all_indices.cpu(), stable=True)
    sorted_idx = order.values
    keep = torch.ones_like(sorted_idx, dtype=torch.bool)
    keep[1:] = sorted_idx[1:] != sorted_idx[:-1]
    pick = order.indices[keep]
    result = {"index": sorted_idx[keep].to(indices.device)}
    for name, value in gathered.items():
        result[name] = value[pick.to(value.device)]
    return result


def _all_gather_rows(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """Tensors with the same trailing shape but any number of rows, concatenated in rank order."""
    world = dist.get_world_size(group)
    device = tensor.device
    if "nccl" in str(dist.get_backend(group)).lower() and device.type == "cpu":
        device = torch.device("cuda", torch.cuda.current_device())
    t = tensor.detach().to(device).contiguous()
    rows = torch.tensor([t.shape[0]], device=device)
    all_rows = [torch.zeros_like(rows) for _ in range(world)]
    dist.all_gather(all_rows, rows, group=group)
    counts = [int(r) for r in all_rows]
    padded = torch.zeros((max(counts), *t.shape[1:]), dtype=t.dtype, device=device)
    padded[: t.shape[0]] = t
    out = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(out, padded, group=group)
    return torch.cat([o[:c] for o, c in zip(out, counts)]).to(tensor.device)
