"""Reliability shared by every lit_parallel strategy: fail fast and loudly, never lose state, never silently
change the training.

:class:`ReliabilityMixin` sits in front of Lightning's strategy class in each strategy's bases
(``TunedDDPStrategy(ReliabilityMixin, DDPStrategy)``, ``TransformerFSDPStrategy(ReliabilityMixin,
ModelParallelStrategy)``; ``hsdp`` and ``tp_dp`` inherit it) and adds:

- **Failure reports.** When a rank fails, it publishes what it was doing through the process group's
  key-value store; every live rank's watchdog thread answers with its own progress and where its main
  thread is. A collective that timed out (or ranks that diverged) is reported as *which collective, on
  which ranks, and where the ranks that never arrived are* (e.g. a rank stuck in ``__getitem__``, or a rank
  that went past a batch without joining its backward collectives).
- **A watchdog for Lightning's launcher** (``python train.py`` with ``devices=N``): the launching process
  (rank 0) ends the other ranks when it fails, waits for them when it finishes, and stops the run within a
  fraction of a second when one of them dies; the other ranks exit when the launching process is gone. No
  process outlives a failed run.
- **Collective fingerprints** (``debug_level="detail"``): torch's check that every rank runs the same
  collective, set with ``torch.distributed.set_debug_level`` before the process group is created.
- **The strategy's timeout on every process group**, including the device mesh's sub-groups (torch gives
  those its 30-minute default) and a process group created before the strategy (torchrun, user code) when
  ``timeout`` is passed explicitly.
- **Exact resume**: every rank's torch, CUDA, numpy and Python RNG states are saved in each checkpoint in a
  ``weights_only``-loadable form and restored; a mid-epoch checkpoint continues with the next unseen batch
  (the sampler skips what the epoch already used) or is refused with the reason, never silently repeating
  or skipping batches.
- **Preemption**: on SLURM's requeue signal (``SIGUSR1``) the ranks agree at the next optimizer-step
  boundary, save a complete checkpoint ``hpc_ckpt_N.ckpt``, requeue the job and stop; the requeued job
  resumes from it (Lightning picks the newest ``hpc_ckpt_*`` on SLURM).
- **Checkpoint integrity**: files and folders are written under a temporary name and renamed into place when
  complete; loading checks completeness first and never executes pickled code (see
  :mod:`lit_parallel.checkpoint`).
- **Process group ownership**: a process group the strategy created is destroyed when the process exits (or
  right away when the run failed, so a retry in the same process starts clean); one that existed before
  (torchrun's, a test harness's, the user's) is left to its creator.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import gc
import itertools
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch.utils.data import BatchSampler, DistributedSampler, IterableDataset, Sampler, SequentialSampler
from typing_extensions import override

from lit_parallel.checkpoint import (
    LIGHTNING_META,
    atomic_save,
    check_replaceable,
    commit,
    dcp_load,
    new_partial_path,
    verify_checkpoint,
)
from lit_parallel.rng import capture_rng_state, restore_rng_state

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger("lit_parallel")

DEBUG_LEVELS = ("off", "info", "detail")
RNG_KEY = "lit_parallel_rng_states"
LAUNCHER_PID_ENV = "LIT_PARALLEL_LAUNCHER_PID"
# how long a failing rank waits for the others' answers before it reports a timeout or a divergence
REPORT_WAIT_S = 2.0
POLL_S = 0.2

DebugLevel = Literal["off", "info", "detail"]
PreemptionSignal = Literal["auto"] | int | signal.Signals | str | None


def _info(msg: str) -> None:
    if rank_zero_only.rank == 0:
        log.info(msg)


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- options --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReliabilityOptions:
    """The reliability options every lit_parallel strategy accepts (validated when the strategy is built).

    Args:
        debug_level: ``None`` (default): keep torch's setting (``TORCH_DISTRIBUTED_DEBUG``). ``"detail"``: every
            collective is first checked across ranks (operation, shapes, dtypes); ranks that call different
            collectives fail at once with torch's "Detected mismatch between collectives on ranks" instead
            of hanging or exchanging wrong data. Costs one extra small all-gather per collective: turn it on to
            debug. ``"info"``: extra logging; ``"off"``: none.
        watchdog: under Lightning's own launcher, end every rank when one fails (see the module docstring).
        preemption_signal: ``"auto"`` (default): in a SLURM job (Lightning's ``SLURMEnvironment``, or torchrun
            inside a SLURM allocation), SLURM's requeue signal (``SIGUSR1``, or the environment's
            ``requeue_signal``; off when its ``auto_requeue`` is off); otherwise off. A signal (``"SIGUSR1"``,
            ``signal.SIGUSR2``, ...) turns preemption checkpoints on anywhere; ``None`` turns them off.
    """

    debug_level: DebugLevel | None = None
    watchdog: bool = True
    preemption_signal: PreemptionSignal = "auto"

    def __post_init__(self) -> None:
        if self.debug_level is not None and self.debug_level not in DEBUG_LEVELS:
            raise ValueError(
                f"debug_level={self.debug_level!r} must be None (keep TORCH_DISTRIBUTED_DEBUG), 'off', 'info' or"
                " 'detail' (check that every rank runs the same collective)"
            )
        if not isinstance(self.watchdog, bool):
            raise ValueError(f"watchdog={self.watchdog!r} must be True or False")
        object.__setattr__(self, "preemption_signal", _parse_signal(self.preemption_signal))


def _parse_signal(value: Any) -> Any:
    if value is None or value == "auto":
        return value
    if isinstance(value, bool):
        raise ValueError(f"preemption_signal={value!r} must be 'auto', None or a signal such as 'SIGUSR1'")
    if isinstance(value, str):
        name = value.upper()
        name = name if name.startswith("SIG") else f"SIG{name}"
        if not hasattr(signal, name) or not isinstance(getattr(signal, name), signal.Signals):
            raise ValueError(
                f"preemption_signal={value!r} is not a signal name; use 'auto', None or e.g. 'SIGUSR1'"
            )
        return getattr(signal, name)
    try:
        return signal.Signals(value)
    except ValueError:
        raise ValueError(
            f"preemption_signal={value!r} is not a signal number; use 'auto', None or e.g. 'SIGUSR1'"
        ) from None


# --- progress and failure reports -----------------------------------------------------------------------


class _Progress:
    """Where this rank is in the run; read by failure reports (cheap: a few attribute writes per step)."""

    def __init__(self) -> None:
        self.stage = "setup"
        self.epoch = 0
        self.batch = -1
        self.backward_calls = 0
        self.optimizer_steps = 0

    def at(self, stage: str) -> None:
        self.stage = stage

    def describe(self) -> str:
        if self.batch < 0 or "batch" in self.stage or "epoch" in self.stage:
            return self.stage
        return f"{self.stage} of training batch {self.batch} (epoch {self.epoch})"

    def as_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "epoch": self.epoch,
            "batch": self.batch,
            "backward_calls": self.backward_calls,
            "optimizer_steps": self.optimizer_steps,
            "where": self.describe(),
        }


_LIBRARY_PARTS = (f"{os.sep}site-packages{os.sep}", f"{os.sep}lit_parallel{os.sep}", "<frozen ")


def _main_thread_location() -> list[str]:
    """The innermost frames of the main thread, user code first (where a stuck rank is)."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return []
    stack = traceback.extract_stack(frame)
    user = [f for f in stack if not any(part in f.filename for part in _LIBRARY_PARTS)]
    picked = (user[-2:] if user else []) + [stack[-1]]
    out = []
    for f in picked:
        text = f"{f.filename}:{f.lineno} in {f.name}" + (f": {f.line.strip()}" if f.line else "")
        if text not in out:
            out.append(text)
    return out


_TIMEOUT = re.compile(r"timed out|timeout", re.IGNORECASE)
_MISMATCH = "Detected mismatch between collectives"
_PEER_LOST = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|recvBytes|failed to recv"
)
_DESYNC = "Expected to have finished reduction in the prior iteration"


def _classify(exception: BaseException) -> str:
    text = str(exception)
    if _MISMATCH in text:
        return "mismatch"
    if _DESYNC in text:
        return "desync"
    if isinstance(exception, (RuntimeError, dist.DistBackendError)) and _TIMEOUT.search(text):
        return "timeout"
    if _PEER_LOST.search(text):
        return "peer_lost"
    return "error"


def _collective_in(tb: Any) -> str | None:
    """The torch.distributed function (innermost) an exception was raised in, if any."""
    frames = traceback.extract_tb(tb) if tb is not None else []
    for f in reversed(frames):
        path = f.filename.replace(os.sep, "/")
        if "torch/distributed/" in path and not path.endswith("c10d_logger.py"):
            if "/fsdp/" in path:
                return f"FSDP2's {f.name} ({Path(path).name})"
            if "/checkpoint/" in path:
                return f"torch.distributed.checkpoint's {f.name}"
            return f"torch.distributed.{f.name}"
    return None


def _first_line(exception: BaseException) -> str:
    failures = getattr(exception, "failures", None)  # torch.distributed.checkpoint's CheckpointException
    if isinstance(failures, dict) and failures:
        parts = []
        for rank, failure in sorted(failures.items()):
            inner = (
                failure[0] if isinstance(failure, tuple) and failure else failure
            )  # (exception, traceback)
            parts.append(
                f"rank {rank}: {type(inner).__name__}: {str(inner).strip().splitlines()[0] if str(inner).strip() else ''}"
            )
        return f"{type(exception).__name__} (torch.distributed.checkpoint failed on " + "; ".join(parts) + ")"
    text = str(exception).strip().splitlines()
    return f"{type(exception).__name__}: {text[0] if text else ''}"[:400]


class _Reporter:
    """Failure reports through the default process group's key-value store (it outlives a broken group).

    A failing rank writes ``failure/<rank>`` and bumps ``failures``; every rank's watchdog thread polls the
    counter and, when it grows, writes ``status/<rank>`` (progress and main-thread location).
    """

    def __init__(self, store: Any, prefix: str, rank: int, world_size: int, progress: _Progress) -> None:
        self.store = store
        self.prefix = prefix
        self.rank = rank
        self.world_size = world_size
        self.progress = progress
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="lit_parallel-rank-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _key(self, *parts: Any) -> str:
        return "/".join([self.prefix, *map(str, parts)])

    def _watch(self) -> None:
        seen = 0
        while not self._stop.wait(POLL_S):
            try:
                count = self.store.add(self._key("failures"), 0)
                if count > seen:
                    seen = count
                    status = {**self.progress.as_dict(), "rank": self.rank, "pid": os.getpid()}
                    status["location"] = _main_thread_location()
                    self.store.set(self._key("status", self.rank), json.dumps(status))
            except Exception:  # the store is gone (its host exited): nothing left to report to
                return

    def _read(self, key: str) -> dict | None:
        try:
            if self.store.check([key]):
                return json.loads(self.store.get(key))
        except Exception:
            return None
        return None

    def report(self, exception: BaseException, kind: str, timeout: timedelta | None) -> str:
        mine = {
            **self.progress.as_dict(),
            "rank": self.rank,
            "error": _first_line(exception),
            "kind": kind,
            "collective": _collective_in(exception.__traceback__),
        }
        try:
            self.store.set(self._key("failure", self.rank), json.dumps(mine))
            self.store.add(self._key("failures"), 1)
        except Exception:
            return _compose(mine, {}, {}, self.world_size, timeout, reachable=False)
        failures: dict[int, dict] = {self.rank: mine}
        statuses: dict[int, dict] = {}
        if kind != "error":  # the other ranks' positions are the diagnosis
            # a lost connection usually means the peer timed out first: its record is there already
            deadline = time.monotonic() + (REPORT_WAIT_S if kind != "peer_lost" else REPORT_WAIT_S / 4)
            while time.monotonic() < deadline:
                for r in range(self.world_size):
                    if r in failures:
                        continue
                    got = self._read(self._key("failure", r))
                    if got is not None:
                        failures[r] = got
                        statuses.pop(r, None)
                    elif r not in statuses:
                        status = self._read(self._key("status", r))
                        if status is not None:
                            statuses[r] = status
                if len(failures) + len(statuses) == self.world_size:
                    break
                time.sleep(0.05)
        return _compose(mine, failures, statuses, self.world_size, timeout, reachable=True)


def _collective_name(record: dict) -> str:
    if record.get("collective"):
        return record["collective"]
    stage = record.get("stage", "")
    if stage == "backward":
        return "a gradient reduction in backward (DDP all-reduce / FSDP reduce-scatter)"
    if stage == "training_step":
        return "a collective in training_step (e.g. DDP's buffer broadcast, FSDP's all-gather)"
    return "a collective"


def _compose(
    mine: dict,
    failures: dict[int, dict],
    statuses: dict[int, dict],
    world_size: int,
    timeout: timedelta | None,
    reachable: bool,
) -> str:
    rank = mine["rank"]
    lines = [f"lit_parallel: rank {rank} failed in {mine['where']}: {mine['error']}"]
    kind = mine["kind"]
    if kind == "error":
        return lines[0]
    if kind == "timeout":
        limit = f" (the strategy's timeout: {timeout.total_seconds():g} s)" if timeout else ""
        timed_out = sorted(r for r, f in failures.items() if f.get("kind") == "timeout")
        lines.append(f"  collectives timed out{limit} on rank(s) {_ranks(timed_out)}:")
        for r in timed_out:
            f = failures[r]
            lines.append(f"    rank {r}: {_collective_name(f)}, during {f['where']}")
    elif kind == "mismatch":
        lines.append("  ranks called different collectives (debug_level='detail' caught it before they ran)")
    elif kind == "desync":
        lines.append("  this rank's previous backward did not finish its gradient reduction")
    elif kind == "peer_lost":
        lines.append(
            f"  {_collective_name(mine)} lost its connection to another rank (that rank exited, crashed, or"
            " timed out and closed the connection)"
        )
    for r in sorted(failures):
        f = failures[r]
        if r != rank and not (kind == "timeout" and f.get("kind") == "timeout"):
            lines.append(f"  rank {r} failed too, in {f['where']}: {f['error']}")
    for r in sorted(statuses):
        s = statuses[r]
        where = "; ".join(s.get("location", [])) or "unknown"
        lines.append(f"  rank {r} is alive and did not fail: it is in {s['where']}; main thread at {where}")
    missing = sorted(set(range(world_size)) - set(failures) - set(statuses))
    if missing:
        why = "did not answer (exited, or its store is unreachable)" if reachable else "could not be asked"
        lines.append(f"  rank(s) {_ranks(missing)} {why}")
    hint = _divergence_hint(failures, statuses)
    if hint:
        lines.append(f"  {hint}")
    if kind in ("timeout", "desync", "peer_lost"):
        lines.append(
            "  A rank that never reaches a collective is stuck (data loading, a deadlock) or skipped it through"
            " rank-dependent code: a branch that skips backward through the model or the optimizer step on some"
            " batch, or a collective (self.log(..., sync_dist=True), all_gather) called on some ranks only."
            " Run with debug_level='detail' to have the first diverging collective named."
        )
    return "\n".join(lines)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks)) if ranks else "none"


def _stage_kind(stage: str) -> str:
    return stage.split(" of training batch")[0].split(" (")[0]


def _divergence_hint(failures: dict[int, dict], statuses: dict[int, dict]) -> str | None:
    """Ranks at different points of training: say who is behind and what that suggests."""
    # a rank that failed with an ordinary error is not waiting anywhere: its error says what happened
    failures = {r: f for r, f in failures.items() if f.get("kind") != "error"}
    positions = {**statuses, **failures}
    trained = {r: p for r, p in positions.items() if p.get("batch", -1) >= 0}
    if len(trained) < 2:
        return None
    summary = "; ".join(
        f"rank {r}: {p['where']}, {p['backward_calls']} backward pass(es) done"
        for r, p in sorted(trained.items())
    )
    keys = {r: (p["epoch"], p["batch"]) for r, p in trained.items()}
    behind_key = min(keys.values())
    behind = sorted(r for r, k in keys.items() if k == behind_key)
    ahead = sorted(r for r, k in keys.items() if k != behind_key)
    waiting = [r for r in behind if r in failures]
    if ahead and waiting:
        return (
            f"ranks are at different points ({summary}): rank(s) {_ranks(ahead)} went past training batch"
            f" {behind_key[1]} (epoch {behind_key[0]}) without joining the collective rank(s) {_ranks(waiting)}"
            " waited in; look for a rank-dependent branch on that batch (a loss not computed through the model,"
            " a skipped optimizer step, a collective called on some ranks only)"
        )
    if ahead:
        return (
            f"ranks are at different points ({summary}): rank(s) {_ranks(behind)} have not reached training"
            f" batch {max(keys.values())[1]} yet (see where their main thread is above)"
        )
    stages = {r: _stage_kind(p["stage"]) for r, p in trained.items()}
    if len(set(stages.values())) > 1:
        failed = {r: stages[r] for r in failures if r in stages}
        if len(set(failed.values())) > 1:
            where = ", ".join(f"rank {r} in {st}" for r, st in sorted(failed.items()))
            return (
                f"on training batch {behind_key[1]} the ranks waited in different collectives ({where}): a"
                " collective called on some ranks only (self.log(..., sync_dist=True) or an all_gather in a"
                " rank-dependent branch), or a rank that skipped a step"
            )
        return f"ranks are at different points of training batch {behind_key[1]} ({summary})"
    if len({p["backward_calls"] for p in trained.values()}) > 1:
        return f"ranks ran backward a different number of times ({summary}): a rank skipped backward"
    return None


# --- Lightning's launcher: watchdog -----------------------------------------------------------------------


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


class _WatchedSubprocessScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's ``python train.py`` launcher plus :class:`_LauncherWatchdog`, and configuration checks
    that run before any rank is started."""

    def __init__(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._strategy = strategy

    @override
    def launch(self, function: Any, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        import lightning.pytorch as pl
        from lightning.fabric.strategies.launchers.subprocess_script import _launch_process_observer
        from lightning.pytorch.strategies.launchers.subprocess_script import _set_num_threads_if_needed

        model = next((a for a in args if isinstance(a, pl.LightningModule)), None)
        self._strategy._validate_before_launch(trainer, model)
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
            self._call_children_scripts()
            _launch_process_observer(self.procs)
            first = self.cluster_environment.node_rank() * self.num_processes + 1
            timeout = self._strategy._timeout or default_pg_timeout
            _LauncherWatchdog(self.procs, first, wait_s=timeout.total_seconds()).start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)


# --- process groups -------------------------------------------------------------------------------------

_OWNED_GROUPS: list[Any] = []
_RUNS = itertools.count()
# After a failed run destroyed its process group: the key-value store it rendezvoused on. torch keeps a
# store server per port alive in the process, with the old group's keys, so a new group on the same
# MASTER_PORT must use fresh keys (a new prefix) to rendezvous.
_RETRY: dict[str, Any] = {"store": None, "count": 0}


def _destroy_owned_group_at_exit() -> None:
    # Left to the interpreter's shutdown, gloo/NCCL objects are torn down in no particular order and a run
    # that succeeded sometimes aborts ("terminate called without an active exception"). Collect the dead
    # DDP/FSDP objects first, then destroy the group while Python is still fully alive.
    if _OWNED_GROUPS and dist.is_initialized():
        if dist.distributed_c10d._get_default_group() is _OWNED_GROUPS[-1]:
            gc.collect()
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    _OWNED_GROUPS.clear()


atexit.register(_destroy_owned_group_at_exit)


def _set_timeout_on_all_groups(timeout: timedelta) -> None:
    """The strategy's timeout on every process group of this rank (torch gives sub-groups its default)."""
    from torch.distributed.distributed_c10d import _set_pg_timeout, _world

    for group in list(_world.pg_map):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a group wrapped for debug_level='detail' cannot take it
            with contextlib.suppress(Exception):
                _set_pg_timeout(timeout, group)


# --- mid-epoch resume -----------------------------------------------------------------------------------


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


# --- the mixin ------------------------------------------------------------------------------------------


class _ReliabilityCallback(Callback):
    """Hooks the strategy needs from the training loop (strategies get no ``on_train_batch_end``). One per
    Trainer; it finds the strategy through the Trainer."""

    @staticmethod
    def _strategy(trainer) -> ReliabilityMixin | None:
        return trainer.strategy if isinstance(trainer.strategy, ReliabilityMixin) else None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        s = self._strategy(trainer)
        if s is None:
            return
        s._progress.at(
            f"after training batch {batch_idx} (epoch {trainer.current_epoch}): callbacks, loading the next batch"
        )
        if s._preemption is not None and not trainer.fit_loop.epoch_loop._should_accumulate():
            s._check_preemption(trainer)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        s = self._strategy(trainer)
        if s is not None:
            s._progress.at(f"validation batch {batch_idx}")

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        s = self._strategy(trainer)
        if s is not None:
            s._progress.at(f"end of epoch {trainer.current_epoch}")

    def teardown(self, trainer, pl_module, stage) -> None:
        # Lightning's signal connector puts back the handlers it found (ours) after the strategy's teardown
        s = self._strategy(trainer)
        if s is not None and s._retired_preemption is not None:
            s._retired_preemption.uninstall()
            s._retired_preemption = None


class _Preemption:
    def __init__(self, signum: signal.Signals, slurm: bool) -> None:
        self.signum = signum
        self.slurm = slurm
        self.requested = False
        self.retired = False
        self._previous: Any = None

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(self.signum, self._handler)

    def uninstall(self) -> None:
        self.retired = True
        if (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(self.signum) == self._handler
        ):
            signal.signal(self.signum, self._previous if self._previous is not None else signal.SIG_DFL)

    def _handler(self, signum: int, frame: Any) -> None:
        if self.retired:  # left installed after its run: behave as the handler it replaced
            previous = self._previous if self._previous is not None else signal.SIG_DFL
            signal.signal(self.signum, previous)
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_DFL:
                os.kill(os.getpid(), signum)
            return
        # Only a flag: saving here, at an arbitrary point of a step, would interleave collectives.
        self.requested = True
        if callable(self._previous):
            self._previous(signum, frame)


class ReliabilityMixin:
    """See the module docstring. Must precede Lightning's strategy class in the bases."""

    # --- set-up ---------------------------------------------------------------------------------------

    def _init_reliability(
        self,
        *,
        debug_level: DebugLevel | None,
        watchdog: bool,
        preemption_signal: PreemptionSignal,
        timeout: timedelta | None,
    ) -> None:
        self.reliability = ReliabilityOptions(
            debug_level=debug_level, watchdog=watchdog, preemption_signal=preemption_signal
        )
        # an explicit timeout also applies to a process group that exists before the strategy
        self._timeout_given = timeout is not default_pg_timeout and timeout is not None
        self._owns_process_group = False
        self._failed = False
        self._progress = _Progress()
        self._reporter: _Reporter | None = None
        self._preemption: _Preemption | None = None
        self._retired_preemption: _Preemption | None = None
        self._rng_at_resume: dict | None = None  # applied when Lightning's restore ends
        self._rng_restored: dict | None = None  # kept for a mid-epoch resume
        self._rng_at_first_batch: dict | None = None
        self._previous_debug_level: Any = None

    def _validate_before_launch(self, trainer: pl.Trainer | None, model: Any) -> None:
        """Configuration checks that need the Trainer or the model; run before Lightning's launcher starts
        any rank (and again, as part of set-up, when no launcher is involved)."""

    @property
    def owns_process_group(self) -> bool:
        """Whether this strategy created the default process group (and so destroys it)."""
        return self._owns_process_group

    def _configure_reliable_launcher(self) -> None:
        launcher = getattr(self, "_launcher", None)
        if type(launcher) is _SubprocessScriptLauncher and self.reliability.watchdog:
            self._launcher = _WatchedSubprocessScriptLauncher(
                self, launcher.cluster_environment, launcher.num_processes, launcher.num_nodes
            )
        if self.reliability.watchdog:
            _watch_launching_process()

    def _before_process_group(self) -> None:
        level = self.reliability.debug_level
        existed = dist.is_available() and dist.is_initialized()
        if level is not None:
            self._previous_debug_level = dist.get_debug_level()
            dist.set_debug_level(getattr(dist.DebugLevel, level.upper()))
            if existed and level == "detail" and rank_zero_only.rank == 0:
                warnings.warn(
                    "debug_level='detail': the default process group existed before the strategy, so only"
                    " process groups created from now on (the device mesh's) check collectives; set"
                    " TORCH_DISTRIBUTED_DEBUG=DETAIL in the launch environment to check the default group too",
                    stacklevel=3,
                )
        self._owns_process_group = not existed
        if not existed:
            self._init_process_group()

    def _init_process_group(self) -> None:
        """Create the process group before Lightning would (it then finds it), with two differences: the
        rendezvous may take as long as torch's default allows (ranks start at different times; the strategy's
        ``timeout`` is for collectives and is set on every group afterwards), and after a failed run in this
        process it rendezvouses under fresh keys (see ``_RETRY``)."""
        from lightning.fabric.utilities.distributed import _init_dist_connection

        self.set_world_ranks()
        backend = self._get_process_group_backend()
        rendezvous = max(self._timeout or default_pg_timeout, default_pg_timeout)
        if _RETRY["store"] is not None:
            dist.init_process_group(
                backend,
                store=dist.PrefixStore(f"lit_parallel_retry_{_RETRY['count']}/", _RETRY["store"]),
                rank=self.global_rank,
                world_size=self.world_size,
                timeout=rendezvous,
            )
            return
        kwargs: dict[str, Any] = {"timeout": rendezvous}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        _init_dist_connection(self.cluster_environment, backend, **kwargs)

    def _after_process_group(self) -> None:
        if self._owns_process_group:
            group = dist.distributed_c10d._get_default_group()
            if group not in _OWNED_GROUPS:
                _OWNED_GROUPS.append(group)
        self._apply_timeout()
        self._start_reporter()
        self._install_preemption()
        trainer = self._trainer_or_none()
        if trainer is not None and not any(isinstance(c, _ReliabilityCallback) for c in trainer.callbacks):
            trainer.callbacks.append(_ReliabilityCallback())

    def _apply_timeout(self) -> None:
        """The strategy's timeout on every process group it uses (call again after creating a mesh)."""
        if not (dist.is_available() and dist.is_initialized()):
            return
        if self._timeout is not None and (self._owns_process_group or self._timeout_given):
            _set_timeout_on_all_groups(self._timeout)

    def _trainer_or_none(self) -> pl.Trainer | None:
        lm = self.lightning_module
        return lm._trainer if lm is not None else None

    def _start_reporter(self) -> None:
        if self._reporter is not None or dist.get_world_size() == 1:
            return
        try:
            store = dist.distributed_c10d._get_default_store()
        except Exception:
            return
        prefix = f"lit_parallel/run{next(_RUNS)}"
        self._reporter = _Reporter(store, prefix, dist.get_rank(), dist.get_world_size(), self._progress)
        self._reporter.start()

    def _install_preemption(self) -> None:
        from lightning.fabric.plugins.environments import SLURMEnvironment

        wanted = self.reliability.preemption_signal
        env = self.cluster_environment
        # torchrun inside a SLURM job runs under TorchElasticEnvironment: the job is still SLURM's
        slurm = isinstance(env, SLURMEnvironment) or SLURMEnvironment.detect()
        if wanted == "auto":
            if isinstance(env, SLURMEnvironment):
                wanted = env.requeue_signal if env.auto_requeue else None
            else:
                wanted = signal.SIGUSR1 if slurm else None
        if wanted is None or self._preemption is not None:
            return
        self._preemption = _Preemption(signal.Signals(wanted), slurm=slurm)
        self._preemption.install()

    # --- Lightning hooks ------------------------------------------------------------------------------

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()  # type: ignore[misc]
        self._configure_reliable_launcher()

    @override
    def setup_distributed(self) -> None:  # DDPStrategy
        self._before_process_group()
        super().setup_distributed()  # type: ignore[misc]
        self._after_process_group()

    def _setup_distributed(self) -> None:  # ModelParallelStrategy
        self._before_process_group()
        super()._setup_distributed()  # type: ignore[misc]
        self._after_process_group()

    @override
    def on_exception(self, exception: BaseException) -> None:
        # Lightning's DDPStrategy.on_exception is not called: it rewrites DDP's messages with advice for
        # DDPStrategy; lit_parallel strategies add their own before calling this.
        self._failed = True
        if self._reporter is None:
            text = f"lit_parallel: rank {self.global_rank} failed in {self._progress.describe()}: {_first_line(exception)}"
        else:
            kind = _classify(exception)
            timeout = self._timeout if (self._owns_process_group or self._timeout_given) else None
            try:
                text = self._reporter.report(exception, kind, timeout)
            except Exception as err:  # a report must never hide the original error
                text = (
                    f"lit_parallel: rank {self.global_rank} failed: {_first_line(exception)} (report: {err})"
                )
        _stderr(text)
        rest = text.partition("\n")[2]
        if (
            exception.args
            and isinstance(exception.args[0], str)
            and "lit_parallel: rank" not in exception.args[0]
        ):
            # the error is right above: keep only where it happened and what the other ranks were doing
            short = f"lit_parallel: rank {self.global_rank} failed in {self._progress.describe()}"
            exception.args = (
                f"{exception.args[0]}\n\n{short}" + (f"\n{rest}" if rest else ""),
                *exception.args[1:],
            )

    @override
    def teardown(self) -> None:
        super().teardown()  # type: ignore[misc]
        if self._reporter is not None:
            self._reporter.stop()
            self._reporter = None
        if self._preemption is not None:
            self._preemption.uninstall()
            self._retired_preemption, self._preemption = self._preemption, None
        self._rng_at_resume = self._rng_restored = self._rng_at_first_batch = None
        if self._failed and self._owns_process_group and dist.is_initialized():
            # A failed run leaves its process group unusable (a timed-out collective poisons it): destroy it
            # so that a retry in this process creates a fresh one.
            with contextlib.suppress(Exception):
                _RETRY["store"] = dist.distributed_c10d._get_default_store()
                _RETRY["count"] += 1
                dist.destroy_process_group()
            _OWNED_GROUPS.clear()
        if self._previous_debug_level is not None:
            dist.set_debug_level(self._previous_debug_level)
            self._previous_debug_level = None
        self._failed = False

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        p = self._progress
        trainer = self._trainer_or_none()
        p.batch, p.epoch = batch_idx, trainer.current_epoch if trainer is not None else 0
        p.at("on_train_batch_start")
        if self._rng_at_first_batch is not None:
            # mid-epoch resume: the dataloader's iterator drew from the RNG after the checkpoint's state was
            # restored; an uninterrupted run drew at the start of the epoch, before the checkpoint
            restore_rng_state(self._rng_at_first_batch)
            self._rng_at_first_batch = None
        super().on_train_batch_start(batch, batch_idx)  # type: ignore[misc]

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._progress.at("training_step")
        out = super().training_step(*args, **kwargs)  # type: ignore[misc]
        self._progress.at("after training_step (closure, backward)")
        return out

    @override
    def backward(self, closure_loss: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.world_size > 1 and not _reaches_a_parameter(closure_loss):
            # backward would run without touching the model, so this rank would skip the gradient collectives
            # the other ranks wait in: a silent deadlock. Cheap to detect here.
            raise RuntimeError(
                f"rank {self.global_rank}: the loss of training batch {self._progress.batch} (epoch"
                f" {self._progress.epoch}) was not computed from the model's parameters, so its backward would skip"
                " the gradient collectives the other ranks wait in. Every rank must backpropagate through the model on every batch; to drop a"
                " batch's contribution on some ranks, return `loss * 0.0` instead of a new tensor."
            )
        self._progress.at("backward")
        out = super().backward(closure_loss, *args, **kwargs)  # type: ignore[misc]
        self._progress.backward_calls += 1
        self._progress.at("after backward (gradient clipping, optimizer step)")
        return out

    @override
    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        out = super().optimizer_step(*args, **kwargs)  # type: ignore[misc]
        self._progress.optimizer_steps += 1
        self._progress.at("after the optimizer step")
        return out

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._progress.at("validation_step")
        return super().validation_step(*args, **kwargs)  # type: ignore[misc]

    @override
    def barrier(self, name: str | None = None, *args: Any, **kwargs: Any) -> None:
        super().barrier(name, *args, **kwargs)  # type: ignore[misc]
        if name == "_CheckpointConnector.resume_end" and self._rng_at_resume is not None:
            # the last point before the fit loop creates the epoch's dataloader iterator (which draws from the
            # RNG, as it does after the checkpoint in an uninterrupted run)
            restore_rng_state(self._rng_at_resume)
            self._rng_restored, self._rng_at_resume = self._rng_at_resume, None

    # --- checkpoints ----------------------------------------------------------------------------------

    def _gather_rng_states(self) -> list[dict] | None:
        state = capture_rng_state()
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return [state]
        gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(state, gathered, dst=0)
        return gathered

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        self._progress.at(f"saving the checkpoint {str(filepath)!r} ({self._progress.describe()})")
        states = self._gather_rng_states()
        if states is not None:
            checkpoint[RNG_KEY] = {"world_size": len(states), "ranks": states}
        if _is_remote(filepath):
            return super().save_checkpoint(checkpoint, filepath, storage_options)  # type: ignore[misc]
        from lightning.pytorch.strategies import ModelParallelStrategy

        if isinstance(self, ModelParallelStrategy):
            return self._save_model_parallel_checkpoint(checkpoint, filepath, storage_options)
        if self.is_global_zero:
            check_replaceable(filepath)
            atomic_save(
                lambda tmp: self.checkpoint_io.save_checkpoint(
                    checkpoint, tmp, storage_options=storage_options
                ),
                filepath,
            )
        return None

    def _save_model_parallel_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None
    ) -> None:
        """``ModelParallelStrategy.save_checkpoint`` written under a temporary name: Lightning's ``meta.pt``
        first, then the shards, then DCP's ``.metadata`` (last, by DCP), then the rename into place."""
        from lightning.fabric.strategies.model_parallel import _distributed_checkpoint_save

        if storage_options is not None:
            raise TypeError(
                f"`{type(self).__name__}.save_checkpoint(..., storage_options=...)` is not supported because"
                f" `{type(self).__name__}` does not use the `CheckpointIO`."
            )
        path = Path(self.broadcast(str(filepath)))
        check_replaceable(path)
        if not self._save_distributed_checkpoint:
            if self.is_global_zero:
                atomic_save(lambda tmp: self.checkpoint_io.save_checkpoint(checkpoint, tmp), path)
            return
        token = self.broadcast(uuid.uuid4().hex[:12] if self.is_global_zero else None)
        partial = new_partial_path(path, token)
        if self.is_global_zero:
            partial.mkdir(parents=True)
        self.barrier()
        converted = {"state_dict": checkpoint.pop("state_dict")}
        converted.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        try:
            if self.is_global_zero:
                torch.save(checkpoint, partial / LIGHTNING_META)
            _distributed_checkpoint_save(converted, partial)
            self.barrier()
        except BaseException:
            if self.is_global_zero:
                import shutil

                shutil.rmtree(partial, ignore_errors=True)
            raise
        if self.is_global_zero:
            commit(partial, path)
        self.barrier()

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        from lightning.pytorch.strategies import ModelParallelStrategy

        self._progress.at(f"restoring the checkpoint {str(checkpoint_path)!r}")
        path = checkpoint_path
        if not _is_remote(path):
            path = Path(self.broadcast(str(path)))
            kind = verify_checkpoint(path)
        else:
            kind = "remote"
        if weights_only is None:
            weights_only = True  # never unpickle code from a checkpoint unless asked to
        if isinstance(self, ModelParallelStrategy) and kind == "sharded":
            checkpoint = self._load_sharded_checkpoint(Path(path))
        else:
            checkpoint = super().load_checkpoint(path, weights_only=weights_only)  # type: ignore[misc]
        self._take_rng_states(checkpoint)
        return checkpoint

    def _load_sharded_checkpoint(self, path: Path) -> dict[str, Any]:
        """Lightning's sharded load, with DCP's index and non-tensor entries read without unpickling code."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        module = self.model
        assert module is not None and self.lightning_module is not None
        module_state = {"state_dict": get_model_state_dict(module)}
        dcp_load(module_state, path)
        module.load_state_dict(module_state["state_dict"], strict=self.lightning_module.strict_loading)
        for i, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{i}"
            optim_state = {key: get_optimizer_state_dict(module, optimizer)}
            dcp_load(optim_state, path)
            set_optimizer_state_dict(
                module,
                optimizer,
                optim_state_dict=optim_state[key],
                options=StateDictOptions(cpu_offload=True),
            )
        return torch.load(path / LIGHTNING_META, weights_only=True)

    def _take_rng_states(self, checkpoint: dict[str, Any]) -> None:
        from lightning.pytorch.trainer.states import TrainerFn

        entry = checkpoint.get(RNG_KEY)
        trainer = self._trainer_or_none()
        if entry is None or trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return  # evaluation keeps the RNG the user seeded
        if entry["world_size"] != self.world_size:
            _info(
                f"the checkpoint holds the RNG states of {entry['world_size']} ranks and this run has"
                f" {self.world_size}: RNG states are not restored, so dropout masks and random augmentations"
                " differ from an uninterrupted run"
            )
            return
        self._rng_at_resume = entry["ranks"][self.global_rank]

    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)  # type: ignore[misc]
        trainer = self._trainer_or_none()
        from lightning.pytorch.trainer.states import RunningStage, TrainerFn

        if (
            trainer is None
            or trainer.state.fn != TrainerFn.FITTING
            or trainer.state.stage != RunningStage.TRAINING
        ):
            return dataloader
        self._resume_mid_epoch(trainer, dataloader)
        return dataloader

    def _resume_mid_epoch(self, trainer: pl.Trainer, loader: Any) -> None:
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
        rng, self._rng_restored = self._rng_restored, None
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
            self._rng_at_first_batch = rng
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
        self._rng_at_first_batch = rng
        warnings.filterwarnings(
            "ignore", message="You're resuming from a checkpoint that ended before the epoch ended"
        )
        _info(
            f"resuming mid-epoch: {where}; the sampler skips the {done * batch_sampler.batch_size} samples"
            " per rank that epoch already used"
        )

    # --- preemption -----------------------------------------------------------------------------------

    def _check_preemption(self, trainer: pl.Trainer) -> None:
        assert self._preemption is not None
        flag = torch.tensor([1.0 if self._preemption.requested else 0.0], device=self.root_device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() == 0:
            return
        self._preemption.requested = False
        path = self.broadcast(trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir))
        trainer.save_checkpoint(path)
        requeued = ""
        if self.is_global_zero and self._preemption.slurm:
            requeued = _requeue_slurm_job()
        sig = self._preemption.signum.name
        _info(
            f"preemption ({sig}): saved {path} at epoch {trainer.current_epoch}, after training batch"
            f" {self._progress.batch}{requeued}; stopping"
        )
        trainer.should_stop = True


def _reaches_a_parameter(loss: torch.Tensor, budget: int = 20_000) -> bool:
    """Whether backward from ``loss`` can reach a parameter (an ``nn.Parameter`` leaf, or a custom autograd
    function that may hide one, such as reentrant activation checkpointing). Breadth-first from the loss: a
    model's output layer is a few nodes away, so this stops early; only a loss built from fresh tensors
    (``torch.zeros(1, requires_grad=True)``) explores its whole, tiny graph and returns ``False``."""
    from torch.autograd.function import BackwardCFunction

    fn = loss.grad_fn
    if fn is None:
        return isinstance(loss, torch.nn.Parameter)
    seen = {fn}
    queue = collections.deque([fn])
    while queue:
        node = queue.popleft()
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.nn.Parameter) or isinstance(node, BackwardCFunction):
            return True
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                if len(seen) >= budget:
                    return True  # too large to be a loss computed from nothing
                seen.add(nxt)
                queue.append(nxt)
    return False


def _requeue_slurm_job() -> str:
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job_id = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ["SLURM_JOB_ID"]
    if not re.fullmatch(r"[0-9_]+", job_id):
        raise ValueError(f"SLURM job id {job_id!r} is not numeric; refusing to pass it to scontrol")
    try:
        code = subprocess.call(["scontrol", "requeue", job_id])
    except FileNotFoundError:
        log.warning(f"preemption: scontrol not found; SLURM job {job_id} was not requeued")
        return f"; scontrol not found, job {job_id} NOT requeued"
    if code != 0:
        log.warning(f"preemption: `scontrol requeue {job_id}` failed with exit code {code}")
        return f"; requeueing job {job_id} failed (exit code {code})"
    return f"; requeued SLURM job {job_id}"


def _is_remote(path: Any) -> bool:
    return "://" in str(path)
