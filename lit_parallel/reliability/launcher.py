"""A watchdog for Lightning's own launcher: no process outlives a failed run."""

from __future__ import annotations

import atexit
import contextlib
import os
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from typing_extensions import override

from lit_parallel._compat import (
    MultiProcessingLauncher,
    SubprocessScriptLauncher,
    launch_process_observer,
    launcher_start_method,
    set_launcher,
    set_num_threads_if_needed,
)
from lit_parallel.reliability.groups import exit_process
from lit_parallel.reliability.options import LAUNCHER_PID_ENV, POLL_S, _stderr
from lit_parallel.reliability.reports import _ranks
from lit_parallel.reliability.stall import STALL_EXIT_CODE

if TYPE_CHECKING:
    import lightning.pytorch as pl


def _stop_thread(stop: threading.Event, thread: threading.Thread | None) -> None:
    """Signal a watchdog thread to end and wait for it (briefly; never from itself); its new handle: none."""
    stop.set()
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout=1.0)


class _LauncherWatchdog:
    """In the launching process (rank 0 of a node under Lightning's launcher): end the run when a rank dies,
    end the other ranks when this process fails, wait for them when it finishes.

    The started ranks live as long as the script (each runs every ``fit`` of it), so one watchdog serves every
    ``fit`` of the process: its thread runs while a strategy is set up (:func:`resume_watching` /
    :func:`stop_watching`); the exception hook and the exit handler are installed once."""

    def __init__(self, procs: list[subprocess.Popen], first_rank: int, wait_s: float) -> None:
        self.procs = procs
        self.first_rank = first_rank  # global rank of procs[0]
        self.wait_s = wait_s
        self.owner_pid = os.getpid()
        self._lock = threading.Lock()
        self._ending = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._hooks_installed = False

    def start(self) -> None:
        if not self._hooks_installed:
            self._hooks_installed = True
            self._previous_hook = sys.excepthook
            sys.excepthook = self._excepthook
            atexit.register(self._wait_for_children)
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._observe, name="lit_parallel-launcher-watchdog", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._thread = _stop_thread(self._stop, self._thread)

    def _rank(self, i: int) -> int:
        return self.first_rank + i

    def _observe(self) -> None:
        while not self._stop.is_set() and not self._ending:
            for i, p in enumerate(self.procs):
                code = p.poll()
                if code is not None and code != 0 and not self._ending:
                    # a stall report or a signal ends the run with its own status; anything else with 1
                    passed_on = code == STALL_EXIT_CODE or code > 128
                    self._end(
                        f"lit_parallel: rank {self._rank(i)} (pid {p.pid}) exited with code {code}; ending the run",
                        exit_code=code if passed_on else 1,
                        quiet=code == STALL_EXIT_CODE,
                    )
                    return
            if all(p.poll() == 0 for p in self.procs):
                return
            self._stop.wait(0.1)

    def _kill_others(self, skip: subprocess.Popen | None = None) -> list[int]:
        killed = []
        for i, p in enumerate(self.procs):
            if p is not skip and p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                killed.append(self._rank(i))
        return killed

    def _end(self, message: str, exit_code: int, quiet: bool = False) -> None:
        with self._lock:
            if self._ending:
                return
            self._ending = True
        killed = self._kill_others()
        rank0 = self.first_rank - 1
        if not quiet:
            _stderr(f"{message}: stopped rank(s) {_ranks(killed)} and rank {rank0} (the launching process)")
        exit_process(exit_code)  # aborts this process's communicators first

    def stop_children(self, signum: int | None, wait_s: float) -> str:
        """The run ends (a signal, a stall): pass ``signum`` on to the started ranks, wait for them up to
        ``wait_s``, kill what is left; say how they ended."""
        with self._lock:
            self._ending = True
        for p in self.procs:
            if signum is not None and p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signum)
        deadline = time.monotonic() + wait_s
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.02)
        killed = self._kill_others()
        ended = [
            f"rank {self._rank(i)}: {p.returncode}" for i, p in enumerate(self.procs) if p.poll() is not None
        ]
        text = "exit status of the ranks it started: " + ", ".join(ended)
        return text + (f"; killed rank(s) {_ranks(killed)} after {wait_s:g} s" if killed else "")

    def _excepthook(self, exc_type, exc, tb) -> None:
        self._previous_hook(exc_type, exc, tb)
        with self._lock:
            self._ending = True
        killed = self._kill_others()
        if killed:
            _stderr(
                f"lit_parallel: rank {self.first_rank - 1} (the launching process) failed with"
                f" {exc_type.__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''};"
                f" stopped rank(s) {_ranks(killed)}"
            )

    def _wait_for_children(self) -> None:
        # Lightning's launcher does not wait: a rank still finishing would lose its launching process.
        deadline = time.monotonic() + self.wait_s
        for p in self.procs:
            while p.poll() is None and time.monotonic() < deadline and not self._ending:
                time.sleep(0.05)
        late = [self._rank(i) for i, p in enumerate(self.procs) if p.poll() is None]
        if late and not self._ending:
            self._kill_others()
            _stderr(
                f"lit_parallel: rank(s) {_ranks(late)} still running {self.wait_s:.0f} s after rank"
                f" {self.first_rank - 1} finished; stopped them"
            )


class _ParentWatchdog:
    """In a rank started by Lightning's launcher: exit when the launching process is gone."""

    def __init__(self, parent: int) -> None:
        self.parent = parent
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="lit_parallel-parent-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._thread = _stop_thread(self._stop, self._thread)

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            if os.getppid() != self.parent:
                rank = os.environ.get("LOCAL_RANK", "?")
                _stderr(
                    f"lit_parallel: local rank {rank} (pid {os.getpid()}): the launching process (pid"
                    f" {self.parent}) is gone; exiting"
                )
                exit_process(1)  # aborts the communicators first: the peers' collectives fail at once


_LAUNCHED: _LauncherWatchdog | None = None  # the ranks this process started
_PARENT: _ParentWatchdog | None = None


def launching_process_gone() -> str | None:
    """In a rank started by Lightning's launcher whose launching process is gone: say so (a collective that
    fails then fails because of it: "connection reset by peer" names no one)."""
    if _PARENT is None or os.getppid() == _PARENT.parent:
        return None
    return (
        f"the launching process (local rank 0, pid {_PARENT.parent}) is gone: it was killed or crashed, and"
        " this rank's collectives with it failed"
    )


def _watch_launching_process() -> None:
    """In a rank started by Lightning's launcher: exit when the launching process is gone (while a strategy
    is set up)."""
    global _PARENT
    pid = os.environ.get(LAUNCHER_PID_ENV)
    if pid is None or not pid.isdigit() or int(pid) == os.getpid() or os.getppid() != int(pid):
        return
    if _PARENT is None or _PARENT.parent != int(pid):
        _PARENT = _ParentWatchdog(int(pid))
    _PARENT.start()


def resume_watching() -> None:
    """A strategy of this process is being set up: (re)start the watchdog threads of this process."""
    if _LAUNCHED is not None and _LAUNCHED.owner_pid == os.getpid():
        _LAUNCHED.start()
    _watch_launching_process()


def stop_watching() -> None:
    """At a strategy's teardown: stop the watchdog threads (the next ``fit`` starts them again)."""
    if _LAUNCHED is not None:
        _LAUNCHED.stop()
    if _PARENT is not None:
        _PARENT.stop()


def stop_children(signum: int | None, wait_s: float) -> str:
    """In the launching process of Lightning's launcher: end the ranks it started (see
    :meth:`_LauncherWatchdog.stop_children`); elsewhere nothing to do."""
    if _LAUNCHED is None or _LAUNCHED.owner_pid != os.getpid():
        return ""
    return _LAUNCHED.stop_children(signum, wait_s)


class _WatchedSubprocessScriptLauncher(SubprocessScriptLauncher):
    """Lightning's ``python train.py`` launcher plus :class:`_LauncherWatchdog`, and configuration checks
    that run before any rank is started."""

    def __init__(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._strategy = strategy

    @override
    def launch(self, function: Any, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        import lightning.pytorch as pl

        model = next((a for a in args if isinstance(a, pl.LightningModule)), None)
        # the strategy's configuration checks that need the Trainer or the model, before any rank starts
        self._strategy._validate_before_launch(trainer, model)
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            global _LAUNCHED
            # the started ranks inherit the variable; this process gets its previous value back
            previous = os.environ.get(LAUNCHER_PID_ENV)
            os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
            try:
                self._call_children_scripts()
            finally:
                if previous is None:
                    del os.environ[LAUNCHER_PID_ENV]
                else:
                    os.environ[LAUNCHER_PID_ENV] = previous
            launch_process_observer(self.procs)
            first = self.cluster_environment.node_rank() * self.num_processes + 1
            timeout = self._strategy.reliability.timeout or default_pg_timeout
            _LAUNCHED = _LauncherWatchdog(self.procs, first, wait_s=timeout.total_seconds())
            _LAUNCHED.start()
        set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)


class _ReportFailure:
    """The function a process started by ``ddp_spawn`` runs, reporting its own failure: Lightning runs it
    outside its exception handling there (no ``on_exception``), so without this the only report would be the
    launching process's, which is no rank. Module-level: it is pickled into the started processes."""

    def __init__(self, function: Any, trainer: pl.Trainer | None) -> None:
        self.function = function
        self.trainer = trainer

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.function(*args, **kwargs)
        except BaseException as exception:
            if self.trainer is not None:
                # the rank's report ("lit_parallel: rank N failed in <hook>") is added to the error's text,
                # which torch.multiprocessing hands to the launching process
                self.trainer.strategy.on_exception(exception)
            raise


class _ReportingMultiProcessingLauncher(MultiProcessingLauncher):
    """Lightning's ``ddp_spawn`` launcher whose ranks report their own failures (:class:`_ReportFailure`)."""

    @override
    def launch(self, function: Any, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        return super().launch(_ReportFailure(function, trainer), *args, trainer=trainer, **kwargs)


def watch_launcher(strategy: Any) -> None:
    """Replace Lightning's ``python train.py`` launcher by the watched one (in the launching process), and in
    a rank it started, exit when the launching process is gone (until the strategy's teardown)."""
    launcher = strategy.launcher
    if type(launcher) is SubprocessScriptLauncher:
        watched = _WatchedSubprocessScriptLauncher(
            strategy, launcher.cluster_environment, launcher.num_processes, launcher.num_nodes
        )
        set_launcher(strategy, watched)
    _watch_launching_process()


def report_from_spawned_ranks(strategy: Any) -> None:
    """Under ``ddp_spawn`` (Lightning's multiprocessing launcher): each started rank reports its own failure."""
    launcher = strategy.launcher
    if type(launcher) is MultiProcessingLauncher:
        set_launcher(strategy, _ReportingMultiProcessingLauncher(strategy, launcher_start_method(launcher)))
