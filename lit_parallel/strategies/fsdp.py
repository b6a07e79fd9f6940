"""TransformerFSDPStrategy ("fsdp_blocks"): FSDP2 per transformer block, blocks found automatically.

A thin shell over :func:`lit_parallel.parallel.parallelize`. It builds on Lightning's
``ModelParallelStrategy`` (launcher, process group, distributed checkpoints) and changes what that
strategy leaves to the user: no ``configure_model`` is required (the strategy shards the model itself),
the mesh comes from :class:`~lit_parallel.parallel.ParallelDims`, the sampler spans every data-parallel
rank, gradient accumulation skips the reduce-scatter on non-final micro-batches, gradient clipping works
on sharded (DTensor) gradients, and the Trainer's ``precision`` flag maps onto FSDP2's mixed-precision
policy (autocast stays off, so exactly one of them casts).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch.distributed.fsdp import FSDPModule
from typing_extensions import override

from lit_parallel import _compat
from lit_parallel._compat import optimizers_to_device, set_device_mesh
from lit_parallel._logging import debug, info
from lit_parallel.parallel.blocks import BlockPlan, find_transformer_blocks
from lit_parallel.parallel.expert_parallel import (
    ExpertParallelPlan,
    plan_expert_parallel,
)
from lit_parallel.parallel.fsdp import (
    FSDPPlan,
    load_full_state_dict,
    no_gradient_sync,
    offload_policy,
    plan_fsdp,
)
from lit_parallel.parallel.mesh import ParallelDims
from lit_parallel.parallel.parallelize import ParallelizeConfig, parallelize
from lit_parallel.plugins.precision.fsdp import FSDPHalfPrecision, FSDPPrecision, fsdp_precision
from lit_parallel.reliability import DebugLevel, PreemptionSignal
from lit_parallel.reliability.async_checkpoints import AsyncCheckpoint
from lit_parallel.reliability.checkpoints import load_sharded_checkpoint, save_sharded_checkpoint
from lit_parallel.reliability.resume import install_auto_resume
from lit_parallel.reliability.stall import StallTimeout
from lit_parallel.strategies.arguments import (
    CommonArguments,
    check_bool,
    check_expert_arguments,
    check_optional_path,
    checked_argument_names,
)
from lit_parallel.strategies.reliable import ReliableTrainingMixin

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.fsdp import MixedPrecisionPolicy

# LightningModule methods that run the model: FSDP gathers the root group's parameters around them.
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


# What a rank reading a parameter outside its module's forward gets: its shard, empty on some ranks
_SHARD_READ_FIX = (
    "A parameter read outside its module's forward (self.layer.weight.item() in test_step, say) is this"
    " rank's shard under FSDP (a DTensor; empty on ranks that hold none of it): the strategies shard every"
    " module's parameters and gather them only while that module runs. Read the whole value with"
    " param.full_tensor() (a collective: call it on every rank), or read it inside the module's forward."
)


def with_shard_read_hint(exception: BaseException) -> None:
    """Add :data:`_SHARD_READ_FIX` to the error a scalar read of an empty shard raises."""
    if any(isinstance(a, str) and "_local_scalar_dense: Empty tensor" in a for a in exception.args):
        exception.args = tuple(
            f"{a}\n\n{_SHARD_READ_FIX}" if isinstance(a, str) and "_local_scalar_dense" in a else a
            for a in exception.args
        )


def _refuse_fsdp1(model: nn.Module, strategy: str) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise TypeError(
            f"{strategy} applies FSDP2 itself; the model already contains FSDP1"
            " (FullyShardedDataParallel) wrappers. Remove them from configure_model."
        )


class TransformerFSDPStrategy(ReliableTrainingMixin, ModelParallelStrategy):
    """FSDP2 applied to each transformer block, then to the rest of the model; no wrap policy needed.

    Args:
        block_types: ``"auto"`` (default): repeated sibling modules of one class that hold most of the
            parameters (see :func:`~lit_parallel.parallel.find_transformer_blocks`). Or a set of classes,
            class names (``{"GPTBlock"}``, handy in YAML) or import paths, or a predicate
            ``fn(module) -> bool``.
        reshard_after_forward: ``True`` (default, ZeRO-3): free each block's gathered parameters after
            forward and gather them again in backward; the root group (the parameters outside blocks) stays
            gathered from forward into backward, which needs it first (torch's choice for the root: one
            all-gather less, the same peak). ``False`` (ZeRO-2): keep every group gathered until backward
            ends (one all-gather per step instead of two, more memory).
        mixed_precision: an explicit ``torch.distributed.fsdp.MixedPrecisionPolicy``. Normally leave it
            ``None`` and use the Trainer's ``precision``: ``"32-true"`` (no casting), ``"bf16-mixed"``
            (FSDP computes and all-gathers in bf16 and reduces gradients in fp32; Lightning's autocast is
            turned off so only FSDP casts), ``"bf16-true"`` / ``"16-true"`` (parameters stored in half
            precision). A policy combined with ``"bf16-true"`` / ``"16-true"``, or with ``"bf16-mixed"``
            but another compute dtype, is refused as conflicting.
        activation_checkpointing: recompute each block's activations in backward.
        compile: ``torch.compile`` each block after activation checkpointing and before sharding;
            ``True`` or a dict of ``torch.compile`` arguments (``{"backend": "aot_eager"}``).
        cpu_offload: FSDP2's ``CPUOffloadPolicy`` (parameters, gradients and optimizer step on the CPU).
            On a CPU-only run everything is already in CPU memory: accepted as a no-op with a warning.
        init_from: a full ``state_dict`` file (keys of the LightningModule) loaded into the sharded model
            after setup: rank 0 reads it, the other ranks receive their shards. Combine with a model built
            on the meta device in ``configure_model`` so no rank ever holds the whole model.
        expert_parallel_size: split every MoE layer's experts over this many ranks (1 = off), borrowed from the
            data-parallel ranks (it must divide their number and every layer's number of experts). MoE
            layers are found automatically: stacked expert weights (transformers 5's ``*Experts``) and
            ``nn.ModuleList``s of experts next to a router. Tokens travel to their experts' ranks and back by
            all-to-all; the experts are FSDP-sharded over the ranks holding the same ones; everything else is
            as without it. Exact against one process. See ``docs/reference/strategies/expert_parallel.md``.
        expert_capacity_factor: ``None`` (default): no token is dropped. A number ``c``: each expert takes at
            most ``ceil(c * pairs / experts)`` of a rank's (token, expert) pairs per layer; the rest add zero
            and are counted (``strategy.expert_plan.stats.dropped``).
        save_distributed_checkpoint: ``True`` (default): one shard per rank
            (``torch.distributed.checkpoint``, loadable on any number of ranks; convert with
            ``lit-parallel consolidate``). ``False``: one full file written by rank 0.
        process_group_backend: ``"gloo"``, ``"nccl"``, ... (default: chosen from the device).
        timeout: timeout of every collective, on every process group of the mesh (torch gives sub-groups a
            30-minute default otherwise; also applied to a process group that existed before the strategy when
            given explicitly). A rank that times out reports which collective timed out, on which ranks, and
            where the ranks that never arrived are.
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

    Checkpoints hold every rank's RNG states (resume is bitwise exact, dropout included), are written under a
    temporary name and renamed into place when complete (DCP's ``.metadata`` written last), and load without
    unpickling code; a mid-epoch checkpoint continues with the next unseen batch or is refused. See
    :mod:`lit_parallel.reliability`.

    The plan (block classes, number of blocks, parameters per block, estimated bytes per rank) is logged
    on rank 0 and kept as ``strategy.plan``; :func:`~lit_parallel.parallel.plan_fsdp` computes the same
    without a Trainer. Meshes use Lightning's dimension names; ``self.device_mesh`` works in the module.
    """

    strategy_name = "fsdp_blocks"

    @checked_argument_names
    def __init__(
        self,
        block_types: str | Iterable[type | str] | Callable[[nn.Module], bool] = "auto",
        reshard_after_forward: bool = True,
        mixed_precision: MixedPrecisionPolicy | None = None,
        activation_checkpointing: bool = False,
        compile: bool | Mapping[str, Any] = False,
        cpu_offload: bool = False,
        init_from: str | Path | None = None,
        save_distributed_checkpoint: bool = True,
        expert_parallel_size: int = 1,
        expert_capacity_factor: float | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        debug_level: DebugLevel | None = None,
        watchdog: bool = True,
        preemption_signal: PreemptionSignal = "auto",
        stall_timeout: StallTimeout = "auto",
        auto_resume: bool = False,
        async_checkpoint: AsyncCheckpoint = False,
    ) -> None:
        _check_arguments(
            block_types=block_types,
            reshard_after_forward=reshard_after_forward,
            mixed_precision=mixed_precision,
            activation_checkpointing=activation_checkpointing,
            compile=compile,
            cpu_offload=cpu_offload,
            init_from=init_from,
            save_distributed_checkpoint=save_distributed_checkpoint,
        )
        check_expert_arguments(expert_parallel_size, expert_capacity_factor)
        common = CommonArguments.from_arguments(locals())
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            **common.process_group_kwargs(),
        )
        self._init_common(common)
        self._block_types = block_types
        self._reshard_after_forward = reshard_after_forward
        self._user_mixed_precision = mixed_precision
        self._activation_checkpointing = activation_checkpointing
        self._compile = compile
        self._cpu_offload = cpu_offload
        self._init_from = init_from
        self._ep_size = expert_parallel_size
        self._capacity_factor = expert_capacity_factor
        self.expert_plan: ExpertParallelPlan | None = None
        self._mp_policy: MixedPrecisionPolicy | None = None
        self._dims: ParallelDims | None = None
        self.plan: FSDPPlan | None = None

    # --- configuration, checked before any process exists -----------------------------------------------

    def _parallel_dims(self) -> ParallelDims:
        return ParallelDims.for_fsdp(self.num_nodes * self.num_processes, expert_parallel=self._ep_size)

    def _validate(self) -> None:
        """Sizes and precision; runs in the Trainer's constructor (before launching) and again at setup."""
        self._dims = self._parallel_dims()
        self._resolve_precision()
        if self._init_from is not None and self.global_rank == 0 and not Path(self._init_from).is_file():
            raise FileNotFoundError(
                f"init_from={str(self._init_from)!r} is not a file; pass the path of a full state_dict saved"
                " with torch.save (e.g. the output of `lit-parallel consolidate`)"
            )

    def _resolve_precision(self) -> None:
        if isinstance(self._precision_plugin, (FSDPPrecision, FSDPHalfPrecision)):
            return  # resolved by an earlier check (the Trainer's constructor)
        self._precision_plugin, self._mp_policy = fsdp_precision(
            self._precision_plugin, self._user_mixed_precision, type(self).__name__
        )

    @override
    def _configure_launcher(self) -> None:
        self._validate()
        super()._configure_launcher()

    def _validate_before_launch(self, trainer: pl.Trainer | None, model: pl.LightningModule | None) -> None:
        # Under Lightning's launcher: before the other ranks are started. connect() runs the model checks
        # (block discovery here; the tensor-parallel plan in tp_dp); Lightning connects again after launching.
        self._validate()
        if model is not None:
            self.connect(model)

    def _check_blocks(self, model: pl.LightningModule) -> None:
        # Without configure_model the model is complete now: find the blocks before any process group
        # exists, so a wrong block_types fails fast.
        if not is_overridden("configure_model", model) and any(True for _ in model.parameters()):
            find_transformer_blocks(model, self._block_types)
            self._plan_experts(model)

    def _plan_experts(self, model: nn.Module) -> ExpertParallelPlan | None:
        """The MoE layers and their split (``expert_parallel_size > 1``), checked against the model."""
        if self._ep_size == 1:
            return None
        plan = plan_expert_parallel(model, self._ep_size, capacity_factor=self._capacity_factor)
        lists = [layer.path for layer in plan.layers if layer.kind == "module_list"]
        if lists and not _compat.saves_distributed_checkpoint(self):
            raise ValueError(
                f"save_distributed_checkpoint=False with expert_parallel_size={self._ep_size}: the experts of"
                f" {lists[0]!r} (an nn.ModuleList) live on their expert-parallel ranks only, and a full checkpoint"
                " written by rank 0 would miss the others' experts and their optimizer state. Keep"
                " save_distributed_checkpoint=True (the default) and convert with `lit-parallel consolidate`"
                " for one file"
            )
        return plan

    @override
    def connect(self, model: pl.LightningModule) -> None:
        super().connect(model)
        self._check_blocks(model)

    # --- lifecycle --------------------------------------------------------------------------------------

    @property
    def parallel_dims(self) -> ParallelDims:
        if self._dims is None:
            raise RuntimeError(
                "Accessing the parallel sizes before the Trainer has configured them is not allowed."
            )
        return self._dims

    @override
    def setup_environment(self) -> None:
        self._validate()
        self._setup_distributed()
        self._device_mesh = self.parallel_dims.build_mesh(self.root_device.type)
        self.reliability.apply_timeout()  # the mesh's sub-groups get torch's 30-minute default otherwise
        if self.reliability.checkpoints is not None and _compat.saves_distributed_checkpoint(self):
            # the background writes' own gloo group, made now (a collective) rather than at the first save
            self.reliability.checkpoints.process_group()
        assert self.lightning_module is not None
        set_device_mesh(self.lightning_module, self._device_mesh)
        install_auto_resume(self)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return self.parallel_dims.sampler_kwargs()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        # ModelParallelStrategy.setup expects configure_model to have parallelized the model, and
        # Strategy.setup would move CPU-offloaded shards to the device: the order is written out here.
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        _refuse_fsdp1(self.model, type(self).__name__)
        if not isinstance(self.model, FSDPModule):
            self._parallelize()
        # fully_shard already placed every shard; with CPU offload they must stay in CPU memory
        offloaded = offload_policy(self._cpu_offload, self.root_device, warn=False) is not None
        if not offloaded:
            self.model_to_device()
        self.barrier()
        # FSDP2 gathers parameters into ordinary tensors that later training reuses; inference-mode tensors
        # cannot be reused by autograd, so evaluation runs under no_grad instead.
        for loop in (trainer.validate_loop, trainer.test_loop, trainer.predict_loop):
            loop.inference_mode = False
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING and not offloaded:
            optimizers_to_device(self.optimizers, self.root_device)

    def _refuse_prebuilt_dtensors(self, does: str = "shards", other_fix: str = "") -> None:
        """The strategy parallelizes the model itself: DTensor parameters from configure_model are refused."""
        from torch.distributed.tensor import DTensor

        assert self.model is not None
        if any(isinstance(p, DTensor) for p in self.model.parameters()):
            raise TypeError(
                f"{type(self).__name__} {does} the model itself, but configure_model already produced"
                " DTensor parameters (fully_shard / parallelize_module). Remove that code from"
                f" configure_model{other_fix}, or use Lightning's ModelParallelStrategy for hand-written"
                " parallelism."
            )

    def _parallelize(self) -> None:
        assert self.model is not None
        self._refuse_prebuilt_dtensors()
        # bf16-true / 16-true: cast before sharding so the shards are stored in half precision.
        self.model = self.precision_plugin.convert_module(self.model)
        blocks = find_transformer_blocks(self.model, self._block_types)
        self.plan = plan_fsdp(
            self.model,
            world_size=self.parallel_dims.world_size,
            shard_size=self.parallel_dims.data_parallel_shard,
            block_types=blocks,
            precision=str(self.precision_plugin.precision),
            reshard_after_forward=self._reshard_after_forward,
            activation_checkpointing=self._activation_checkpointing,
            compile=bool(self._compile),
            cpu_offload=self._cpu_offload,
        )
        info(f"{self.strategy_name}: {self.plan.summary()}")
        debug(f"{self.strategy_name}: {self.plan.describe()}")
        config = self._parallelize_config(blocks)
        parallelize(self.model, self.parallel_dims, config)
        if self._init_from is not None:
            load_full_state_dict(self.model, self._init_from if self.global_rank == 0 else None)
            info(
                f"{self.strategy_name}: loaded full state dict {str(self._init_from)!r} into the sharded model"
            )

    def _parallelize_config(self, blocks: BlockPlan) -> ParallelizeConfig:
        assert self.model is not None
        self.expert_plan = self._plan_experts(self.model)
        if self.expert_plan is not None:
            info(f"{self.strategy_name}: {self.expert_plan.summary()}")
            debug(f"{self.strategy_name}: {self.expert_plan.describe()}")
        return ParallelizeConfig(
            block_types=blocks,
            expert_parallel=self.expert_plan,
            activation_checkpointing=self._activation_checkpointing,
            compile=self._compile,
            reshard_after_forward=self._reshard_after_forward,
            mp_policy=self._mp_policy,
            offload=offload_policy(self._cpu_offload, self.root_device),
            forward_methods=STEP_METHODS,
            filled_by_state_dict=self._init_from is not None,
        )

    # --- reliability (lit_parallel.reliability; the other hooks: ReliableTrainingMixin) -------------------

    @override
    def on_exception(self, exception: BaseException) -> None:
        with_shard_read_hint(exception)
        super().on_exception(exception)  # the failure report (ReliableTrainingMixin)

    @override
    def _setup_distributed(self) -> None:
        self.reliability.setup_process_group(self, super()._setup_distributed)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any | None = None
    ) -> None:
        save_sharded_checkpoint(self, checkpoint, filepath, storage_options, super().save_checkpoint)

    @override
    def load_checkpoint(
        self, checkpoint_path: str | Path, weights_only: bool | None = None
    ) -> dict[str, Any]:
        return load_sharded_checkpoint(self, checkpoint_path, weights_only, super().load_checkpoint)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Non-final micro-batches of gradient accumulation: no reduce-scatter (FSDP2's
        ``set_requires_gradient_sync(False)``); the final one reduces the accumulated gradients."""
        if isinstance(self.model, FSDPModule):
            with no_gradient_sync(self.model):
                yield None
        else:
            yield None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="FSDP2 per transformer block (blocks found automatically), ZeRO-2/3, mixed precision",
        )


def _check_arguments(
    *,
    block_types: Any,
    reshard_after_forward: Any,
    mixed_precision: Any,
    activation_checkpointing: Any,
    compile: Any,
    cpu_offload: Any,
    init_from: Any,
    save_distributed_checkpoint: Any,
) -> None:
    """TransformerFSDPStrategy's own arguments, checked when it is built."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if not (isinstance(block_types, str) or callable(block_types) or isinstance(block_types, Iterable)):
        raise ValueError(
            f"block_types={block_types!r} must be 'auto', a set of classes or class names, or a predicate"
        )
    if not isinstance(reshard_after_forward, bool):
        raise ValueError(
            f"reshard_after_forward={reshard_after_forward!r} must be True (ZeRO-3) or False (ZeRO-2)"
        )
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecisionPolicy):
        raise ValueError(
            f"mixed_precision={mixed_precision!r} must be a torch.distributed.fsdp.MixedPrecisionPolicy or"
            " None (then Trainer(precision=...) decides)"
        )
    if not isinstance(compile, (bool, Mapping)):
        raise ValueError(f"compile={compile!r} must be True, False or a dict of torch.compile arguments")
    for name, flag in (
        ("activation_checkpointing", activation_checkpointing),
        ("cpu_offload", cpu_offload),
        ("save_distributed_checkpoint", save_distributed_checkpoint),
    ):
        check_bool(name, flag)
    check_optional_path("init_from", init_from)
