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
    SubprocessScriptLauncher,
    launch_process_observer,
    set_launcher,
    set_num_threads_if_needed,
)
from lit_parallel.reliability.options import LAUNCHER_PID_ENV, POLL_S, _stderr
from lit_parallel.reliability.reports import _ranks

if TYPE_CHECKING:
    import lightning.pytorch as pl


class _LauncherWatchdog:
    """In the launching process (rank 0 of a node under Lightning's launcher): end the run when a rank dies,
    end the other ranks when this process fails, wait for them when it finishes."""

    def __init__(self, procs: list[subprocess.Popen], first_rank: int, wait_s: float) -> None:
        self.procs = procs
        self.first_rank = first_rank  # global rank of procs[0]
        self.wait_s = wait_s
        self._lock = threading.Lock()
        self._ending = False

    def start(self) -> None:
        threading.Thread(target=self._observe, name="lit_parallel-launcher-watchdog", daemon=True).start()
        self._previous_hook = sys.excepthook
        sys.excepthook = self._excepthook
        atexit.register(self._wait_for_children)

    def _rank(self, i: int) -> int:
        return self.first_rank + i

    def _observe(self) -> None:
        while True:
            for i, p in enumerate(self.procs):
                code = p.poll()
                if code is not None and code != 0:
                    self._end(
                        f"lit_parallel: rank {self._rank(i)} (pid {p.pid}) exited with code {code}; ending the run",
                        exit_code=1,
                    )
                    return
            if all(p.poll() == 0 for p in self.procs):
                return
            time.sleep(0.1)

    def _kill_others(self, skip: subprocess.Popen | None = None) -> list[int]:
        killed = []
        for i, p in enumerate(self.procs):
            if p is not skip and p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                killed.append(self._rank(i))
        return killed

    def _end(self, message: str, exit_code: int) -> None:
        with self._lock:
            if self._ending:
                return
            self._ending = True
        killed = self._kill_others()
        rank0 = self.first_rank - 1
        _stderr(f"{message}: stopped rank(s) {_ranks(killed)} and rank {rank0} (the launching process)")
        os._exit(exit_code)

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


_CHILD_WATCH_STARTED = False


def _watch_launching_process() -> None:
    """In a rank started by Lightning's launcher: exit when the launching process is gone."""
    global _CHILD_WATCH_STARTED
    pid = os.environ.get(LAUNCHER_PID_ENV)
    if _CHILD_WATCH_STARTED or pid is None or int(pid) == os.getpid() or os.getppid() != int(pid):
        return
    _CHILD_WATCH_STARTED = True
    parent = int(pid)

    def watch() -> None:
        while True:
            time.sleep(POLL_S)
            if os.getppid() != parent:
                rank = os.environ.get("LOCAL_RANK", "?")
                _stderr(
                    f"lit_parallel: local rank {rank} (pid {os.getpid()}): the launching process (pid {parent})"
                    " is gone; exiting"
                )
                os._exit(1)

    threading.Thread(target=watch, name="lit_parallel-parent-watchdog", daemon=True).start()


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
            os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
            self._call_children_scripts()
            launch_process_observer(self.procs)
            first = self.cluster_environment.node_rank() * self.num_processes + 1
            timeout = self._strategy.reliability.timeout or default_pg_timeout
            _LauncherWatchdog(self.procs, first, wait_s=timeout.total_seconds()).start()
        set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)


def watch_launcher(strategy: Any) -> None:
    """Replace Lightning's ``python train.py`` launcher by the watched one (in the launching process), and in
    a rank it started, exit when the launching process is gone."""
    launcher = strategy.launcher
    if type(launcher) is SubprocessScriptLauncher:
        watched = _WatchedSubprocessScriptLauncher(
            strategy, launcher.cluster_environment, launcher.num_processes, launcher.num_nodes
        )
        set_launcher(strategy, watched)
    _watch_launching_process()
