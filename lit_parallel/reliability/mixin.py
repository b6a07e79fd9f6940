"""ReliabilityMixin: the reliability features every lit_parallel strategy adds to Lightning's."""

from __future__ import annotations

import collections
import contextlib
import os
import re
import signal
import subprocess
import threading
import warnings
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from typing_extensions import override

from lit_parallel.reliability.checkpoints import _CheckpointReliability
from lit_parallel.reliability.groups import _OWNED_GROUPS, _RETRY, _RUNS, _set_timeout_on_all_groups
from lit_parallel.reliability.launcher import _watch_launching_process, _WatchedSubprocessScriptLauncher
from lit_parallel.reliability.options import (
    DebugLevel,
    PreemptionSignal,
    ReliabilityOptions,
    _info,
    _stderr,
    log,
)
from lit_parallel.reliability.reports import _classify, _first_line, _Progress, _Reporter
from lit_parallel.reliability.resume import _MidEpochResume
from lit_parallel.rng import restore_rng_state

if TYPE_CHECKING:
    import lightning.pytorch as pl


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


class ReliabilityMixin(_CheckpointReliability, _MidEpochResume):
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
