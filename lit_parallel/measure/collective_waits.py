"""Measure exposed communication: the time compute waits on collectives, under any strategy.

DDP reports this itself (its reducer times the all-reduces it could not hide behind backward). FSDP2,
DTensor and user code do not, so :class:`CollectiveWaitTimer` times the points where compute waits:

* on CPU the training thread runs the compute and blocks in the collective: the time it spends in a
  blocking ``torch.distributed`` call (``async_op=False``), in ``Work.wait()`` or in a functional
  collective's ``wait_tensor`` (DTensor's redistributions) is the time compute waits;
* on CUDA the host does not block, the compute stream does: each wait point issued on the compute
  stream records a CUDA event before and after it, and the time between the two is the stall. FSDP2
  issues its collectives on side streams (not timed there) and makes the compute stream wait on their
  events in ``FSDPParamGroup.wait_for_unshard``, ``_wait_for_post_backward`` and ``finalize_backward``:
  on CUDA those are wait points too (``wait_for_unshard``'s window also holds the copy-out of the
  gathered parameters, a memory copy).

Waits on every thread count while a window is open, not only on the thread that opened it: on CUDA,
autograd runs backward on its own device thread, where FSDP2 waits for its reduce-scatters (a wait on a
thread that opened a window of its own counts there only). Waits that overlap in time (two threads
waiting at once) count once in :attr:`Window.waited`. Only the outermost wait point of a thread counts (a
``Work.wait()`` inside a timed FSDP wait is not counted twice), and the wrappers are installed while at
least one timer is installed, then removed (a wrapper another patcher has since wrapped is left in place,
inert).
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lit_parallel import _compat

# blocking when called with async_op=False (the default)
_COLLECTIVES = (
    "all_reduce",
    "all_reduce_coalesced",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_coalesced",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "barrier",
    "monitored_barrier",
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
)


@dataclass(frozen=True)
class Window:
    """One timed window (a training step): its length, the part of it spent waiting on collectives, and
    (for the most recent windows) each wait in the order the collectives were waited on."""

    span: float
    waited: float
    waits: tuple[float, ...] = ()

    @property
    def compute(self) -> float:
        """The window less its waits: the rank's own work."""
        return max(0.0, self.span - self.waited)


class _Local(threading.local):
    depth = 0


_local = _Local()
_lock = threading.Lock()
_timers: list[CollectiveWaitTimer] = []
_installed: list[tuple[Any, str, Any, Any]] = []  # (owner, attribute, original, wrapper)


def _current() -> CollectiveWaitTimer | None:
    """The open window a wait on this thread belongs to: the one this thread opened, else any open one (a
    helper thread, such as autograd's device thread, works for whichever step is running)."""
    thread = threading.get_ident()
    found = None
    for timer in tuple(_timers):  # copied: a timer may be installed meanwhile on another thread
        if timer._open:
            if timer._thread == thread:
                return timer
            found = found or timer
    return found


def _async_index(fn: Any) -> int | None:
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return names.index("async_op") if "async_op" in names else None


def _wrap(fn: Any, *, kind: str) -> Any:
    """``kind``: "collective" (timed unless async_op), "wait" (always timed), "cuda_wait" (CUDA only)."""
    async_at = _async_index(fn) if kind == "collective" else None

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        timer = _current()
        if timer is None or _local.depth:
            return fn(*args, **kwargs)
        if kind == "collective":
            asynchronous = kwargs.get(
                "async_op", async_at is not None and len(args) > async_at and args[async_at]
            )
            if asynchronous:  # a launch; its Work.wait() is the wait point
                return fn(*args, **kwargs)
        if kind == "cuda_wait" and not timer.cuda:
            return fn(*args, **kwargs)
        return timer._time(fn, args, kwargs)

    timed.__lit_parallel_wait__ = True
    return timed


def _targets() -> list[tuple[Any, str, str]]:
    import torch.distributed.distributed_c10d as c10d

    out: list[tuple[Any, str, str]] = []
    for name in _COLLECTIVES:
        for module in (dist, c10d):
            if hasattr(module, name):
                out.append((module, name, "collective"))
    out.append((dist.Work, "wait", "wait"))
    out.append((_compat.functional_collectives, "wait_tensor", "wait"))
    try:
        group = _compat.FSDPParamGroup
    except ImportError:  # pragma: no cover - FSDP2 moved (test_compat fails): CUDA FSDP waits go untimed
        return out
    out.extend((group, name, "cuda_wait") for name in _compat.FSDP_WAIT_METHODS if hasattr(group, name))
    return out


def _install() -> None:
    wrapped: dict[int, Any] = {}  # one wrapper per function (dist.x is c10d.x)
    for owner, name, kind in _targets():
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        if getattr(original, "__lit_parallel_wait__", False):
            continue
        if id(original) not in wrapped:
            wrapped[id(original)] = _wrap(original, kind=kind)
        setattr(owner, name, wrapped[id(original)])
        _installed.append((owner, name, original, wrapped[id(original)]))


def _uninstall() -> None:
    for owner, name, original, wrapper in reversed(_installed):
        current = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
        if current is wrapper:
            setattr(owner, name, original)
    _installed.clear()


class CollectiveWaitTimer:
    """Times, per window, how long compute waited on collectives, on any thread (on CUDA: on the compute stream).

    Use :meth:`install` once, then :meth:`open` / :meth:`close` around each step and read
    :meth:`windows`; :meth:`uninstall` at the end. On CUDA only every ``cuda_every``-th window (and the
    first three) is measured, and a measured window's events are read when the next window opens or in
    :meth:`windows` (which waits for them).

    Example::

        timer = CollectiveWaitTimer(device).install()
        for batch in loader:
            timer.open(); step(batch); timer.close()
        exposed = [w.waited for w in timer.windows()]

    A rank that reaches a collective before the others waits for them as well as for the transfer; the
    rank that arrives last waits for the transfer alone. :func:`transfer_waits` takes, collective by
    collective, the smallest wait over the ranks: the communication itself, without the skew.
    """

    def __init__(
        self, device: torch.device | str = "cpu", *, cuda_every: int = 10, keep_waits: int = 32
    ) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.cuda_every = max(1, int(cuda_every))
        self.keep_waits = keep_waits
        self._open = False
        self._thread: int | None = None
        self._count = 0
        self._t0 = 0.0
        self._window = 0  # which window is open: a wait that ends after its window closed is dropped
        self._waits: list[tuple[float, float]] = []  # (start, end) of each wait, any thread
        self._waits_lock = threading.Lock()
        self._stream: Any = None
        self._events: list[Any] = []  # CUDA: start, (before, after)*, end
        self._pending: list[list[Any]] = []
        self._windows: list[Window] = []

    # ------------------------------------------------------------------------------ lifecycle
    def install(self) -> CollectiveWaitTimer:
        with _lock:
            if self not in _timers:
                if not _timers:
                    _install()
                _timers.append(self)
        return self

    def uninstall(self) -> None:
        with _lock:
            if self in _timers:
                self._open = False
                _timers.remove(self)
                if not _timers:
                    _uninstall()

    # -------------------------------------------------------------------------------- windows
    def open(self) -> bool:
        """Start a window on this thread; returns whether it is measured (always on CPU)."""
        self._count += 1
        self._resolve(block=False)
        measured = not self.cuda or self._count <= 3 or self._count % self.cuda_every == 0
        if not measured:
            return False
        with self._waits_lock:
            self._thread = threading.get_ident()
            self._window += 1
            self._waits = []
            if self.cuda:
                self._stream = torch.cuda.current_stream(self.device)
                self._events = [self._record()]
            self._t0 = time.perf_counter()
            self._open = True
        return True

    def close(self) -> None:
        with self._waits_lock:
            if not self._open:
                return
            self._open = False
            if self.cuda:
                self._events.append(self._record())
                self._pending.append(self._events)
                self._events = []
                return
            span, waits = time.perf_counter() - self._t0, self._waits
        self._add(span, [end - start for start, end in sorted(waits)], _covered(waits))

    def windows(self) -> list[Window]:
        """The measured windows since the last :meth:`clear` (waits for pending CUDA events)."""
        self._resolve(block=True)
        return list(self._windows)

    def clear(self) -> None:
        self._resolve(block=True)
        self._windows.clear()

    # --------------------------------------------------------------------------------- timing
    def _record(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(self._stream)
        return event

    def _time(self, fn: Any, args: tuple, kwargs: dict) -> Any:
        if self.cuda and torch.cuda.current_stream(self.device) != self._stream:
            return fn(*args, **kwargs)  # issued on a side stream: a launch, not a wait of compute
        window = self._window
        _local.depth += 1
        try:
            if self.cuda:
                before = self._record()
                try:
                    return fn(*args, **kwargs)
                finally:
                    after = self._record()
                    with self._waits_lock:
                        if self._open and self._window == window:
                            self._events.extend((before, after))
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                end = time.perf_counter()
                with self._waits_lock:
                    if self._open and self._window == window:
                        self._waits.append((start, end))
        finally:
            _local.depth -= 1

    def _resolve(self, *, block: bool) -> None:
        while self._pending:
            events = self._pending[0]
            if not block and not events[-1].query():
                return
            events[-1].synchronize()
            self._pending.pop(0)
            span, waits = span_and_waits(events)
            self._add(span, waits, sum(waits))  # one stream: its waits never overlap

    def _add(self, span: float, waits: list[float], waited: float) -> None:
        self._windows.append(Window(span, waited, tuple(waits)))
        if len(self._windows) > self.keep_waits:  # older windows keep their totals only
            old = self._windows[-self.keep_waits - 1]
            self._windows[-self.keep_waits - 1] = Window(old.span, old.waited)


def _covered(intervals: list[tuple[float, float]]) -> float:
    """The time covered by at least one of ``intervals`` (waits on several threads at once count once)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def span_and_waits(events: Sequence[Any]) -> tuple[float, list[float]]:
    """Seconds from CUDA events recorded as ``start, (before, after) per wait point, end``: the window's
    span and each wait (``elapsed_time`` is in milliseconds)."""
    span = events[0].elapsed_time(events[-1]) / 1e3
    return span, [a.elapsed_time(b) / 1e3 for a, b in zip(events[1:-1:2], events[2:-1:2])]


def transfer_waits(ranks: list[list[Window]]) -> list[float]:
    """Per window, the time waited on the transfers themselves: for each collective, the wait of the rank
    that arrived last (the smallest over ``ranks``), summed over the window's collectives.

    ``ranks`` holds every rank's windows for the same steps; windows whose wait sequences do not line up
    (a different number of collectives, or no sequence kept) are left out.
    """
    out: list[float] = []
    for windows in zip(*ranks):
        lengths = {len(w.waits) for w in windows}
        if len(lengths) != 1 or (lengths == {0} and any(w.waited for w in windows)):
            continue
        out.append(sum(min(column) for column in zip(*(w.waits for w in windows))))
    return out
