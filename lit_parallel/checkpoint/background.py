"""Checkpoint writes that run in the background while training goes on.

A save in the background has two parts. The training step waits only for the first: a copy of the state in
host memory (:class:`HostCopy`: allocated once, pinned on CUDA, reused by every later save). The second, the
write of that copy and its commit (the rename into place that makes the checkpoint visible), runs on this
process's one writer thread (:class:`BackgroundWriter`), in the order the saves were made.

Host memory is bounded to one copy: a save whose state differs from the copy waits until every write that
reads the copy has finished (:meth:`BackgroundWriter.wait_for_writes`). A save of the same state again (the
same tensors, unchanged since: Lightning's ``ModelCheckpoint`` writes ``step=N.ckpt`` and then ``last.ckpt``)
reuses the copy without waiting and without copying (:meth:`HostCopy.unchanged`).

Work that must follow a write (deleting an older checkpoint, pointing a link at the new one) is queued
behind it (:meth:`BackgroundWriter.after_writes`) and dropped when a write before it failed, so a failed
write never costs the checkpoints that were there before it. A failure is kept and raised in the training
thread by :meth:`BackgroundWriter.take_failure` (at the next save, the next training batch, or the end).

No Lightning here: :mod:`lit_parallel.reliability.async_checkpoints` connects this to the strategies.
"""

from __future__ import annotations

import collections
import copy
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lit_parallel import _compat


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (its own storage), or the tensor itself."""
    if isinstance(tensor, DTensor):
        with torch.no_grad():
            return tensor.to_local()
    return tensor


def _is_container(obj: Any) -> bool:
    return isinstance(obj, (dict, list, tuple)) and not isinstance(obj, torch.Tensor)


def _items(obj: Any) -> list[tuple[Any, Any]]:
    return list(obj.items()) if isinstance(obj, dict) else list(enumerate(obj))


def _leaves(obj: Any, path: tuple = ()) -> list[tuple[tuple, torch.Tensor]]:
    """The tensors of a nested state (dicts, lists, tuples), each with its place in it."""
    if isinstance(obj, torch.Tensor):
        return [(path, obj)]
    if _is_container(obj):
        return [leaf for key, value in _items(obj) for leaf in _leaves(value, (*path, key))]
    return []


def _kind(tensor: torch.Tensor) -> tuple:
    local = _local(tensor)
    return (isinstance(tensor, DTensor), tuple(tensor.shape), tuple(local.shape), tensor.dtype)


def _same_tensor(tensor: torch.Tensor) -> tuple:
    """What identifies a tensor's contents: its memory and view (tied weights are one tensor under two names)."""
    local = _local(tensor)
    return (local.device.type, local.data_ptr(), local.storage_offset(), tuple(local.stride()), _kind(tensor))


def _fingerprint(leaves: list[tuple[tuple, torch.Tensor]]) -> list:
    """Each tensor's place, kind, storage and version counter: unchanged only if no tensor was replaced or
    modified in place since."""
    out = []
    for path, tensor in leaves:
        local = _local(tensor)
        out.append((path, _kind(tensor), local.data_ptr(), local._version, local.device.type))
    return out


def _nbytes(tensor: torch.Tensor) -> int:
    local = _local(tensor)
    return local.numel() * local.element_size()


def state_nbytes(state: Any) -> int:
    """The bytes of this process's tensors in a nested state (a DTensor counts its local shard)."""
    return sum(_nbytes(t) for _, t in _leaves(state))


def _fill(
    state: Any, buffers: dict[tuple, torch.Tensor], copy_tensors: bool, non_blocking: bool, path=()
) -> Any:
    """``state`` with every tensor replaced by its buffer (copied into first when ``copy_tensors``) and every
    other value deep-copied (training may change a callback's state after the save returned)."""
    if isinstance(state, torch.Tensor):
        buffer = buffers[path]
        if copy_tensors:
            with torch.no_grad():
                _local(buffer).copy_(_local(state), non_blocking=non_blocking)
        return buffer
    if _is_container(state):
        if isinstance(state, dict):
            out = {k: _fill(v, buffers, copy_tensors, non_blocking, (*path, k)) for k, v in state.items()}
            return collections.OrderedDict(out) if isinstance(state, collections.OrderedDict) else out
        values = [_fill(v, buffers, copy_tensors, non_blocking, (*path, i)) for i, v in enumerate(state)]
        return tuple(values) if isinstance(state, tuple) else values
    return copy.deepcopy(state)


class HostCopy:
    """One process's host copy of a nested state (dicts, lists, tuples; tensors and DTensors; other values).

    Each tensor's buffer is allocated at the first save that holds a tensor of that kind at that place and
    reused by every later save (a tensor that appears, e.g. optimizer state after the first step or a
    callback's new score, gets a buffer of its own; one that is gone frees its buffer). ``pin_memory``:
    page-locked host memory, for fast device-to-host copies on CUDA."""

    def __init__(self, pin_memory: bool = False) -> None:
        self.pin_memory = pin_memory
        self.nbytes = 0  # bytes of the copy's tensors now
        self.allocated_bytes = 0  # bytes allocated over all saves (nbytes when every save reused the copy)
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._fingerprint: list | None = None

    def unchanged(self, state: Any) -> bool:
        """Whether the copy already holds ``state``: the same tensors at the same places, each with the same
        storage and no in-place change since it was copied."""
        return self._fingerprint is not None and _fingerprint(_leaves(state)) == self._fingerprint

    def stage(self, state: Any) -> Any:
        """Copy ``state`` into host memory and return the copy (a structure like ``state`` whose tensors are
        the reused buffers). The caller makes sure no write still reads the previous copy."""
        leaves = _leaves(state)
        buffers: dict[tuple, torch.Tensor] = {}
        shared: dict[
            tuple, torch.Tensor
        ] = {}  # one buffer per tensor however many names it has (tied weights)
        for path, tensor in leaves:
            same = _same_tensor(tensor)
            buffer = shared.get(same)
            if buffer is None:
                buffer = self._buffers.get(path)
                if (
                    buffer is None
                    or _kind(buffer) != _kind(tensor)
                    or any(b is buffer for b in shared.values())
                ):
                    buffer = _compat.create_host_state_dict({"t": tensor}, pin_memory=self.pin_memory)["t"]
                    if buffer is tensor:  # torch hands a 0-dim DTensor back as it is: a copy of its own
                        buffer = tensor.detach().to("cpu", copy=True)
                    self.allocated_bytes += _nbytes(buffer)
                shared[same] = buffer
            buffers[path] = buffer
        self._buffers = buffers  # buffers of tensors that are gone are freed
        self.nbytes = sum(_nbytes(b) for b in {id(b): b for b in buffers.values()}.values())
        non_blocking = self.pin_memory and torch.cuda.is_available()
        staged = _fill(state, buffers, copy_tensors=True, non_blocking=non_blocking)
        if non_blocking:
            torch.cuda.synchronize()  # the writer thread reads the copy: every copy into it has landed
        self._fingerprint = _fingerprint(leaves)
        return staged

    def reuse(self, state: Any) -> Any:
        """The copy as it is, with ``state``'s other values: for a state :meth:`unchanged` accepts."""
        return _fill(state, self._buffers, copy_tensors=False, non_blocking=False)

    def tensors(self) -> list[torch.Tensor]:
        """The copy's tensors (a DTensor's local shard), each once, e.g. to check that they are pinned."""
        return [_local(b) for b in {id(b): b for b in self._buffers.values()}.values()]

    def forget(self) -> None:
        """Mark the copy as not holding any state (after a failed copy)."""
        self._fingerprint = None


@dataclass
class _Job:
    kind: str  # "write" or "after"
    run: Callable[[], None]
    what: str  # a write: its destination; else what it does


class BackgroundWriter:
    """One thread that runs this process's checkpoint writes and what must follow them, in order.

    ``submit`` queues a write; ``after_writes`` queues an action behind the writes queued so far (run at
    once when there are none); ``wait_for_writes`` / ``wait`` block until they are done; ``take_failure``
    hands the first failed write's error to the caller (once)."""

    def __init__(self, name: str = "lit_parallel-checkpoint-writer") -> None:
        self.name = name
        self._jobs: collections.deque[_Job] = collections.deque()
        self._running: _Job | None = None
        self._done = threading.Condition()
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._failed_write: str | None = None
        self.completed: list[tuple[str, float]] = []  # destinations written, with the seconds each took
        self.dropped: list[str] = []  # actions not run because a write before them failed

    # --- queueing -----------------------------------------------------------------------------------------

    def submit(self, write: Callable[[], None], destination: str) -> None:
        """Queue ``write`` (it writes and commits ``destination``)."""
        self._put(_Job("write", write, str(destination)))

    def after_writes(self, action: Callable[[], None], what: str) -> bool:
        """Queue ``action`` behind every write queued so far; ``False`` (nothing queued) when no write is
        pending, and the caller runs it itself. Dropped (``True``, never run) while a failed write's error has
        not been taken: a deletion or link must not follow a checkpoint that was not written."""
        with self._done:
            if self._failure is not None:  # a write failed (not yet raised): what follows it is dropped
                self.dropped.append(what)
                return True
            if not self._writes_pending():
                return False
            self._jobs.append(_Job("after", action, what))
            self._start()
            self._done.notify_all()
        return True

    def _put(self, job: _Job) -> None:
        with self._done:
            self._jobs.append(job)
            self._start()
            self._done.notify_all()

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._work, name=self.name, daemon=True)
            self._thread.start()

    # --- state ----------------------------------------------------------------------------------------------

    def _writes_pending(self) -> bool:
        running = self._running is not None and self._running.kind == "write"
        return running or any(j.kind == "write" for j in self._jobs)

    def pending_writes(self) -> list[str]:
        """Destinations whose write is queued or running, oldest first."""
        with self._done:
            jobs = ([self._running] if self._running is not None else []) + list(self._jobs)
            return [j.what for j in jobs if j.kind == "write"]

    def wait_for_writes(self, timeout: float | None = None) -> bool:
        """Block until no write is queued or running; ``False`` if ``timeout`` seconds passed first."""
        return self._wait_until(lambda: not self._writes_pending(), timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until everything queued has run; ``False`` if ``timeout`` seconds passed first."""
        return self._wait_until(lambda: self._running is None and not self._jobs, timeout)

    def _wait_until(self, done: Callable[[], bool], timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._done:
            while not done():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                # wake now and then: the thread may have died with the interpreter
                self._done.wait(timeout=1.0 if left is None else min(left, 1.0))
                if self._thread is not None and not self._thread.is_alive() and (self._jobs or self._running):
                    return False
        return True

    def take_failure(self) -> BaseException | None:
        """The first failed write's error since the last call, or ``None``; later writes keep their order."""
        with self._done:
            failure, self._failure, self._failed_write = self._failure, None, None
            return failure

    @property
    def failed_write(self) -> str | None:
        """The destination of a failed write not yet taken (:meth:`take_failure`)."""
        return self._failed_write

    # --- the thread -----------------------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._done:
                while not self._jobs:
                    self._done.wait()
                job = self._running = self._jobs.popleft()
                skip = job.kind == "after" and self._failure is not None
            started = time.monotonic()
            error: BaseException | None = None
            if not skip:
                try:
                    job.run()
                except BaseException as err:  # kept for the training thread; the thread goes on
                    error = err
            with self._done:
                if skip:
                    self.dropped.append(job.what)
                elif error is not None:
                    if self._failure is None:
                        self._failure, self._failed_write = error, job.what
                elif job.kind == "write":
                    self.completed.append((job.what, time.monotonic() - started))
                self._running = None
                self._done.notify_all()
