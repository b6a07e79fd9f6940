"""Stall reports: when no rank completes a training step for ``stall_timeout`` seconds, one report says where
every rank is, and every rank exits with status :data:`STALL_EXIT_CODE`.

Only time inside a training step counts (``on_train_batch_start`` to ``on_train_batch_end``; the first
:data:`WARMUP_STEPS` steps of a fit excluded: warm-up, ``ddp_tuned``'s wrap). Data loading, validation,
checkpoint saves, the callbacks between steps and torch.compile's compilations (also recompiles late in
training, on any thread) pause the clock; a rank in one of them makes the others wait up to the limit
(``limit_s``: the collective timeout less a margin, see
:func:`~lit_parallel.reliability.options.limit_before_timeout_s`) before a stall is reported. The decision is
global: a rank whose step exceeds the deadline asks every rank, through the process group's key-value store,
what it is doing; only when no rank is in a paused phase is the stall reported, by exactly one rank. Every
limit ends before a waiting collective times out, so that the report is written before NCCL's watchdog ends
the process; each rank then aborts its communicators and exits.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from lit_parallel import _compat
from lit_parallel.reliability.groups import exit_process
from lit_parallel.reliability.options import (
    AUTO_FACTOR,
    AUTO_FLOOR_S,
    REPORT_WAIT_S,
    _stderr,
)

STALL_EXIT_CODE = 124  # as timeout(1)
RECENT_STEPS = 100
WARMUP_STEPS = 2  # not timed: warm-up (ddp_tuned wraps the model in DDP on the second step)
COMPILING = "compiling (torch.compile)"
CHECK_S = 1.0  # how often each rank's watchdog thread looks at its clock and at the store
_END = 1 << 40  # added to the query counter: the run ends

StallTimeout = Literal["auto"] | float | int | bool | None


def step_deadline_s(
    setting: Literal["auto"] | float | None, slowest_step_s: float | None, limit_s: float
) -> float | None:
    """How long one training step may last before it is a stall; ``None``: not timed (off, or ``"auto"`` before
    a step has been measured in this fit, or ``"auto"`` under a collective timeout that leaves less than
    :data:`AUTO_FLOOR_S`). ``limit_s``: the longest any stall limit may be (the collective timeout less a
    margin); a number given as ``setting`` was checked against it when the watchdog started."""
    if setting is None:
        return None
    if setting != "auto":
        return float(setting)
    if slowest_step_s is None or limit_s < AUTO_FLOOR_S:
        return None
    return min(limit_s, max(AUTO_FLOOR_S, AUTO_FACTOR * slowest_step_s))


class StallClock:
    """This rank's side, updated from the training loop (a few attribute writes per step); read by the
    watchdog thread."""

    def __init__(self) -> None:
        self.in_step = False
        self.phase = "setup"
        self.since = time.monotonic()
        self.completed = 0
        self.durations: deque[float] = deque(maxlen=RECENT_STEPS)
        self._step_start: float | None = None
        self._before_compile: tuple[bool, str] | None = None

    def step_begins(self) -> None:
        now = time.monotonic()
        self.since = self._step_start = now
        self.in_step = self.completed >= WARMUP_STEPS
        self.phase = "training step" if self.in_step else "a warm-up step (not timed: compilation, DDP wrap)"

    def step_ends(self) -> None:
        if self.in_step and self._step_start is not None:
            self.durations.append(time.monotonic() - self._step_start)
        self.completed += 1
        self._step_start = None
        self.pause("between training steps (callbacks, data loading)")

    def pause(self, what: str) -> None:
        self.in_step = False
        self._step_start = None  # a step that contained a save or validation is not a step time
        self.phase = what
        self.since = time.monotonic()

    def compile_begins(self, *args: Any) -> None:
        """torch.compile starts compiling (dynamo's callback, on whatever thread compiles): not timed until it
        ends; the step it happens in is not a step time (it would raise ``"auto"``'s deadline)."""
        self._before_compile = (self.in_step, self.phase)
        self.in_step = False
        self._step_start = None
        self.phase = COMPILING
        self.since = time.monotonic()

    def compile_ends(self, *args: Any) -> None:
        """The compilation ended: back to the phase it interrupted (timed afresh from now)."""
        before, self._before_compile = self._before_compile, None
        if before is None or self.phase != COMPILING:  # the loop moved on meanwhile (another thread)
            return
        self.in_step, self.phase = before
        self.since = time.monotonic()

    def slowest(self) -> float | None:
        recent = tuple(self.durations)  # copied in one C call: the main thread may append meanwhile
        return max(recent) if recent else None


# --- the report -----------------------------------------------------------------------------------------

_LIBRARY_PARTS = (
    f"{os.sep}site-packages{os.sep}",
    f"{os.sep}lit_parallel{os.sep}",
    "<frozen ",
    f"{os.sep}lib{os.sep}python",
)


def _is_library(filename: str) -> bool:
    return any(part in filename for part in _LIBRARY_PARTS)


def _waiting_in(frames: list[list]) -> str | None:
    """The collective the innermost frames are in, in words."""
    for filename, _, name, _ in reversed(frames):
        path = filename.replace(os.sep, "/")
        if "torch/distributed/" in path and not path.endswith("c10d_logger.py"):
            if "/fsdp/" in path:
                return f"FSDP2's {name}"
            if "/tensor/" in path:
                return f"a tensor-parallel collective ({name})"
            return f"torch.distributed.{name}"
    return None


def short_position(answer: dict) -> str:
    """One rank's position in a few words, e.g. ``training_step at model.py:42`` or ``backward, waiting in the
    gradient all-reduce / reduce-scatter (from main at train.py:88)`` (the innermost frame of your code)."""
    stage = answer.get("stage", "?").split(" (")[0].split(" of training batch")[0]
    frames = answer.get("frames") or []
    user = [f for f in frames if not _is_library(f[0])]
    waiting = "the gradient all-reduce / reduce-scatter" if stage == "backward" else _waiting_in(frames)
    text, called_from = stage, ""
    if user:
        filename, lineno, name, _ = user[-1]
        if name == stage:
            text += f" at {Path(filename).name}:{lineno}"
        else:
            called_from = f" (from {name} at {Path(filename).name}:{lineno})"
    if waiting:
        text += f", waiting in {waiting}"
    return text + called_from


def _ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def compose_stall_report(
    answers: dict[int, dict], world_size: int, deadline_s: float, setting: Any, stalled_s: float
) -> str:
    """The one report of a stall: a summary line grouping ranks by position, then each rank's details."""
    groups: dict[str, list[int]] = {}
    for r in sorted(answers):
        groups.setdefault(short_position(answers[r]), []).append(r)
    summary = "; ".join(f"{_ranks_text(ranks)} in {pos}" for pos, ranks in groups.items())
    configured = f"'auto': {deadline_s:g} s" if setting == "auto" else f"{setting:g} s"
    lines = [
        f"lit_parallel: stall: no rank completed a training step for {stalled_s:.1f} s (stall_timeout={configured});"
        f" ending the run with exit status {STALL_EXIT_CODE}",
        f"  {summary}",
    ]
    missing = sorted(set(range(world_size)) - set(answers))
    if missing:
        lines[1] += f"; {_ranks_text(missing)} did not answer (its main thread may hold the interpreter lock)"
    lines.append("  where each rank is (innermost frames of its main thread, your code first):")
    for r in sorted(answers):
        a = answers[r]
        lines.append(
            f"    rank {r}: {a.get('where', '?')}, {a.get('elapsed', 0.0):.1f} s in {a.get('phase', '?')}"
        )
        for filename, lineno, name, code in _picked(a.get("frames") or []):
            lines.append(f"      {filename}:{lineno} in {name}" + (f": {code}" if code else ""))
    slowest = max((a.get("slowest") or 0.0 for a in answers.values()), default=0.0)
    lines.append(
        f"  The slowest recent step took {slowest:.2f} s. If a step may legitimately take longer, pass"
        " stall_timeout=<seconds> to the strategy (or None to turn stall reports off)."
    )
    return "\n".join(lines)


def _picked(frames: list[list]) -> list[list]:
    user = [f for f in frames if not _is_library(f[0])]
    picked = user[-2:] + frames[-2:]
    out: list[list] = []
    for f in picked:
        if f not in out:
            out.append(f)
    return out


# --- the watchdog thread --------------------------------------------------------------------------------


class StallWatchdog:
    """One thread per rank: watches this rank's :class:`StallClock`, answers other ranks' questions, and ends
    the run on a stall. ``describe()`` returns this rank's progress and main-thread frames; ``on_end(code)``
    runs before this process exits (the launching process waits for its child ranks there)."""

    def __init__(
        self,
        store: Any,
        prefix: str,
        rank: int,
        world_size: int,
        clock: StallClock,
        setting: Literal["auto"] | float,
        describe: Callable[[], dict],
        on_end: Callable[[int], None],
        limit_s: float,
    ) -> None:
        self.store, self.prefix, self.rank, self.world_size = store, prefix, rank, world_size
        self.clock, self.setting, self.describe, self.on_end = clock, setting, describe, on_end
        self.limit_s = limit_s  # no stall limit is longer: the collective timeout less a margin
        self._stop = threading.Event()
        self._answered = 0
        self._next_check = 0.0
        self._silent: set[int] = set()  # ranks that did not answer the last question
        # ends the process: aborts the communicators first (NCCL peers fail at once), then os._exit
        self.exit: Callable[[int], Any] = exit_process
        self._compiles = (clock.compile_begins, clock.compile_ends)
        self._thread = threading.Thread(target=self._run, name="lit_parallel-stall-watchdog", daemon=True)

    def start(self) -> None:
        try:
            _compat.watch_compiles(*self._compiles)
        except ImportError as err:  # an older or newer torch without dynamo's callbacks
            self._compiles = None
            _stderr(
                f"lit_parallel: the stall clock cannot see torch.compile's compilations on this torch ({err}); a"
                " recompilation longer than the stall limit would be reported as a stall"
            )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * CHECK_S + REPORT_WAIT_S)
        if self._compiles is not None:
            _compat.unwatch_compiles(*self._compiles)

    def _key(self, *parts: Any) -> str:
        return "/".join([self.prefix, *map(str, parts)])

    def _run(self) -> None:
        while not self._stop.wait(CHECK_S):
            try:
                if self._compiles is not None:  # torch._dynamo.reset() removes every compile callback
                    _compat.watch_compiles(*self._compiles)
                self.poll()
            except Exception:  # the store is gone (its host exited): nothing left to coordinate with
                return

    def poll(self) -> None:
        """One look: end the run if another rank reported a stall, answer a question, check this rank's clock."""
        asked = self.store.add(self._key("query"), 0)
        if asked >= _END:
            self._end(reporter=False)
            return
        if asked > self._answered:
            self._answer(asked)
        if self._stalled_here():
            self._check()

    def _answer(self, query: int) -> None:
        now = time.monotonic()
        clock = self.clock
        answer = {
            **self.describe(),
            "query": query,
            "in_step": clock.in_step,
            "phase": clock.phase,
            "elapsed": now - clock.since,
            "slowest": clock.slowest(),
        }
        self.store.set(self._key("answer", self.rank), json.dumps(answer))
        self._answered = query

    def _stalled_here(self) -> bool:
        now = time.monotonic()
        if now < self._next_check or not self.clock.in_step:
            return False
        deadline = step_deadline_s(self.setting, self.clock.slowest(), self.limit_s)
        return deadline is not None and now - self.clock.since > deadline

    def _collect(self, query: int) -> dict[int, dict]:
        answers: dict[int, dict] = {}
        deadline = time.monotonic() + REPORT_WAIT_S
        while True:
            for r in range(self.world_size):
                key = self._key("answer", r)
                if r not in answers and self.store.check([key]):
                    got = json.loads(self.store.get(key))
                    if got.get("query", 0) >= query:
                        answers[r] = got
            if len(answers) == self.world_size or time.monotonic() >= deadline:
                return answers
            time.sleep(0.05)

    def _check(self) -> None:
        stalled_s = time.monotonic() - self.clock.since
        query = self.store.add(self._key("query"), 1)
        self._answer(query)
        answers = self._collect(query)
        limit = self.limit_s  # a rank loading data, validating, saving or compiling longer is stalled too
        paused = [r for r, a in answers.items() if not a["in_step"] and a["elapsed"] < limit]
        # a rank that did not answer twice in a row is stuck (its main thread holds the interpreter lock);
        # once may just be a busy machine
        missing = set(range(self.world_size)) - set(answers)
        silent_before, self._silent = self._silent, missing
        deadline = step_deadline_s(self.setting, self.clock.slowest(), self.limit_s) or 0.0
        if paused or not self.clock.in_step or not missing <= silent_before:
            # a rank loading data, validating or saving holds the others up: not a stall (yet). Ask again
            # soon after the first of them reaches the limit, not later: the collective timeout follows
            wait = max(5.0, deadline / 4)
            if paused:
                wait = min(wait, max(CHECK_S, min(limit - answers[r]["elapsed"] for r in paused) + CHECK_S))
            self._next_check = time.monotonic() + wait
            return
        if self.store.add(self._key("reporter"), 1) != 1:
            self._next_check = float("inf")  # another rank reports; wait for the end
            return
        _stderr(compose_stall_report(answers, self.world_size, deadline, self.setting, stalled_s))
        self.store.add(self._key("query"), _END)
        self._end(reporter=True)

    def _end(self, reporter: bool) -> None:
        try:
            acks = self.store.add(self._key("acks"), 1)
            wait_until = time.monotonic() + REPORT_WAIT_S
            while reporter and acks < self.world_size and time.monotonic() < wait_until:
                time.sleep(0.05)
                acks = self.store.add(self._key("acks"), 0)
        except Exception:
            pass
        self.on_end(STALL_EXIT_CODE)
        self.exit(STALL_EXIT_CODE)
