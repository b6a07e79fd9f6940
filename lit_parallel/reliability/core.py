"""The :class:`Reliability` object each lit_parallel strategy holds as ``strategy.reliability``: the options,
and the state of one run (progress, failure reporter, preemption, RNG states at resume, process-group
ownership). Strategies call it from their own hooks, one line each; the training-loop side is
:class:`ReliabilityCallback`, which the object adds to the strategy's Trainer and which finds it as
``trainer.strategy.reliability``: progress markers, the check that each loss reaches the model, preemption
at optimizer-step boundaries, every rank's RNG states into checkpoints and back."""

from __future__ import annotations

import collections
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lit_parallel import _compat, _logging
from lit_parallel.reliability import groups, launcher
from lit_parallel.reliability.async_checkpoints import SIGNAL_WAIT_S, AsyncCheckpoints, link_after_writes
from lit_parallel.reliability.checkpoints import (
    ReliableCheckpointIO,
    collective_device,
    gather_rng_states,
    refuse_returning_before_written,
    rng_states_to_restore,
)
from lit_parallel.reliability.launcher import report_from_spawned_ranks, watch_launcher
from lit_parallel.reliability.options import (
    AUTO_FLOOR_S,
    RNG_KEY,
    DebugLevel,
    ReliabilityOptions,
    _stderr,
    check_stall_timeout_fits,
    limit_before_timeout_s,
)
from lit_parallel.reliability.preemption import Preemption
from lit_parallel.reliability.reports import (
    _classify,
    _first_line,
    _main_thread_frames,
    _Progress,
    _Reporter,
    _spawned_failure,
)
from lit_parallel.reliability.resume import resume_mid_epoch
from lit_parallel.reliability.signals import CHILD_WAIT_S, SignalExit
from lit_parallel.reliability.stall import StallClock, StallWatchdog
from lit_parallel.rng import restore_rng_state

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import Strategy


def trainer_of(strategy: Strategy) -> pl.Trainer | None:
    """The Trainer the strategy's module is attached to, if any (a module that is not a LightningModule, or
    one attached to something else, has none)."""
    module = strategy.lightning_module
    trainer = _compat.attached_trainer(module) if module is not None else None
    return trainer if isinstance(trainer, Trainer) else None


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
        # asynchronous checkpoints (None: every save is synchronous)
        self.checkpoints: AsyncCheckpoints | None = (
            AsyncCheckpoints(options.async_checkpoint, timeout) if options.async_checkpoint else None
        )

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
        report_from_spawned_ranks(strategy)
        if self.watchdog:
            watch_launcher(strategy)

    def setup_process_group(self, strategy: Strategy, setup: Callable[[], None]) -> None:
        """Around Lightning's process-group set-up ``setup``: the debug level before the group exists, then
        ownership, timeouts, the failure reporter, the preemption handler, the stall watchdog, the signal
        handling, the launcher's watchdog threads and the callback."""
        if not isinstance(strategy.checkpoint_io, ReliableCheckpointIO):
            refuse_returning_before_written(strategy.checkpoint_io)
            strategy.checkpoint_io = ReliableCheckpointIO(
                strategy.checkpoint_io, self.progress, strategy.broadcast, self
            )
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
            if not any(isinstance(c, ReliabilityCallback) for c in trainer.callbacks):
                trainer.callbacks.append(ReliabilityCallback())
            if self.checkpoints is not None:
                for callback in trainer.checkpoint_callbacks:
                    if isinstance(callback, ModelCheckpoint):
                        link_after_writes(self.checkpoints, callback)

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
        """One thread per rank, on the reporter's store (see :mod:`~lit_parallel.reliability.stall`), with every
        limit ending before the shortest collective timeout of this rank's groups (read from the groups: a
        group created before the strategy keeps its own)."""
        self.clock = StallClock()
        setting = self.options.stall_timeout
        if self.reporter is None or self.stall is not None or setting is None:
            return
        reporter = self.reporter
        timeout_s = groups.collective_timeout_s(self.timeout)
        check_stall_timeout_fits(
            setting, timedelta(seconds=timeout_s), "timeout of this rank's process groups"
        )
        limit_s = limit_before_timeout_s(timeout_s)
        if setting == "auto" and limit_s < AUTO_FLOOR_S:
            _logging.info(
                f"stall_timeout='auto' is off: the collective timeout ({timeout_s:g} s) leaves"
                f" {max(limit_s, 0.0):g} s before it, less than the automatic stall limit's floor"
                f" ({AUTO_FLOOR_S:g} s); a hang is reported when the collective times out. Pass a number"
                f" (at most {max(limit_s, 0.0):g} s) to have stall reports"
            )
            return

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
            limit_s=limit_s,
        )
        self.stall.start()

    def _install_signal_exit(self) -> None:
        """SIGINT / SIGTERM end every rank with 128 + N (see :mod:`~lit_parallel.reliability.signals`)."""
        if self.signals is not None or not dist.is_initialized() or dist.get_world_size() == 1:
            return
        skip = self.preemption.signum if self.preemption is not None else None
        # the exit aborts the communicators first: NCCL peers fail at once instead of waiting out the timeout
        checkpoints = self.checkpoints
        self.signals = SignalExit(
            dist.get_rank(),
            launcher.stop_children,
            skip=skip,
            exit_with=groups.exit_process,
            before_exit=checkpoints.wait_on_signal if checkpoints is not None else None,
            extra_wait_s=SIGNAL_WAIT_S if checkpoints is not None else 0.0,
        )
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
        if self.checkpoints is not None:
            self.checkpoints.failed_run = True
        spawned = _spawned_failure(exception, rank)
        if spawned is not None:
            # this process is ddp_spawn's launching process, no rank: name the rank that failed
            _stderr(spawned)
            return
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

    def finish_checkpoints(self) -> None:
        """Before Lightning's teardown: every pending background write finished (a failed one is raised)."""
        if self.checkpoints is not None:
            self.checkpoints.finish()

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


# --- the training-loop side ------------------------------------------------------------------------------


def _reliability(trainer: pl.Trainer) -> Reliability | None:
    found = getattr(trainer.strategy, "reliability", None)
    return found if isinstance(found, Reliability) else None


class ReliabilityCallback(Callback):
    """Progress markers for failure and stall reports, the check that a loss reaches the model, preemption at
    optimizer-step boundaries, and every rank's RNG states in checkpoints."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        r = _reliability(trainer)
        if r is None:
            return
        p = r.progress
        p.batch, p.epoch = batch_idx, trainer.current_epoch
        p.at("training_step")
        if r.rng_at_first_batch is not None:
            # mid-epoch resume: the dataloader's iterator drew from the RNG after the checkpoint's state was
            # restored; an uninterrupted run drew at the start of the epoch, before the checkpoint
            restore_rng_state(r.rng_at_first_batch)
            r.rng_at_first_batch = None
        r.clock.step_begins()

    def on_before_backward(self, trainer, pl_module, loss: torch.Tensor) -> None:
        r = _reliability(trainer)
        if r is None:
            return
        if trainer.world_size > 1 and not _reaches_a_parameter(loss):
            # backward would run without touching the model, so this rank would skip the gradient collectives
            # the other ranks wait in: a silent deadlock. Cheap to detect here.
            raise RuntimeError(
                f"rank {trainer.global_rank}: the loss of training batch {r.progress.batch} (epoch"
                f" {r.progress.epoch}) was not computed from the model's parameters, so its backward would skip"
                " the gradient collectives the other ranks wait in. Every rank must backpropagate through the"
                " model on every batch; to drop a batch's contribution on some ranks, return `loss * 0.0`"
                " instead of a new tensor."
            )
        r.progress.at("backward")

    def on_after_backward(self, trainer, pl_module) -> None:
        r = _reliability(trainer)
        if r is not None:
            r.progress.backward_calls += 1
            r.progress.at("after backward (gradient clipping, optimizer step)")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        r = _reliability(trainer)
        if r is not None:
            r.progress.optimizer_steps += 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        r = _reliability(trainer)
        if r is None:
            return
        r.clock.step_ends()
        r.progress.at(
            f"after training batch {batch_idx} (epoch {trainer.current_epoch}): callbacks, loading the next batch"
        )
        if r.checkpoints is not None:
            r.checkpoints.raise_failure()  # a background write that failed ends the run, as a failed save does
        if r.preemption is not None and not _compat.should_accumulate(trainer):
            r.preemption.check(trainer, r.progress.batch)

    def on_validation_start(self, trainer, pl_module) -> None:
        r = _reliability(trainer)
        if r is not None:
            r.clock.pause("validation")

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        r = _reliability(trainer)
        if r is not None:
            r.progress.at("validation_step")

    def on_test_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        r = _reliability(trainer)
        if r is not None:
            r.progress.at(f"test_step of test batch {batch_idx}")

    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        r = _reliability(trainer)
        if r is not None:
            r.progress.at(f"predict_step of predict batch {batch_idx}")

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        r = _reliability(trainer)
        if r is not None:
            r.progress.at(f"end of epoch {trainer.current_epoch}")

    def on_train_end(self, trainer, pl_module) -> None:
        # Lightning calls the callbacks' on_train_end before the module's
        r = _reliability(trainer)
        if r is not None:
            r.progress.at("on_train_end")

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        # runs on every rank (Lightning builds the checkpoint on each), so the states can be gathered here
        r = _reliability(trainer)
        if r is None:
            return
        r.progress.saving()
        r.clock.pause("saving a checkpoint")
        states = gather_rng_states(collective_device(trainer.strategy.root_device))
        if states is not None:
            checkpoint[RNG_KEY] = {"world_size": len(states), "ranks": states}

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        r = _reliability(trainer)
        if r is None or trainer.state.fn != TrainerFn.FITTING:
            return  # evaluation keeps the RNG the user seeded
        state = rng_states_to_restore(checkpoint, trainer.world_size, trainer.global_rank)
        if state is not None:
            r.rng_at_resume = state  # applied when Lightning's restore ends (see Reliability.after_barrier)

    def teardown(self, trainer, pl_module, stage) -> None:
        # Lightning's signal connector puts back the handlers it found (ours) after the strategy's teardown
        r = _reliability(trainer)
        if r is not None and r.retired_preemption is not None:
            r.retired_preemption.uninstall()
            r.retired_preemption = None
        if r is not None and r.retired_signals is not None:
            r.retired_signals.uninstall_retired()
            r.retired_signals = None


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
