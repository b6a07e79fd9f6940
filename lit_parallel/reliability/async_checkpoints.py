"""Asynchronous checkpoints: ``async_checkpoint=True`` (or ``"auto"``) on every strategy.

A save holds the training step only while this rank's state is copied to host memory; the write and the
commit run on the rank's writer thread (:mod:`lit_parallel.checkpoint.background`). The guarantees are those
of a synchronous save:

- A checkpoint is written under a temporary name and renamed into place (its commit) only after every rank's
  part is written: a single file (``ddp_tuned``) by rank 0 alone; a sharded folder after DCP's final gather of
  every rank's write results, on a gloo process group of its own (:meth:`AsyncCheckpoints.process_group`: a
  collective in a background thread must not share a group with the training's collectives).
- A crash, ``kill -9`` or full disk during a write leaves the previous checkpoints as they were: the new one is
  still under its temporary name, which ``auto_resume`` skips with a warning naming it.
- At most one host copy per rank: a save of a changed state waits for the writes of the previous one (the
  same state saved again, as ``ModelCheckpoint`` does for ``last.ckpt``, reuses the copy).
- ``ModelCheckpoint``'s deletion of older checkpoints and its ``save_last="link"`` links run only after the
  write before them committed (:meth:`AsyncCheckpoints.after_writes`), and never after a failed one.
- ``fit`` returns, and the process exits normally, only after every pending write finished; a failed write is
  raised in the training thread (the next save, the next training batch, or the end of ``fit``).
- SIGTERM / SIGINT: a rank waits up to :data:`SIGNAL_WAIT_S` for its pending write, then exits and says
  whether the checkpoint was committed.

``"auto"``: the first save runs synchronously and is timed; later saves run in the background when it took
longer than :data:`AUTO_STEPS` training steps (the median of the recent steps) and the host copy fits in
:data:`AUTO_MEMORY_SHARE` of the host's available memory, shared by the ranks of the node.
"""

from __future__ import annotations

import atexit
import os
import shutil
import statistics
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from lit_parallel import _compat, _logging
from lit_parallel.checkpoint.background import BackgroundWriter, HostCopy, state_nbytes
from lit_parallel.checkpoint.write import LIGHTNING_META, commit, is_write_failure, write_error
from lit_parallel.formatting import format_bytes as fmt_bytes

AsyncCheckpoint = bool | Literal["auto"]

SIGNAL_WAIT_S = 10.0  # SIGTERM / SIGINT: the longest a rank waits for its pending write before it exits
FAILED_RUN_WAIT_S = 10.0  # after a failed run: the longest the end of fit waits for pending writes
AUTO_STEPS = 3.0  # "auto": background writes when a synchronous save takes longer than this many steps
AUTO_MEMORY_SHARE = 0.5  # "auto": ... and the node's host copies take at most this share of available memory


def check_async_checkpoint(value: Any) -> AsyncCheckpoint:
    """``async_checkpoint``: ``True``, ``False`` or ``"auto"``."""
    if isinstance(value, bool) or (isinstance(value, str) and value == "auto"):
        return value
    raise ValueError(
        f"async_checkpoint={value!r} must be True (write checkpoints in the background: training waits only"
        " for a copy in host memory), False (write them before training goes on) or 'auto' (in the background"
        f" when a save takes longer than {AUTO_STEPS:g} training steps)"
    )


def _available_host_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _local_ranks() -> int:
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


_LIVE: weakref.WeakSet[AsyncCheckpoints] = weakref.WeakSet()


def _wait_at_exit() -> None:
    for checkpoints in list(_LIVE):
        checkpoints.wait_at_exit()


class AsyncCheckpoints:
    """One strategy's asynchronous saves (see the module docstring); ``Reliability.checkpoints``."""

    def __init__(self, setting: AsyncCheckpoint, timeout: timedelta | None = None) -> None:
        self.setting = setting
        self.timeout = timeout
        self.writer = BackgroundWriter()
        self.host: HostCopy | None = None
        self.failed_run = False  # set by the run's failure report: the end of fit waits only a bounded time
        self._group: Any = None
        self._decided: bool | None = True if setting is True else None
        self._size_logged = False
        self._gave_up = False
        if not _LIVE:
            atexit.register(_wait_at_exit)
        _LIVE.add(self)

    # --- whether this save runs in the background -----------------------------------------------------------

    def use_async(self) -> bool:
        """Whether the next save runs in the background (``"auto"``: decided after the first save)."""
        return bool(self._decided)

    def use_async_on_every_rank(self, broadcast: Callable[[Any], Any]) -> bool:
        """:meth:`use_async`, the same on every rank: ``"auto"`` decides from rank 0's first save, so its
        decision is broadcast (a collective: every rank calls it); ``True`` needs no agreement."""
        return self.use_async() if self.setting is True else bool(broadcast(self.use_async()))

    def after_synchronous_save(self, seconds: float, step_seconds: list[float], state: Any) -> None:
        """``"auto"``: decide from the first synchronous save that came after at least one timed step."""
        if self.setting != "auto" or self._decided is not None or not step_seconds:
            return
        step = statistics.median(step_seconds)
        needed = state_nbytes(state) * _local_ranks()
        available = _available_host_bytes()
        fits = available is None or needed <= AUTO_MEMORY_SHARE * available
        self._decided = seconds > AUTO_STEPS * step and fits
        if self._decided:
            why = f"a save took {seconds:.2f} s, more than {AUTO_STEPS:g} training steps ({step:.3f} s each)"
            _logging.info(f"async_checkpoint='auto': later checkpoints are written in the background: {why}")
        elif not fits:
            _logging.info(
                f"async_checkpoint='auto': checkpoints stay synchronous: the host copies of this node's ranks"
                f" ({fmt_bytes(needed)}) would take more than {AUTO_MEMORY_SHARE:.0%} of the available host"
                f" memory ({fmt_bytes(available or 0)})"
            )
        else:
            _logging.info(
                f"async_checkpoint='auto': checkpoints stay synchronous: a save took {seconds:.2f} s, at most"
                f" {AUTO_STEPS:g} training steps ({step:.3f} s each)"
            )

    # --- a save --------------------------------------------------------------------------------------------

    def stage(self, state: Any) -> Any:
        """This rank's ``state`` copied to host memory (the training step waits for this only). Waits for the
        pending writes first unless they read this very state; raises a write that failed meanwhile (the callers
        raise an earlier one before they name the save)."""
        if self.host is None:
            self.host = HostCopy(pin_memory=torch.cuda.is_available())
        if self.writer.pending_writes() and self.host.unchanged(state):
            return self.host.reuse(state)
        waiting = self.writer.pending_writes()
        started = time.monotonic()
        self.writer.wait_for_writes()
        if waiting:
            _logging.debug(
                f"async_checkpoint: this save waited {time.monotonic() - started:.2f} s for the write of"
                f" {', '.join(waiting)} (one host copy per rank)"
            )
        self.raise_failure()
        try:
            staged = self.host.stage(state)
        except BaseException:
            self.host.forget()
            raise
        if not self._size_logged:
            self._size_logged = True
            pinned = "pinned " if self.host.pin_memory else ""
            _logging.info(
                f"async_checkpoint: checkpoints are written in the background from a copy in {pinned}host memory"
                f" of {fmt_bytes(self.host.nbytes)} per rank (rank 0), allocated once and reused by every save;"
                " a save waits for the previous write when the state changed since"
            )
        return staged

    def submit(self, write: Callable[[], None], destination: Any) -> None:
        self.writer.submit(write, str(destination))

    def after_writes(self, action: Callable[[], None], what: str) -> bool:
        """Run ``action`` after the pending writes commit (``False``: none pending, run it now yourself)."""
        return self.writer.after_writes(action, what)

    def pending(self, destination: Any) -> bool:
        """Whether ``destination``'s write is queued or running, or failed without being raised yet."""
        path = str(destination)
        return path in self.writer.pending_writes() or self.writer.failed_write == path

    def process_group(self) -> Any:
        """The gloo group the background DCP writes use, created at the first one (a collective: every rank
        calls it at the same save)."""
        if self._group is not None:
            try:
                dist.get_rank(self._group)
            except (RuntimeError, ValueError):  # destroyed with the process groups after a failed run
                self._group = None
        if self._group is None:
            kwargs = {} if self.timeout is None else {"timeout": self.timeout}
            self._group = dist.new_group(backend="gloo", **kwargs)
        return self._group

    # --- failures and the end -------------------------------------------------------------------------------

    def raise_failure(self) -> None:
        failure = self.writer.take_failure()
        if failure is None:
            return
        note = (
            "lit_parallel: this checkpoint was written in the background (async_checkpoint); the checkpoints"
            " committed before it are untouched"
        )
        if note not in getattr(failure, "__notes__", ()):
            failure.add_note(note)
        raise failure

    def finish(self) -> None:
        """The end of ``fit`` / ``validate`` / ``test``: wait for every pending write (after a failed run at
        most :data:`FAILED_RUN_WAIT_S`, naming what is left unfinished) and raise a failed one."""
        failed, self.failed_run = self.failed_run, False  # the next fit of this strategy starts afresh
        if failed:
            if not self.writer.wait(FAILED_RUN_WAIT_S):
                self._gave_up = True  # a write stuck with a dead peer: the exit does not wait for it either
                left = self.writer.pending_writes()
                _logging.warning(
                    f"async_checkpoint: the run failed and the background write of {', '.join(left)} did not"
                    f" finish within {FAILED_RUN_WAIT_S:g} s; it stays under its temporary name (never loaded,"
                    " skipped by auto_resume) and the checkpoints committed before it are untouched"
                )
            self.writer.take_failure()
            return
        self.writer.wait()
        self.raise_failure()

    def wait_on_signal(self, timeout: float = SIGNAL_WAIT_S) -> str:
        """Called when a signal ends the process: wait up to ``timeout`` seconds; what to report."""
        pending = self.writer.pending_writes()
        if not pending:
            return ""
        started = time.monotonic()
        if self.writer.wait_for_writes(timeout):
            failure = self.writer.failed_write
            if failure is not None:
                return f"the background write of {failure} failed; the checkpoints before it are untouched"
            return (
                f"waited {time.monotonic() - started:.1f} s for the background write of {', '.join(pending)}:"
                " committed"
            )
        left = self.writer.pending_writes()
        return (
            f"the background write of {', '.join(left)} did not finish within {timeout:g} s: it is not saved"
            " (left under its temporary name, skipped by auto_resume); the checkpoints committed before it are"
            " untouched"
        )

    def wait_at_exit(self) -> None:
        """At the interpreter's exit: a pending write finishes first (bounded after a failed run)."""
        self.writer.wait(FAILED_RUN_WAIT_S if self.failed_run or self._gave_up else None)


# --- the writes -----------------------------------------------------------------------------------------


def write_sharded(
    dcp_state: dict[str, Any], meta: dict[str, Any] | None, partial: Path, path: Path, group: Any
) -> None:
    """One rank's part of a sharded checkpoint, on the writer thread: rank 0 writes Lightning's ``meta.pt``,
    every rank its DCP shards, rank 0 DCP's ``.metadata`` (after DCP gathered every rank's write results, so
    after every rank's write) and then commits. Every rank takes part in both collectives even when one
    failed, so a failure ends the write on every rank instead of leaving the others waiting."""
    from torch.distributed.checkpoint import save

    rank0 = meta is not None
    try:
        partial.mkdir(parents=True, exist_ok=True)
        own: BaseException | None = None
        if rank0:
            try:
                torch.save(meta, partial / LIGHTNING_META)
            except BaseException as err:
                own = err
        ok = torch.tensor([0 if own is not None else 1], dtype=torch.int32)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
        if own is not None:
            raise own
        if int(ok.item()) == 0:
            raise RuntimeError(
                f"rank 0 could not write {LIGHTNING_META} of {str(path)!r}: see rank 0's error"
            )
        save(dcp_state, checkpoint_id=partial, process_group=group)
    except BaseException as err:
        translated = write_error(err, path) if is_write_failure(err) else None
        if rank0:
            shutil.rmtree(partial, ignore_errors=True)
        if translated is None:
            raise
        raise translated from err
    if rank0:
        commit(partial, path)


def remove_after_writes(checkpoints: AsyncCheckpoints | None, remove: Callable[[], None], path: Any) -> None:
    """``ModelCheckpoint``'s deletion of an older checkpoint: after the pending writes committed."""
    if checkpoints is None or not checkpoints.after_writes(remove, f"remove {path}"):
        remove()


def link_after_writes(checkpoints: AsyncCheckpoints, callback: Any) -> None:
    """``ModelCheckpoint(save_last="link")``: link ``last.ckpt`` to a checkpoint only after its write
    committed (Lightning links as soon as ``trainer.save_checkpoint`` returns)."""

    def wrap(original: Callable[..., None]) -> Callable[..., None]:
        def link_checkpoint(trainer: Any, filepath: str, linkpath: str) -> None:
            if trainer.is_global_zero and checkpoints.pending(filepath):
                checkpoints.after_writes(lambda: _link(filepath, linkpath), f"link {linkpath} -> {filepath}")
                trainer.strategy.barrier()
                return
            original(trainer, filepath, linkpath)

        link_checkpoint.lit_parallel = True  # type: ignore[attr-defined]
        return link_checkpoint

    _compat.wrap_link_checkpoint(callback, wrap)


def _link(filepath: str, linkpath: str) -> None:
    """Lightning's link, made on the writer thread: the new link replaces the old one in one rename."""
    if os.path.abspath(filepath) == os.path.abspath(linkpath):
        return
    target = os.path.relpath(filepath, os.path.dirname(linkpath))
    if os.path.isdir(linkpath) and not os.path.islink(linkpath):
        shutil.rmtree(linkpath)  # as Lightning does: a copy saved as last before
    tmp = f"{linkpath}.lit_parallel_link"
    if os.path.lexists(tmp):
        os.remove(tmp)
    os.symlink(target, tmp)
    os.replace(tmp, linkpath)
