"""Mid-epoch resume: skip the batches the epoch already used, or refuse with the reason."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from torch.utils.data import BatchSampler, DistributedSampler, IterableDataset, Sampler, SequentialSampler

from lit_parallel import _logging

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lit_parallel.reliability.core import Reliability


class _SkipFirst(Sampler):
    """``sampler`` without its first ``skip`` indices, once: the rest of the epoch a checkpoint stopped in.
    Its length stays the whole epoch's (Lightning counts the skipped batches as done)."""

    def __init__(self, sampler: Sampler, skip: int) -> None:
        self.sampler = sampler
        self.skip = skip

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.sampler)
        skip, self.skip = self.skip, 0
        for _ in itertools.islice(it, skip):
            pass
        yield from it

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        if callable(getattr(self.sampler, "set_epoch", None)):
            self.sampler.set_epoch(epoch)


def _is_stateful(loader: Any) -> bool:
    return callable(getattr(loader, "state_dict", None)) and callable(
        getattr(loader, "load_state_dict", None)
    )


_MID_EPOCH_FIX = (
    "Fix: resume from a checkpoint taken at the end of an epoch (ModelCheckpoint(every_n_epochs=1)), use"
    " Lightning's DistributedSampler (use_distributed_sampler=True, the default) or a SequentialSampler, or"
    " a dataloader that saves its position (state_dict()/load_state_dict(), e.g. torchdata's"
    " StatefulDataLoader)."
)


def resume_mid_epoch(reliability: Reliability, trainer: pl.Trainer, loader: Any) -> None:
    """Continue a mid-epoch checkpoint with the first batch the epoch has not used, or refuse."""
    fit_loop = trainer.fit_loop
    progress = fit_loop.epoch_loop.batch_progress.current
    done = progress.ready
    try:
        n = len(loader)
    except TypeError:
        n = None
    if not fit_loop.restarting or done == 0 or (n is not None and done >= n):
        return
    epoch = fit_loop.epoch_progress.current.processed
    where = f"epoch {epoch} after {done} of {n if n is not None else '?'} batches"
    rng, reliability.rng_restored = reliability.rng_restored, None
    if progress.processed != progress.ready:
        raise RuntimeError(
            f"cannot resume exactly from this checkpoint: it was saved in the middle of a training batch"
            f" ({where}). Save checkpoints from on_train_batch_end or at epoch ends."
        )
    accumulate = trainer.accumulate_grad_batches
    if done % accumulate:
        raise RuntimeError(
            f"cannot resume exactly from this checkpoint: it was saved in {where}, in the middle of a"
            f" gradient accumulation window of {accumulate} batches, and accumulated gradients are not"
            " part of a checkpoint. Save at optimizer steps (ModelCheckpoint(every_n_train_steps=...)) or at"
            " epoch ends."
        )
    if _is_stateful(loader):
        # Lightning restored the loader's own position
        reliability.rng_at_first_batch = rng
        return
    dataset = getattr(loader, "dataset", None)
    batch_sampler = getattr(loader, "batch_sampler", None)
    sampler = getattr(batch_sampler, "sampler", None)
    supported = (
        not isinstance(dataset, IterableDataset)
        and type(batch_sampler) is BatchSampler
        and isinstance(sampler, (DistributedSampler, SequentialSampler))
    )
    if not supported:
        what = (
            "an IterableDataset"
            if isinstance(dataset, IterableDataset)
            else f"sampler {type(sampler).__name__ if sampler is not None else type(batch_sampler).__name__}"
        )
        raise RuntimeError(
            f"cannot resume exactly from this mid-epoch checkpoint ({where}): the train dataloader uses"
            f" {what}, whose position in the epoch cannot be restored, so resuming would repeat or skip"
            f" batches. {_MID_EPOCH_FIX}"
        )
    batch_sampler.sampler = _SkipFirst(sampler, done * batch_sampler.batch_size)
    reliability.rng_at_first_batch = rng
    warnings.filterwarnings(
        "ignore", message="You're resuming from a checkpoint that ended before the epoch ended"
    )
    _logging.info(
        f"resuming mid-epoch: {where}; the sampler skips the {done * batch_sampler.batch_size} samples"
        " per rank that epoch already used"
    )
