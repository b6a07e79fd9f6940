"""TunedDDPStrategy ("ddp_tuned"): Lightning's DDP with decisions measured instead of guessed."""

from __future__ import annotations

import dataclasses
import gc
import inspect
import warnings
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lit_parallel import _compat
from lit_parallel._logging import info
from lit_parallel.parallel.ddp.buckets import (
    AllReduceMeasurement,
    BucketPlan,
    MiB,
    broadcast_measurement,
    choose_bucket_sizes,
    gradient_bytes_in_ready_order,
    measure_allreduce,
    needs_single_bucket,
    single_bucket_plan,
)
from lit_parallel.parallel.ddp.comm_hooks import build_comm_hook, validate_comm_hook
from lit_parallel.reliability import DebugLevel, PreemptionSignal
from lit_parallel.reliability.async_checkpoints import AsyncCheckpoint
from lit_parallel.reliability.resume import install_auto_resume
from lit_parallel.reliability.stall import StallTimeout
from lit_parallel.strategies.arguments import CommonArguments, check_bool
from lit_parallel.strategies.ddp_arguments import DYNAMO_MIN_CAP, check_arguments
from lit_parallel.strategies.reliable import ReliableTrainingMixin

_UNUSED_FIX = (
    "TunedDDPStrategy's first training step (its probe) used every parameter, so DDP runs with"
    " find_unused_parameters=False; on this step some parameter received no gradient (a branch used only on"
    " some steps). Fix: pass TunedDDPStrategy(find_unused_parameters=True)"
    " (or strategy='ddp_tuned_find_unused_parameters_true')."
)


def _check_and_prepare_arguments(
    tuning: dict[str, Any], broadcast_buffers: bool | None, start_method: Any, ddp_kwargs: dict[str, Any]
) -> None:
    """TunedDDPStrategy's own arguments, checked when it is built (``tuning``: its DDP options by argument
    name). The deprecated ``broadcast_buffers`` is mapped onto ``tuning["forward_sync_buffers"]``; a bool
    ``find_unused_parameters`` goes into ``ddp_kwargs``."""
    checked = {name: value for name, value in tuning.items() if name != "gradient_as_bucket_view"}
    tuning["forward_sync_buffers"] = check_arguments(
        **checked,
        broadcast_buffers=broadcast_buffers,
        start_method=start_method,
        ddp_kwargs=ddp_kwargs,
        own_names=inspect.signature(TunedDDPStrategy.__init__).parameters,
    )
    check_bool("gradient_as_bucket_view", tuning["gradient_as_bucket_view"])
    if isinstance(tuning["find_unused_parameters"], bool):  # where Lightning's DDPStrategy keeps it
        ddp_kwargs["find_unused_parameters"] = tuning["find_unused_parameters"]


class TunedDDPStrategy(ReliableTrainingMixin, DDPStrategy):
    """DDP with measured bucket sizes, probed unused-parameter detection and gradient compression.

    A subclass of Lightning's ``DDPStrategy``: launcher, checkpointing and precision handling are
    Lightning's. Decisions are logged on rank 0 (logger ``lit_parallel``) and kept on the strategy
    (``bucket_plan``, ``allreduce_measurement``, ``unused_parameters``).

    Args:
        bucket_cap_mb: ``"auto"`` (default) measures all-reduce latency and bandwidth at start-up and
            chooses a small first bucket and larger later ones (:func:`~lit_parallel.parallel.choose_bucket_sizes`;
            rank 0's measurement decides for every rank). A number (MiB) or a list of per-bucket MiB
            (the last one repeats) overrides; note that an explicit number turns off DDP's small first
            bucket.
        gradient_as_bucket_view: gradients are views into the communication buckets (saves one copy
            and the memory of one gradient set). Default ``True``.
        find_unused_parameters: ``"auto"`` (default) makes the first optimizer step the probe: the model
            is DDP-wrapped as usual (``trainer.model`` is the ``DistributedDataParallel`` module from
            ``on_fit_start`` on), with DDP's own unused-parameter detection on for that step (DDP averages
            the gradients as always, in its buckets: no extra memory), and the parameters DDP left without
            a gradient (none on any rank) decide. No extra forward or backward is run, so parameters,
            buffers, optimizer, metrics and RNG states evolve exactly as with a fixed setting. If some
            trainable parameter is unused, the names are logged and that wrapper stays; if every one is used,
            a new DDP wrapper of the same module with ``find_unused_parameters=False`` replaces it after the
            probe's optimizer step (the old wrapper and the step's gradients are released first, as the
            next ``zero_grad`` would, so two sets of buckets never coexist). ``True``/``False`` override. The probe cannot see parameters used only on some
            steps: such a model fails with an error that names the fix (``find_unused_parameters=True``).
            Manual optimization and ``static_graph=True`` (which finds unused parameters itself) skip the
            probe (``False``).
        static_graph: DDP's static-graph mode (explicit opt-in). Refused with
            ``accumulate_grad_batches > 1``, where DDP's reducer hits an internal assert.
        comm_hook: ``None`` (DDP's built-in all-reduce), ``"allreduce"`` (the same in Python, which lets
            :func:`~lit_parallel.parallel.count_collectives` see it), ``"fp16"`` (gradients sent in
            half precision, any backend), ``"bf16"`` (NCCL/XCCL only; refused on gloo) or ``"powersgd"``
            (low-rank compression; on gloo, which cannot run it with several buckets, all gradients go in
            one bucket and the log says so).
        powersgd_rank: rank of PowerSGD's low-rank approximation.
        powersgd_warmup_steps: optimizer steps of plain all-reduce before compression starts (>= 2).
        compile: ``False``, ``True`` or a dict of ``torch.compile`` options (e.g. ``{"backend":
            "aot_eager"}``). Each top-level submodule of the LightningModule that has parameters
            (typically ``self.model``) is compiled in place (``nn.Module.compile``) *before* DDP wraps
            the model, so the compiled graph cannot swallow DDP's gradient hooks. Call those submodules
            from ``training_step``; compilation is undone at teardown.
        forward_sync_buffers: broadcast rank 0's buffers (BatchNorm statistics) before each forward
            (DDP's default, ``True``). Turn it off only when every rank should keep its own buffers, e.g.
            fine-tuning BatchNorm per rank, or when a synchronized BatchNorm already keeps them equal.
        broadcast_buffers: deprecated in torch 2.13; mapped to ``forward_sync_buffers``.
        timeout: timeout of every collective (also applied to a process group that existed before the
            strategy, e.g. torchrun's, when given explicitly); a rank that times out reports which collective
            timed out, on which ranks, and where the ranks that never arrived are.
        debug_level: ``"detail"`` turns on torch's check that every rank runs the same collective (set before
            the process group is created); ``None`` keeps ``TORCH_DISTRIBUTED_DEBUG``. See
            :class:`~lit_parallel.reliability.ReliabilityOptions`.
        watchdog: under Lightning's own launcher, end every rank when one fails (default ``True``).
        preemption_signal: ``"auto"`` (SLURM's requeue signal under ``SLURMEnvironment``), a signal, or
            ``None``: on the signal, save ``hpc_ckpt_N.ckpt`` at the next optimizer step, requeue, stop.
        stall_timeout: ``"auto"`` (default), seconds, or ``None``: report where every rank is and end the run
            when no rank completes a training step for that long (see ``docs/reference/reliability.md``).
        auto_resume: ``fit`` without ``ckpt_path`` resumes from the newest complete checkpoint in the
            ModelCheckpoint folders and ``default_root_dir`` (an incomplete newer one is skipped and reported);
            for restarts (``torchrun --max-restarts``, a requeued job). Default ``False``.
        async_checkpoint: ``True``: a save holds training only while the state is copied to host memory; the
            write runs in the background, committed only when complete (see
            :mod:`~lit_parallel.reliability.async_checkpoints`). ``"auto"``: in the background when the first
            save took longer than a few training steps. Default ``False``.
        **kwargs: passed to ``torch.nn.parallel.DistributedDataParallel`` (e.g. ``init_sync``,
            ``skip_all_reduce_unused_params``) or to Lightning's ``DDPStrategy`` (``ddp_comm_hook``,
            ``ddp_comm_state``, ``ddp_comm_wrapper``, ``model_averaging_period``). Checked when the strategy is
            built: an unknown name is refused with the closest valid one; the DDP arguments the strategy sets
            itself (``module``, ``device_ids``, ``output_device``, ``process_group``, ``device_mesh``,
            ``bucket_cap_mb_list``) are refused with the reason (``bucket_cap_mb_list=None``, which
            LightningCLI may pass, is ignored).

    Checkpoints hold every rank's RNG states (resume is bitwise exact, dropout included), are written under a
    temporary name and renamed when complete, and load with ``weights_only=True``; see
    :mod:`lit_parallel.reliability`.
    """

    strategy_name = "ddp_tuned"

    def __init__(
        self,
        accelerator=None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        *,
        bucket_cap_mb: Literal["auto"] | float | list[float] = "auto",
        gradient_as_bucket_view: bool = True,
        find_unused_parameters: Literal["auto"] | bool = "auto",
        static_graph: bool = False,
        comm_hook: str | None = None,
        powersgd_rank: int = 1,
        powersgd_warmup_steps: int = 10,
        compile: bool | dict[str, Any] = False,
        forward_sync_buffers: bool | None = None,
        broadcast_buffers: bool | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        debug_level: DebugLevel | None = None,
        watchdog: bool = True,
        preemption_signal: PreemptionSignal = "auto",
        stall_timeout: StallTimeout = "auto",
        auto_resume: bool = False,
        async_checkpoint: AsyncCheckpoint = False,
        **kwargs: Any,
    ) -> None:
        tuning = dict(
            bucket_cap_mb=bucket_cap_mb,
            gradient_as_bucket_view=gradient_as_bucket_view,
            find_unused_parameters=find_unused_parameters,
            static_graph=static_graph,
            comm_hook=comm_hook,
            powersgd_rank=powersgd_rank,
            powersgd_warmup_steps=powersgd_warmup_steps,
            compile=compile,
            forward_sync_buffers=forward_sync_buffers,
        )
        _check_and_prepare_arguments(tuning, broadcast_buffers, start_method, kwargs)
        common = CommonArguments.from_arguments(locals())
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            start_method=start_method,
            **common.process_group_kwargs(),
            **kwargs,
        )
        self._init_common(common)
        self._init_options(tuning)

    def _init_options(self, tuning: dict[str, Any]) -> None:
        """Keeps the checked options (``tuning``: the DDP options by argument name), then starts without
        decisions."""
        self._bucket_cap_mb = tuning["bucket_cap_mb"]
        self._gradient_as_bucket_view = tuning["gradient_as_bucket_view"]
        self._find_unused = tuning["find_unused_parameters"]
        self._static_graph = tuning["static_graph"]
        self._comm_hook = tuning["comm_hook"]
        self._powersgd_rank = tuning["powersgd_rank"]
        self._powersgd_warmup_steps = tuning["powersgd_warmup_steps"]
        self._compile = tuning["compile"]
        self._forward_sync_buffers = tuning["forward_sync_buffers"]
        self._init_decisions()

    def _init_decisions(self) -> None:
        """What the strategy measures and decides during a run (kept afterwards for inspection)."""
        self._probing = False
        self._rewrap_pending = False  # every parameter was used: a wrapper without detection next
        self._compiled_children: list[torch.nn.Module] = []
        self.allreduce_measurement: AllReduceMeasurement | None = None
        self.bucket_plan: BucketPlan | None = None
        self.unused_parameters: list[str] | None = None
        self.comm_hook_state: Any = None

    def _validate_before_launch(self, trainer: Any, model: Any) -> None:
        # Impossible combinations are refused before any process group exists, and under Lightning's
        # launcher before the other ranks are started.
        validate_comm_hook(self._comm_hook, backend=self._get_process_group_backend())
        if self._static_graph and trainer is not None and trainer.accumulate_grad_batches > 1:
            raise ValueError(
                f"static_graph=True with accumulate_grad_batches={trainer.accumulate_grad_batches} hits an"
                " internal assert in DDP's reducer (torch 2.13); use static_graph=False (the default) or"
                " accumulate_grad_batches=1"
            )

    @override
    def setup_environment(self) -> None:
        lm = self.lightning_module
        self._validate_before_launch(_compat.attached_trainer(lm), lm)
        super().setup_environment()
        install_auto_resume(self)

    @override
    def configure_ddp(self) -> None:
        assert self.model is not None
        self._apply_compile(self.model)
        self._choose_buckets(self.model)
        lm = self.lightning_module
        probe = self._find_unused == "auto" and lm is not None and lm.automatic_optimization
        if self._find_unused == "auto" and not probe:
            info("ddp_tuned: manual optimization, so no probe step: find_unused_parameters=False")
        if probe and self._static_graph:
            # DDP's static graph finds the parameters no step uses in its first iteration by itself
            info(
                "ddp_tuned: static_graph=True detects unused parameters itself: find_unused_parameters=False"
            )
            probe = False
        # The model is DDP-wrapped here in every case (Lightning's contract: ``trainer.model`` is the
        # DistributedDataParallel module from ``on_fit_start`` on).
        # The probe: the first optimizer step runs under DDP's own unused-parameter detection, which averages
        # the gradients in DDP's buckets as always and leaves those of parameters no rank used unset; no extra
        # forward or backward runs, and no memory beyond a plain DDP step's.
        self._wrap(find_unused=self._find_unused is True or probe)
        self._probing = probe

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if not self._probing or trainer is None or _compat.should_accumulate(trainer):
            return
        self._probing = False
        named = [(n, p) for n, p in self.lightning_module.named_parameters() if p.requires_grad]
        # DDP (find_unused_parameters=True) set every gradient some rank produced; the same on every rank
        self.unused_parameters = [n for n, p in named if p.grad is None]
        if self.unused_parameters:
            shown = ", ".join(self.unused_parameters[:20])
            if len(self.unused_parameters) > 20:
                shown += f" and {len(self.unused_parameters) - 20} more"
            info(
                f"ddp_tuned: {len(self.unused_parameters)} parameters got no gradient in the first training"
                f" step (e.g. used only in evaluation, or frozen branches): {shown};"
                " running DDP with find_unused_parameters=True"
            )
        else:
            # detection costs a graph traversal per step: a new wrapper without it after this optimizer step
            self._rewrap_pending = True
            info(
                "ddp_tuned: the first training step used every trainable parameter: find_unused_parameters=False"
            )

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._rewrap_if_decided()  # callbacks see the final wrapper from the probe's on_train_batch_end on
        return output

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._rewrap_if_decided()
        super().on_train_batch_start(batch, batch_idx)

    def _rewrap_if_decided(self) -> None:
        if self._rewrap_pending:
            self._rewrap_pending = False
            self._release_wrapper()
            # every rank already holds the same states: no broadcast at construction (it would overwrite
            # per-rank buffers kept with forward_sync_buffers=False)
            self._wrap(find_unused=False, init_sync=False)

    def _release_wrapper(self) -> None:
        """Free the DDP wrapper's buckets before a new one allocates its own: drop the wrapper and the
        gradients (views into its buckets; the optimizer step that needed them is done, and the next
        ``zero_grad`` would drop them). Otherwise old and new buckets coexist: twice the gradient memory."""
        assert isinstance(self.model, DistributedDataParallel)
        module = self.model.module
        for p in module.parameters():
            p.grad = None
        self.model = module
        gc.collect()  # DDP's reducer and its hooks hold references in cycles

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self._probing:
            return super().training_step(*args, **kwargs)
        # DDP's advice to drop find_unused_parameters=True when every parameter is used is what the probe acts
        # on by itself after this step
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*find_unused_parameters=True was specified")
            return super().training_step(*args, **kwargs)

    @override
    def teardown(self) -> None:
        self._undo_compile()
        self._probing = False
        self._rewrap_pending = False
        super().teardown()

    def _apply_compile(self, model: torch.nn.Module) -> None:
        if self._compile is False:
            return
        options = self._compile if isinstance(self._compile, dict) else {}
        # Each top-level submodule with parameters (``self.model``, ``self.encoder``, ...) is compiled in
        # place, before DDP wraps the LightningModule: DDP's gradient hooks stay outside the graphs.
        names = []
        for name, child in model.named_children():
            if any(True for _ in child.parameters()):
                child.compile(**options)
                self._compiled_children.append(child)
                names.append(name)
        info(
            f"ddp_tuned: compiled submodules {names} with {options or 'default options'} before DDP wrapping"
        )

    def _undo_compile(self) -> None:
        for child in self._compiled_children:
            _compat.undo_compile(child)
        self._compiled_children = []

    def _choose_buckets(self, model: torch.nn.Module) -> None:
        grad_bytes = gradient_bytes_in_ready_order(model)
        total = sum(grad_bytes)
        single_bucket = needs_single_bucket(self._comm_hook, self._get_process_group_backend())
        if self._bucket_cap_mb != "auto":
            caps = self._bucket_cap_mb if isinstance(self._bucket_cap_mb, list) else [self._bucket_cap_mb]
            if single_bucket and total > caps[0] * MiB:
                raise ValueError(
                    f"comm_hook='powersgd' on gloo needs all gradients in one bucket ({total / MiB:.3f} MiB),"
                    f" but bucket_cap_mb={self._bucket_cap_mb!r}; use bucket_cap_mb='auto' or at least"
                    f" {total / MiB:.3f}"
                )
            return
        if single_bucket:
            self.bucket_plan = single_bucket_plan(
                total, "comm_hook='powersgd' on gloo crashes with more than one bucket"
            )
        else:
            measured = measure_allreduce(self.root_device)
            self.allreduce_measurement = broadcast_measurement(measured, src=0)
            self.bucket_plan = choose_bucket_sizes(self.allreduce_measurement, grad_bytes)
        if self._compile is not False and self.bucket_plan.rest_bytes < DYNAMO_MIN_CAP:
            self.bucket_plan = dataclasses.replace(
                self.bucket_plan,
                rest_bytes=DYNAMO_MIN_CAP,
                reason=f"{self.bucket_plan.reason}; later buckets raised to 1 MiB for compile (torch's DDP"
                " graph splitter needs the largest cap >= its 1 MiB first bucket)",
            )
        info(f"ddp_tuned: bucket_cap_mb_list={self.bucket_plan.cap_mb_list}: {self.bucket_plan.reason}")

    def _ddp_bucket_kwargs(self) -> dict[str, Any]:
        if self.bucket_plan is not None:
            return {"bucket_cap_mb_list": self.bucket_plan.cap_mb_list}
        if isinstance(self._bucket_cap_mb, list):
            return {"bucket_cap_mb_list": list(self._bucket_cap_mb)}
        return {"bucket_cap_mb": self._bucket_cap_mb}

    def _wrap(self, find_unused: bool, init_sync: bool | None = None) -> None:
        kwargs = dict(self._ddp_kwargs)
        kwargs.update(self._ddp_bucket_kwargs())
        kwargs["gradient_as_bucket_view"] = self._gradient_as_bucket_view
        kwargs["find_unused_parameters"] = find_unused
        kwargs["static_graph"] = self._static_graph
        sync_buffers = self._forward_sync_buffers
        if sync_buffers is not None and _compat.has_feature("ddp_forward_sync_buffers"):
            kwargs["forward_sync_buffers"] = sync_buffers
        self._ddp_kwargs = kwargs
        module = self.model.module if isinstance(self.model, DistributedDataParallel) else self.model
        if init_sync is None:
            self.model = self._setup_model(module)
        else:  # Lightning's _setup_model passes _ddp_kwargs; the override holds for this one wrapper only
            self._ddp_kwargs = {**kwargs, "init_sync": init_sync}
            try:
                self.model = self._setup_model(module)
            finally:
                self._ddp_kwargs = kwargs
        if sync_buffers is not None and not _compat.has_feature("ddp_forward_sync_buffers"):
            _compat.set_forward_sync_buffers(self.model, sync_buffers)  # torch < 2.13
        self._register_ddp_hooks()

    @override
    def _register_ddp_hooks(self) -> None:
        if self._comm_hook is None:
            super()._register_ddp_hooks()
            return
        assert isinstance(self.model, DistributedDataParallel)
        state, hook = build_comm_hook(
            self._comm_hook,
            powersgd_rank=self._powersgd_rank,
            powersgd_warmup_steps=self._powersgd_warmup_steps,
        )
        self.comm_hook_state = state
        self.model.register_comm_hook(state, hook)
        info(f"ddp_tuned: registered communication hook {self._comm_hook!r}")

    @override
    def on_exception(self, exception: BaseException) -> None:
        if any(
            isinstance(arg, str) and "Expected to have finished reduction in the prior iteration" in arg
            for arg in exception.args
        ):
            exception.args = tuple(
                f"{arg}\n\n{_UNUSED_FIX}"
                if isinstance(arg, str) and "Expected to have finished" in arg
                else arg
                for arg in exception.args
            )
        super().on_exception(exception)  # the failure report (ReliableTrainingMixin)

    @override
    def setup_distributed(self) -> None:
        self.reliability.setup_process_group(self, super().setup_distributed)

    @property
    def find_unused_parameters(self) -> bool | None:
        """What DDP runs with (``None`` before the model is wrapped and during the probe step)."""
        if self._probing:
            return None
        if self._rewrap_pending:
            return False
        if isinstance(self.model, DistributedDataParallel):
            return self.model.find_unused_parameters
        return None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="DDP with measured bucket sizes, probed find_unused_parameters and gradient compression",
        )
        for value in (True, False):
            strategy_registry.register(
                f"{cls.strategy_name}_find_unused_parameters_{str(value).lower()}",
                cls,
                description=f"ddp_tuned with find_unused_parameters={value} (no probe)",
                find_unused_parameters=value,
            )
