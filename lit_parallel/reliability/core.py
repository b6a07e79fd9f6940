"""The :class:`Reliability` object each lit_parallel strategy holds as ``strategy.reliability``: the options,
and the state of one run (progress, failure reporter, preemption, RNG states at resume, process-group
ownership). Strategies call it from their own hooks, one line each; the training-loop side is
:class:`~lit_parallel.reliability.callback.ReliabilityCallback`."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lit_parallel.reliability import groups, launcher
from lit_parallel.reliability.checkpoints import ReliableCheckpointIO
from lit_parallel.reliability.launcher import watch_launcher
from lit_parallel.reliability.options import DebugLevel, PreemptionSignal, ReliabilityOptions, _stderr
from lit_parallel.reliability.preemption import Preemption
from lit_parallel.reliability.reports import _classify, _first_line, _main_thread_frames, _Progress, _Reporter
from lit_parallel.reliability.resume import resume_mid_epoch
from lit_parallel.reliability.signals import CHILD_WAIT_S, SignalExit
from lit_parallel.reliability.stall import StallClock, StallWatchdog
from lit_parallel.rng import restore_rng_state

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import Strategy


def trainer_of(strategy: Strategy) -> pl.Trainer | None:
    """The Trainer the strategy's module is attached to, if any."""
    module = strategy.lightning_module
    if module is None:
        return None
    try:
        return module.trainer
    except RuntimeError:  # not attached
        return None


class Reliability:
    """One strategy's reliability features (see :mod:`lit_parallel.reliability`)."""

    def __init__(self, options: ReliabilityOptions, timeout: timedelta | None) -> None:
        self.options = options
        self.timeout = timeout
        # an explicit timeout also applies to a process group that exists before the strategy
        self.timeout_given = timeout is not default_pg_timeout and timeout is not None
        self.owns_process_group = False
        self.progress = _Progress()
        self.clock = StallClock()
        self.reporter: _Reporter | None = None
        self.stall: StallWatchdog | None = None
        self.signals: SignalExit | None = None
        self.retired_signals: SignalExit | None = None
        self.preemption: Preemption | None = None
        self.retired_preemption: Preemption | None = None
        self.rng_at_resume: dict | None = None  # applied when Lightning's restore ends
        self.rng_restored: dict | None = None  # kept for a mid-epoch resume
        self.rng_at_first_batch: dict | None = None
        self._failed = False
        self._previous_debug_level: Any = None

    @classmethod
    def from_arguments(
        cls,
        *,
        debug_level: DebugLevel | None,
        watchdog: bool,
        preemption_signal: PreemptionSignal,
        timeout: timedelta | None,
        stall_timeout: Any = "auto",
    ) -> Reliability:
        """From the reliability arguments every strategy takes (validated here, when the strategy is built)."""
        options = ReliabilityOptions(
            debug_level=debug_level,
            watchdog=watchdog,
            preemption_signal=preemption_signal,
            stall_timeout=stall_timeout,
        )
        return cls(options, timeout)

    @property
    def debug_level(self) -> DebugLevel | None:
        return self.options.debug_level

    @property
    def watchdog(self) -> bool:
        return self.options.watchdog

    @property
    def preemption_signal(self) -> Any:
        return self.options.preemption_signal

    # --- called from the strategy's hooks ------------------------------------------------------------------

    def configure_launcher(self, strategy: Strategy) -> None:
        """After Lightning configured the strategy's launcher: add the watchdog."""
        if self.watchdog:
            watch_launcher(strategy)

    def setup_process_group(self, strategy: Strategy, setup: Callable[[], None]) -> None:
        """Around Lightning's process-group set-up ``setup``: the debug level before the group exists, then
        ownership, timeouts, the failure reporter, the preemption handler, the stall watchdog, the signal
        handling, the launcher's watchdog threads and the callback."""
        if not isinstance(strategy.checkpoint_io, ReliableCheckpointIO):
            strategy.checkpoint_io = ReliableCheckpointIO(strategy.checkpoint_io, self, strategy.broadcast)
        existed = dist.is_available() and dist.is_initialized()
        self._set_debug_level(existed)
        self.owns_process_group = not existed
        if not existed:
            groups.init_process_group(strategy, self.timeout)
        setup()
        if self.owns_process_group:
            groups.own_default_group()
        self.apply_timeout()
        self._start_reporter()
        if self.preemption is None:
            self.preemption = Preemption.for_environment(self.preemption_signal, strategy.cluster_environment)
            if self.preemption is not None:
                self.preemption.install()
        self._start_stall_watchdog()
        self._install_signal_exit()
        if self.watchdog:
            launcher.resume_watching()
        trainer = trainer_of(strategy)
        if trainer is not None:
            from lit_parallel.reliability.callback import ReliabilityCallback

            if not any(isinstance(c, ReliabilityCallback) for c in trainer.callbacks):
                trainer.callbacks.append(ReliabilityCallback())

    def _set_debug_level(self, existed: bool) -> None:
        level = self.debug_level
        if level is None:
            return
        self._previous_debug_level = dist.get_debug_level()
        dist.set_debug_level(getattr(dist.DebugLevel, level.upper()))
        if existed and level == "detail" and rank_zero_only.rank == 0:
            warnings.warn(
                "debug_level='detail': the default process group existed before the strategy, so only"
                " process groups created from now on (the device mesh's) check collectives; set"
                " TORCH_DISTRIBUTED_DEBUG=DETAIL in the launch environment to check the default group too",
                stacklevel=4,
            )

    def apply_timeout(self) -> None:
        """The strategy's timeout on every process group it uses (call again after creating a mesh)."""
        if not (dist.is_available() and dist.is_initialized()):
            return
        if self.timeout is not None and (self.owns_process_group or self.timeout_given):
            groups.set_timeout_on_all_groups(self.timeout)

    def _start_reporter(self) -> None:
        if self.reporter is not None or not dist.is_initialized() or dist.get_world_size() == 1:
            return
        store = groups.default_store()
        if store is None:
            return
        prefix = f"lit_parallel/run{next(groups._RUNS)}"
        self.reporter = _Reporter(store, prefix, dist.get_rank(), dist.get_world_size(), self.progress)
        self.reporter.start()

    def _start_stall_watchdog(self) -> None:
        """One thread per rank, on the reporter's store (see :mod:`~lit_parallel.reliability.stall`)."""
        self.clock = StallClock()
        setting = self.options.stall_timeout
        if self.reporter is None or self.stall is not None or setting is None:
            return
        reporter = self.reporter

        def describe() -> dict:
            return {**self.progress.as_dict(), "rank": reporter.rank, "frames": _main_thread_frames()}

        self.stall = StallWatchdog(
            reporter.store,
            f"{reporter.prefix}/stall",
            reporter.rank,
            reporter.world_size,
            self.clock,
            setting,
            describe,
            on_end=lambda code: launcher.stop_children(None, CHILD_WAIT_S),
        )
        self.stall.start()

    def _install_signal_exit(self) -> None:
        """SIGINT / SIGTERM end every rank with 128 + N (see :mod:`~lit_parallel.reliability.signals`)."""
        if self.signals is not None or not dist.is_initialized() or dist.get_world_size() == 1:
            return
        skip = self.preemption.signum if self.preemption is not None else None
        self.signals = SignalExit(dist.get_rank(), launcher.stop_children, skip=skip)
        if not self.signals.install():
            self.signals = None

    def after_barrier(self, name: str | None) -> None:
        if name == "_CheckpointConnector.resume_end" and self.rng_at_resume is not None:
            # the last point before the fit loop creates the epoch's dataloader iterator (which draws from the
            # RNG, as it does after the checkpoint in an uninterrupted run)
            restore_rng_state(self.rng_at_resume)
            self.rng_restored, self.rng_at_resume = self.rng_at_resume, None

    def process_dataloader(self, strategy: Strategy, dataloader: Any) -> Any:
        """The first training dataloader after a mid-epoch checkpoint skips what the epoch already used."""
        from lightning.pytorch.trainer.states import RunningStage, TrainerFn

        trainer = trainer_of(strategy)
        if (
            trainer is not None
            and trainer.state.fn == TrainerFn.FITTING
            and trainer.state.stage == RunningStage.TRAINING
        ):
            resume_mid_epoch(self, trainer, dataloader)
        return dataloader

    def on_exception(self, exception: BaseException, rank: int) -> None:
        """Print this rank's failure report (with the other ranks' positions) and append it to the error."""
        self._failed = True
        if self.reporter is None:
            text = f"lit_parallel: rank {rank} failed in {self.progress.describe()}: {_first_line(exception)}"
        else:
            timeout = self.timeout if (self.owns_process_group or self.timeout_given) else None
            try:
                text = self.reporter.report(exception, _classify(exception), timeout)
            except Exception as err:  # a report must never hide the original error
                text = f"lit_parallel: rank {rank} failed: {_first_line(exception)} (report: {err})"
        gone = launcher.launching_process_gone()
        if gone is not None:
            text += f"\n  {gone}"
        _stderr(text)
        rest = text.partition("\n")[2]
        if (
            exception.args
            and isinstance(exception.args[0], str)
            and "lit_parallel: rank" not in exception.args[0]
        ):
            # the error is right above: keep only where it happened and what the other ranks were doing
            short = f"lit_parallel: rank {rank} failed in {self.progress.describe()}"
            exception.args = (
                f"{exception.args[0]}\n\n{short}" + (f"\n{rest}" if rest else ""),
                *exception.args[1:],
            )

    def teardown(self) -> None:
        """After Lightning's teardown: stop the reporter, retire the signal handler, and destroy a process
        group the strategy created if the run failed."""
        if self.stall is not None:
            self.stall.stop()
            self.stall = None
        if self.reporter is not None:
            self.reporter.stop()
            self.reporter = None
        if self.signals is not None:
            self.signals.uninstall()
            self.retired_signals, self.signals = self.signals, None
        launcher.stop_watching()
        if self.preemption is not None:
            self.preemption.uninstall()
            self.retired_preemption, self.preemption = self.preemption, None
        self.rng_at_resume = self.rng_restored = self.rng_at_first_batch = None
        if self._failed and self.owns_process_group and dist.is_initialized():
            groups.destroy_after_failure()
        if self._previous_debug_level is not None:
            dist.set_debug_level(self._previous_debug_level)
            self._previous_debug_level = None
        self._failed = False
