"""Reliability options (debug level, watchdog, preemption signal, stall timeout) and their validation."""

from __future__ import annotations

import math
import signal
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

from lit_parallel.reliability.async_checkpoints import check_async_checkpoint

DEBUG_LEVELS = ("off", "info", "detail")
RNG_KEY = "lit_parallel_rng_states"
LAUNCHER_PID_ENV = "LIT_PARALLEL_LAUNCHER_PID"
# how long a failing rank waits for the others' answers before it reports a timeout or a divergence
REPORT_WAIT_S = 2.0
POLL_S = 0.2
# stall_timeout="auto" (lit_parallel.reliability.stall)
AUTO_FACTOR = 10.0  # "auto": this many times the slowest of the recent steps ...
AUTO_FLOOR_S = 120.0  # ... but at least this (steps under a second: reported within about two minutes) ...
# ... and at most the collective timeout less a margin (limit_before_timeout_s). Every stall limit (the step
# deadline, the time a rank may stay in data loading, validation or a save) must end before a waiting
# collective times out: on NCCL the watchdog then ends the process, and no report would be written. The
# margin: 10 % of the timeout, at least the time a stall report takes from the deadline to the exit (a look
# at the clock, collecting the answers, the other ranks' acknowledgements, stopping the started ranks,
# aborting the communicators: under 25 s).
MARGIN_FRACTION = 0.1
MARGIN_MIN_S = 30.0

DebugLevel = Literal["off", "info", "detail"]
PreemptionSignal = Literal["auto"] | int | signal.Signals | str | None


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


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
        stall_timeout: ``"auto"`` (default): when no rank completes a training step for 10 x the slowest recent
            step (at least 120 s, at most the collective timeout less a margin: 1620 s for 30 minutes), one
            report says where every rank is and every rank exits with status 124 (see
            :mod:`~lit_parallel.reliability.stall`). A number: that many seconds, below the same limit.
            ``None`` or ``False``: off.
        preemption_signal: ``"auto"`` (default): in a SLURM job (Lightning's ``SLURMEnvironment``, or torchrun
            inside a SLURM allocation), SLURM's requeue signal (``SIGUSR1``, or the environment's
            ``requeue_signal``; off when its ``auto_requeue`` is off); otherwise off. A signal (``"SIGUSR1"``,
            ``signal.SIGUSR2``, ...) turns preemption checkpoints on anywhere; ``None`` turns them off.
        async_checkpoint: ``False`` (default): a save returns when the checkpoint is written. ``True``: training
            waits only for a copy of the state in host memory; the write runs in the background with the same
            guarantees (:mod:`~lit_parallel.reliability.async_checkpoints`). ``"auto"``: in the background when
            the first save took longer than a few training steps.
    """

    debug_level: DebugLevel | None = None
    watchdog: bool = True
    preemption_signal: PreemptionSignal = "auto"
    stall_timeout: Any = "auto"
    async_checkpoint: Any = False

    def __post_init__(self) -> None:
        if self.debug_level is not None and self.debug_level not in DEBUG_LEVELS:
            raise ValueError(
                f"debug_level={self.debug_level!r} must be None (keep TORCH_DISTRIBUTED_DEBUG), 'off', 'info' or"
                " 'detail' (check that every rank runs the same collective)"
            )
        if not isinstance(self.watchdog, bool):
            raise ValueError(f"watchdog={self.watchdog!r} must be True or False")
        object.__setattr__(self, "preemption_signal", _parse_signal(self.preemption_signal))
        object.__setattr__(self, "stall_timeout", check_stall_timeout(self.stall_timeout))
        object.__setattr__(self, "async_checkpoint", check_async_checkpoint(self.async_checkpoint))


def check_stall_timeout(value: Any) -> Literal["auto"] | float | None:
    """The validated ``stall_timeout``: ``"auto"``, a positive number of seconds, or ``None`` (off)."""
    if value is None or value is False:
        return None
    if isinstance(value, str) and value == "auto":
        return "auto"
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(
            f"stall_timeout={value!r} must be 'auto' ({AUTO_FACTOR:g} x the slowest recent training step, at least"
            f" {AUTO_FLOOR_S:g} s and at most the collective timeout less a margin), a positive number of"
            " seconds, or None / False (no stall reports)"
        )
    return float(value)


def limit_before_timeout_s(timeout_s: float) -> float:
    """The longest any stall limit may be under a collective timeout of ``timeout_s`` seconds, so that the stall
    report is written and every rank has exited before a waiting collective times out (on NCCL, torch's
    watchdog then ends the process without a report). Zero or less: no room for a stall report."""
    return timeout_s - max(MARGIN_FRACTION * timeout_s, MARGIN_MIN_S)


def check_stall_timeout_fits(stall_timeout: Any, timeout: timedelta | None, where: str = "timeout") -> None:
    """A number given as ``stall_timeout`` must end before the collective ``timeout`` (see
    :func:`limit_before_timeout_s`); ``where`` names where the timeout comes from."""
    if not isinstance(stall_timeout, float) or timeout is None:
        return
    timeout_s = timeout.total_seconds()
    limit = limit_before_timeout_s(timeout_s)
    if stall_timeout <= limit:
        return
    needed = max(stall_timeout + MARGIN_MIN_S, stall_timeout / (1 - MARGIN_FRACTION))
    fix = f"stall_timeout={limit:g} or less, or " if limit > 0 else ""
    raise ValueError(
        f"stall_timeout={stall_timeout:g} s does not end before the collective {where} ({timeout_s:g} s) less the"
        f" time a stall report needs ({timeout_s - limit:g} s): a stall must be reported before a waiting"
        " collective times out (on NCCL, torch's watchdog ends the process at the timeout, without a report)."
        f" Pass {fix}timeout=timedelta(seconds={math.ceil(needed)}) or more, or stall_timeout=None"
    )


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
