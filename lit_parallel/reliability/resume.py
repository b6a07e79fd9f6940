"""Resume: a mid-epoch checkpoint skips the batches the epoch already used (or is refused with the reason);
``auto_resume`` finds the newest complete checkpoint when ``fit`` is given none."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import BatchSampler, DistributedSampler, IterableDataset, Sampler, SequentialSampler

from lit_parallel import _compat, _logging
from lit_parallel.checkpoint.load import (
    PARTIAL_PREFIX,
    IncompleteCheckpointError,
    NotACheckpointError,
    UnsafeCheckpointError,
    verify_checkpoint,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl


class ResumeRNG(Protocol):
    """What a mid-epoch resume reads and sets of the run's state (the strategy's ``Reliability``): the RNG
    states a restore brought back, and those in effect at the resumed epoch's first batch."""

    rng_restored: dict | None
    rng_at_first_batch: dict | None


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


def resume_mid_epoch(reliability: ResumeRNG, trainer: pl.Trainer, loader: Any) -> None:
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


# --- auto_resume: the newest complete checkpoint, without a ckpt_path --------------------------------------


def checkpoint_candidates(
    folders: Iterable[str | Path], extensions: Iterable[str] = (".ckpt",)
) -> list[Path]:
    """Checkpoints (files or sharded folders) directly in ``folders``, newest first (modification time, then
    name); temporary data of interrupted saves is never a candidate."""
    suffixes = tuple(extensions)
    found: dict[Path, tuple[int, str]] = {}
    for folder in dict.fromkeys(Path(f) for f in folders):
        if not folder.is_dir():
            continue
        for entry in folder.iterdir():
            if entry.name.startswith(PARTIAL_PREFIX) or not entry.name.endswith(suffixes):
                continue
            try:
                found[entry] = (entry.stat().st_mtime_ns, entry.name)
            except OSError:  # removed meanwhile, or a dangling link
                continue
    return sorted(found, key=found.__getitem__, reverse=True)


def newest_complete_checkpoint(
    folders: Iterable[str | Path], extensions: Iterable[str] = (".ckpt",)
) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint in ``folders`` that :func:`~lit_parallel.checkpoint.load.verify_checkpoint` finds
    complete, and the newer ones skipped with the reason (truncated, missing files, not a checkpoint)."""
    skipped: list[tuple[Path, str]] = []
    chosen = None
    for path in checkpoint_candidates(folders, extensions):
        try:
            verify_checkpoint(path)
        except (IncompleteCheckpointError, NotACheckpointError, UnsafeCheckpointError, OSError) as err:
            skipped.append((path, str(err)))
            continue
        chosen = path
        break
    return chosen, skipped + _interrupted_saves(folders, newer_than=chosen)


def _interrupted_saves(folders: Iterable[str | Path], newer_than: Path | None) -> list[tuple[Path, str]]:
    """Saves that never committed (a process killed during a write, synchronous or in the background), newer
    than ``newer_than``: never candidates, reported so that a user knows the newest checkpoint is not there."""
    try:
        since = newer_than.stat().st_mtime_ns if newer_than is not None else -1
    except OSError:
        since = -1
    found = []
    for folder in dict.fromkeys(Path(f) for f in folders):
        if not folder.is_dir():
            continue
        for entry in folder.iterdir():
            try:
                mtime = entry.stat().st_mtime_ns
            except OSError:
                continue
            if entry.name.startswith(PARTIAL_PREFIX) and mtime > since:
                found.append((mtime, entry))
    return [
        (
            entry,
            f"{str(entry)!r} is an interrupted save: written under a temporary name and never committed (the"
            " process ended during its write), so it holds no complete checkpoint; it may be deleted",
        )
        for _, entry in sorted(found, reverse=True)
    ]


def _search_folders(trainer: pl.Trainer) -> tuple[list[str], list[str]]:
    """Where ``auto_resume`` looks: every ModelCheckpoint's folder, then the Trainer's ``default_root_dir``
    (Lightning's SLURM requeue saves ``hpc_ckpt_N.ckpt`` there); and the file extensions they write."""
    folders, extensions = [], [".ckpt"]
    for callback in trainer.checkpoint_callbacks:
        if getattr(callback, "dirpath", None):
            folders.append(str(callback.dirpath))
        extensions.append(getattr(callback, "FILE_EXTENSION", ".ckpt"))
    folders.append(str(trainer.default_root_dir))
    return [f for f in folders if "://" not in f], list(dict.fromkeys(extensions))


def choose_auto_resume(strategy: Any, trainer: pl.Trainer) -> str | None:
    """Rank 0 chooses the newest complete checkpoint (reporting the newer ones it skips); every rank gets
    rank 0's choice. A collective: every rank calls it."""
    choice = None
    if strategy.global_rank == 0:
        folders, extensions = _search_folders(trainer)
        path, skipped = newest_complete_checkpoint(folders, extensions)
        for bad, reason in skipped:
            _logging.warning(f"auto_resume: skipping the newer checkpoint {str(bad)!r}: {reason}")
        where = ", ".join(repr(f) for f in dict.fromkeys(folders))
        if path is None:
            _logging.info(
                f"auto_resume: no complete checkpoint in {where}: training starts from the beginning"
            )
        else:
            _logging.info(
                f"auto_resume: resuming from {str(path)!r}, the newest complete checkpoint in {where}"
            )
            choice = str(path)
    return strategy.broadcast(choice)


def install_auto_resume(strategy: Any) -> None:
    """``fit`` without ``ckpt_path`` (or ``ckpt_path="last"`` that finds nothing) resumes from the newest
    complete checkpoint when ``strategy.auto_resume`` is on. Call once the process group exists."""
    module = strategy.lightning_module
    trainer = _compat.attached_trainer(module) if module is not None else None
    if not getattr(strategy, "auto_resume", False) or trainer is None:
        return

    def wrap(resume_start: Any) -> Any:
        def auto_resume_start(checkpoint_path: Any = None, weights_only: bool | None = None) -> None:
            current = trainer.strategy
            if (
                checkpoint_path is None
                and getattr(current, "auto_resume", False)
                and trainer.state.fn == TrainerFn.FITTING
            ):
                checkpoint_path = choose_auto_resume(current, trainer)
            resume_start(checkpoint_path, weights_only=weights_only)

        auto_resume_start.lit_parallel = True  # type: ignore[attr-defined]
        return auto_resume_start

    _compat.wrap_resume_start(trainer, wrap)
