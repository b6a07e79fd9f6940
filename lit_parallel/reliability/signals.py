"""SIGINT / SIGTERM during a multi-rank run: every rank ends within seconds with exit status 128 + the signal
number, even while its main thread is blocked in a collective.

A Python signal handler runs only when the main thread gets back to the interpreter, which a rank blocked in
a collective never does; Python's C-level handler, however, writes the signal number to the wakeup file
descriptor at once. A thread reads it and ends the process: in the launching process of Lightning's
launcher it first passes the signal on to the ranks it started and waits for them (a few seconds, then
``SIGKILL``). The Python-level handler keeps the main thread from starting a shutdown of its own (Lightning
turns ``SIGTERM`` into a clean stop with status 0, ``KeyboardInterrupt`` into status 1).

The process ends through ``exit_with(code)``: the strategies pass
:func:`lit_parallel.reliability.groups.exit_process`, which aborts the communicators first (on NCCL the
peers' collectives then fail at once instead of waiting out the timeout). This module itself needs only the
standard library.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)
CHILD_WAIT_S = 5.0  # how long the launching process waits for its ranks before it kills them
# how long the main thread's handler waits for the thread's exit (stopping the ranks, then aborting the
# communicators: groups.ABORT_WAIT_S) before it ends the process itself
HANDLER_WAIT_S = CHILD_WAIT_S + 15.0


def exit_status(signum: int) -> int:
    """The exit status of a process ended by ``signum``, as a shell reports it."""
    return 128 + int(signum)


class SignalExit:
    """Installed on the main thread while a multi-rank run is set up; ``stop_children(signum)`` passes the
    signal on to the ranks this process started and waits for them (Lightning's launcher), returning what
    to report about them."""

    def __init__(
        self,
        rank: int,
        stop_children: Callable[[int, float], str],
        skip: Any = None,
        exit_with: Callable[[int], Any] = os._exit,
        before_exit: Callable[[], str] | None = None,
        extra_wait_s: float = 0.0,
    ) -> None:
        self.rank = rank
        # waits (at most extra_wait_s) for what must finish before the exit (a background checkpoint write),
        # and says what happened to it
        self.before_exit = before_exit
        self.extra_wait_s = extra_wait_s
        self.stop_children = stop_children
        self.exit = exit_with
        self.signals = tuple(s for s in SIGNALS if s != skip)  # the preemption signal keeps its own meaning
        self.retired = False
        self._previous: dict[int, Any] = {}
        self._previous_fd = -1
        self._fds: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None

    def install(self) -> bool:
        if threading.current_thread() is not threading.main_thread() or not self.signals:
            return False
        r, w = os.pipe()
        os.set_blocking(w, False)
        try:
            self._previous_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except ValueError:
            os.close(r), os.close(w)
            return False
        self._fds = (r, w)
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handler)
        self._thread = threading.Thread(target=self._watch, name="lit_parallel-signal-watchdog", daemon=True)
        self._thread.start()
        return True

    def uninstall(self) -> None:
        """Stop the thread and put back the handlers and the wakeup descriptor that were there before (a handler
        Lightning's signal connector puts back later behaves as the one it replaced: ``retired``)."""
        self.retired = True
        if self._fds is None or threading.current_thread() is not threading.main_thread():
            return
        # after a failed fit Lightning puts this handler back and nothing removes it: a signal during the
        # interpreter's exit (when no Python handler runs any more) would then be ignored
        atexit.register(self.uninstall_retired)
        for s, previous in self._previous.items():
            if signal.getsignal(s) == self._handler:
                signal.signal(s, previous if previous is not None else signal.SIG_DFL)
        with contextlib.suppress(ValueError):
            signal.set_wakeup_fd(self._previous_fd)
        r, w = self._fds
        self._fds = None
        with contextlib.suppress(OSError):
            os.write(w, b"\0")  # wakes the thread: 0 is no signal
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        for fd in (r, w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def uninstall_retired(self) -> None:
        """After Lightning's signal connector put this handler back: remove it again."""
        if threading.current_thread() is not threading.main_thread():
            return
        for s, previous in self._previous.items():
            if signal.getsignal(s) == self._handler:
                signal.signal(s, previous if previous is not None else signal.SIG_DFL)

    def _handler(self, signum: int, frame: Any) -> None:
        if self.retired:  # left installed after its run: behave as the handler it replaced
            previous = self._previous.get(signum, signal.SIG_DFL)
            previous = signal.SIG_DFL if previous is None else previous
            signal.signal(signum, previous)
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_DFL:
                os.kill(os.getpid(), signum)
            return
        # the thread ends the process (after the ranks this process started): keep the main thread from
        # shutting down on its own meanwhile (Lightning would exit with status 0 or 1)
        threading.Event().wait(HANDLER_WAIT_S + self.extra_wait_s)
        self.exit(exit_status(signum))

    def _watch(self) -> None:
        assert self._fds is not None
        r = self._fds[0]
        while True:
            try:
                data = os.read(r, 64)
            except OSError:
                return
            if not data or 0 in data:
                return
            for signum in data:
                if signum in self.signals:
                    self._end(signum)
            if self._previous_fd >= 0:  # another wakeup descriptor was there before (an event loop): pass on
                with contextlib.suppress(OSError):
                    os.write(self._previous_fd, data)

    def _end(self, signum: int) -> None:
        code = exit_status(signum)
        name = signal.Signals(signum).name
        try:
            # the ranks it started wait for their own writes too
            children = self.stop_children(signum, CHILD_WAIT_S + self.extra_wait_s)
        except Exception as err:  # the exit status and the message below must not depend on it
            children = f"stopping the processes it started failed: {type(err).__name__}: {err}"
        waited = ""
        if self.before_exit is not None:
            try:
                waited = self.before_exit()
            except Exception as err:
                waited = f"waiting for the checkpoint write failed: {type(err).__name__}: {err}"
        message = (
            f"lit_parallel: rank {self.rank} (pid {os.getpid()}) received {name}: exiting with status {code}"
        )
        details = "".join(f"; {text}" for text in (waited, children) if text)
        with contextlib.suppress(OSError):
            os.write(2, (message + details + "\n").encode())
        self.exit(code)
