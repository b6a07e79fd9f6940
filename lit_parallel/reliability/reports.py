"""Failure reports: each rank's progress, and what a failing rank tells about the others (which collective,
on which ranks, where the ranks that never arrived are)."""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lit_parallel.reliability.options import POLL_S, REPORT_WAIT_S

_SAVING = "saving the checkpoint"


class _Progress:
    """Where this rank is in the run; read by failure reports (cheap: a few attribute writes per step)."""

    def __init__(self) -> None:
        self.stage = "setup"
        self.epoch = 0
        self.batch = -1
        self.backward_calls = 0
        self.optimizer_steps = 0
        self._before_saving = ""

    def at(self, stage: str) -> None:
        self.stage = stage

    def saving(self, path: Any = None) -> None:
        """A checkpoint save begins (every rank) or writes to ``path`` (the ranks that write)."""
        if not self.stage.startswith(_SAVING):
            self._before_saving = self.describe()
        where = f" {str(path)!r}" if path is not None else ""
        self.stage = f"{_SAVING}{where} ({self._before_saving})"

    def describe(self) -> str:
        if self.stage.startswith("on_"):  # a hook after the batches (on_train_end): its name says where
            return self.stage
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


def _main_thread_frames(limit: int = 40) -> list[list]:
    """The main thread's innermost ``limit`` frames as ``[filename, lineno, function, code]`` (JSON-ready)."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return []
    stack = traceback.extract_stack(frame)[-limit:]
    return [[f.filename, f.lineno, f.name, (f.line or "").strip()] for f in stack]


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
            # a failure is (exception, traceback)
            inner = failure[0] if isinstance(failure, tuple) and failure else failure
            parts.append(
                f"rank {rank}: {type(inner).__name__}: {str(inner).strip().splitlines()[0] if str(inner).strip() else ''}"
            )
        return f"{type(exception).__name__} (torch.distributed.checkpoint failed on " + "; ".join(parts) + ")"
    text = str(exception).strip().splitlines()
    return f"{type(exception).__name__}: {text[0] if text else ''}"[:400]


_RANK_LABEL = re.compile(r"lit_parallel: rank (\d+) failed in ([^\n]+)")


def _spawned_failure(exception: BaseException, first_rank: int) -> str | None:
    """In the launching process of ``ddp_spawn`` (no rank itself): the report of the started process that
    failed, from torch.multiprocessing's exception (``None`` for any other exception). A rank that raised
    added its own label ("lit_parallel: rank N failed in <hook>") to its error, whose traceback this exception
    carries; without one, the process's index (its local rank; ``first_rank`` is local rank 0's global rank)
    is what is known."""
    from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

    if not isinstance(exception, (ProcessRaisedException, ProcessExitedException)):
        return None
    rank = first_rank + exception.error_index
    if isinstance(exception, ProcessExitedException):
        how = (
            f"signal {exception.signal_name}" if exception.signal_name else f"exit code {exception.exit_code}"
        )
        return f"lit_parallel: rank {rank} (pid {exception.error_pid}) died with {how}"
    text = exception.msg
    lines = text.splitlines()
    files = [i for i, line in enumerate(lines) if line.startswith("  File ")]
    after = lines[files[-1] + 1 :] if files else lines
    error = next((line for line in after if line.strip() and not line.startswith(" ")), "")
    labels = _RANK_LABEL.findall(text)
    where = f" in {labels[-1][1]}" if labels else ""
    rank = int(labels[-1][0]) if labels else rank
    return (
        f"lit_parallel: rank {rank} failed{where}: {error[:400]} (pid {exception.error_pid}, started by"
        " ddp_spawn; its traceback is above)"
    )


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
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * POLL_S)

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
