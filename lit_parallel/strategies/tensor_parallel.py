"""TensorParallelStrategy ("tp_dp"): tensor parallelism inside blocks, FSDP2 across, no configure_model.

A thin shell: it infers the plan (:func:`~lit_parallel.parallel.infer_tp_plan`) and hands it to
:func:`~lit_parallel.parallel.parallelize`, which applies torchtitan's order: tensor parallelism, then
activation checkpointing, then compile, then FSDP2 over the data-parallel dimension (per block, then the
root). Everything else comes from ``fsdp_blocks`` (itself built on Lightning's ModelParallelStrategy):
the mesh from :class:`~lit_parallel.parallel.ParallelDims`, a sampler over the data-parallel ranks only
(the ranks of one tensor-parallel group read identical batches), no reduce-scatter on non-final
micro-batches, gradient clipping over parameters on different meshes, precision flags, distributed
checkpoints.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from typing_extensions import override

from lit_parallel._logging import debug, info
from lit_parallel.parallel.blocks import BlockPlan, find_transformer_blocks
from lit_parallel.parallel.fsdp import load_full_state_dict
from lit_parallel.parallel.materialize import has_meta
from lit_parallel.parallel.mesh import ParallelDims, Size, check_size
from lit_parallel.parallel.parallelize import parallelize
from lit_parallel.parallel.rank_bytes import describe_parameter_bytes
from lit_parallel.parallel.tensor_parallel import PlanSpec, TPPlan, plan_from_spec
from lit_parallel.reliability import DebugLevel, PreemptionSignal
from lit_parallel.reliability.async_checkpoints import AsyncCheckpoint
from lit_parallel.reliability.checkpoints import TP_LAYOUT_KEY
from lit_parallel.reliability.stall import StallTimeout
from lit_parallel.strategies.arguments import CommonArguments, checked_argument_names
from lit_parallel.strategies.fsdp import TransformerFSDPStrategy

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.fsdp import MixedPrecisionPolicy


def _check_arguments(
    data_parallel_size: Any,
    tensor_parallel_size: Any,
    data_parallel_replicate_size: Any,
    plan: Any,
    sequence_parallel: Any,
    loss_parallel: Any,
) -> None:
    """TensorParallelStrategy's own arguments, checked when it is built (the rest are ``fsdp_blocks``')."""
    check_size("data_parallel_size", data_parallel_size, auto=True)
    check_size("tensor_parallel_size", tensor_parallel_size, auto=True)
    check_size("data_parallel_replicate_size", data_parallel_replicate_size)
    if not (isinstance(plan, (str, Mapping)) or callable(plan)) or (isinstance(plan, str) and plan != "auto"):
        raise ValueError(
            f"plan={plan!r} must be 'auto', a dict {{module_path: ParallelStyle}} or a function"
            " fn(lightning_module, tp_mesh)"
        )
    if sequence_parallel and not (isinstance(plan, str)):
        raise ValueError(
            "sequence_parallel=True applies to plan='auto'; a plan of your own must contain its"
            " SequenceParallel styles itself (then leave sequence_parallel=False)"
        )
    for name, value in (("sequence_parallel", sequence_parallel), ("loss_parallel", loss_parallel)):
        if not isinstance(value, bool):
            raise ValueError(f"{name}={value!r} must be True or False")


class TensorParallelStrategy(TransformerFSDPStrategy):
    """Tensor parallelism inside each transformer block and FSDP2 across, over a
    ``(data_parallel, tensor_parallel)`` mesh (3-D with ``data_parallel_replicate_size``).

    Args:
        data_parallel_size: ranks that read different data. ``"auto"`` (default): the number of nodes,
            or whatever ``tensor_parallel_size`` leaves.
        tensor_parallel_size: ranks a block's weights are split over. ``"auto"`` (default): devices per
            node (tensor parallelism communicates in every block, so it stays inside a node).
        data_parallel_replicate_size: split the data-parallel ranks into replicas x shards (HSDP + TP,
            as large clusters run it: shard inside a group of nodes, replicate across); 1 = plain FSDP.
            ``data_parallel_replicate_size * (data_parallel_size / data_parallel_replicate_size) *
            tensor_parallel_size`` must equal the world size; the error shows the arithmetic.
        plan: ``"auto"`` (default): infer the column/row splits of every block's Linears from the data
            flow (see :func:`~lit_parallel.parallel.infer_tp_plan`); or a dict ``{module_path:
            ParallelStyle}`` (paths relative to the LightningModule, ``*`` wildcards allowed); or a
            function ``fn(lightning_module, tp_mesh)`` that parallelizes the model itself.
        sequence_parallel: ``True``: norms run on 1/tp of the sequence and the residual stream between
            blocks is sharded over it (less activation memory, all-gather + reduce-scatter instead of
            all-reduce). Needs pre-norm blocks and a sequence length divisible by the TP size.
        loss_parallel: ``True``: the output head stays split over the vocabulary and the loss is computed
            on the shards (``training_step`` and ``backward`` run under ``loss_parallel()``); the model's
            logits are then a DTensor, so compute the loss with ``F.cross_entropy`` on them.
        block_types: the transformer blocks (``"auto"``, classes, class names or a predicate), as in
            ``fsdp_blocks``.
        expert_parallel_size, expert_capacity_factor: MoE experts split over that many of the data-parallel
            ranks (attention and the rest stay tensor-parallel; the experts are not TP-split), as in
            ``fsdp_blocks``.
        reshard_after_forward, mixed_precision, activation_checkpointing, compile, init_from,
        save_distributed_checkpoint, process_group_backend, timeout, debug_level, watchdog,
            preemption_signal, stall_timeout, auto_resume, async_checkpoint: as in ``fsdp_blocks``.

    The plan (module -> style, replicated layers with the reason, adjusted head-count attributes) and
    the parameter bytes per rank are logged on rank 0; the plan is kept as ``strategy.tp_plan``. With
    ``plan="auto"`` and a model that exists before ``fit`` (no ``configure_model``), the plan is inferred
    and checked before any process group is created. To trace the data flow, the strategy runs the
    module that holds the blocks once on made-up tokens (or the blocks on made-up activations); set
    ``example_input_array`` on the LightningModule (and define its ``forward``) to use a real input.
    """

    strategy_name = "tp_dp"

    @checked_argument_names
    def __init__(
        self,
        data_parallel_size: Size = "auto",
        tensor_parallel_size: Size = "auto",
        data_parallel_replicate_size: int = 1,
        plan: PlanSpec = "auto",
        sequence_parallel: bool = False,
        loss_parallel: bool = False,
        block_types: Any = "auto",
        reshard_after_forward: bool = True,
        mixed_precision: MixedPrecisionPolicy | None = None,
        activation_checkpointing: bool = False,
        compile: bool | Mapping[str, Any] = False,
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
            data_parallel_size,
            tensor_parallel_size,
            data_parallel_replicate_size,
            plan,
            sequence_parallel,
            loss_parallel,
        )
        super().__init__(
            block_types=block_types,
            reshard_after_forward=reshard_after_forward,
            mixed_precision=mixed_precision,
            activation_checkpointing=activation_checkpointing,
            compile=compile,
            init_from=init_from,
            save_distributed_checkpoint=save_distributed_checkpoint,
            expert_parallel_size=expert_parallel_size,
            expert_capacity_factor=expert_capacity_factor,
            **CommonArguments.pick(locals()),
        )
        self._dp_size = data_parallel_size
        self._tp_size = tensor_parallel_size
        self._replicate_size = data_parallel_replicate_size
        self._plan_spec = plan
        self._sequence_parallel = sequence_parallel
        self._loss_parallel = loss_parallel
        self.tp_plan: TPPlan | None = None

    # --- configuration, checked before any process exists -----------------------------------------------

    @override
    def _parallel_dims(self) -> ParallelDims:
        return ParallelDims.for_tensor_parallel(
            num_nodes=self.num_nodes,
            devices_per_node=self.num_processes,
            data_parallel=self._dp_size,
            tensor_parallel=self._tp_size,
            data_parallel_replicate=self._replicate_size,
            expert_parallel=self._ep_size,
        )

    def _make_plan(self, module: nn.Module, blocks: BlockPlan | None = None) -> TPPlan:
        example = None
        array = getattr(module, "example_input_array", None)
        if array is not None and is_overridden("forward", module):
            example = array
        return plan_from_spec(
            module,
            self._plan_spec,
            self.parallel_dims.tensor_parallel,
            block_types=blocks if blocks is not None else self._block_types,
            sequence_parallel=self._sequence_parallel,
            loss_parallel=self._loss_parallel,
            example_inputs=example,
        )

    @override
    def connect(self, model: pl.LightningModule) -> None:
        super().connect(model)
        # A model that is complete now gets its plan now: a bad plan or size fails before any process group.
        if not is_overridden("configure_model", model) and any(True for _ in model.parameters()):
            if self._dims is None:
                self._validate()
            if not has_meta(model):
                self.tp_plan = self._make_plan(model)

    # --- lifecycle --------------------------------------------------------------------------------------

    @override
    def _parallelize(self) -> None:
        assert self.model is not None
        self._refuse_prebuilt_dtensors("parallelizes", other_fix=" (pass your own plan=... instead)")
        self.model = self.precision_plugin.convert_module(self.model)
        blocks = find_transformer_blocks(self.model, self._block_types)
        if self.tp_plan is None:
            self.tp_plan = self._make_plan(self.model, blocks)
        config = self._parallelize_config(blocks)
        config.tp_plan = self.tp_plan
        info(f"{self.strategy_name}: mesh {self.parallel_dims.describe()}; {self.tp_plan.describe()}")
        debug(f"{self.strategy_name}: {self.tp_plan.describe(detail=True)}")
        parallelize(self.model, self.parallel_dims, config)
        info(
            f"{self.strategy_name}: {describe_parameter_bytes(self.model, self.tp_plan, self.parallel_dims)}"
        )
        if self._init_from is not None:
            full = None
            if self.global_rank == 0:
                full = torch.load(self._init_from, mmap=True, weights_only=True, map_location="cpu")
                full = self.tp_plan.to_parallel_layout(full)
            load_full_state_dict(self.model, full)
            info(
                f"{self.strategy_name}: loaded full state dict {str(self._init_from)!r} into the split model"
            )

    # --- checkpoints ------------------------------------------------------------------------------------

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any | None = None
    ) -> None:
        # Weights are saved in their original layout, but the optimizer state of fused layers keeps the
        # row order of this TP size: record it so that a resume with another TP size is refused.
        if self.tp_plan is not None and self.tp_plan.fused:
            checkpoint[TP_LAYOUT_KEY] = {
                "tensor_parallel_size": self.tp_plan.tp_size,
                "fused": sorted(self.tp_plan.fused),
            }
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(
        self, checkpoint_path: str | Path, weights_only: bool | None = None
    ) -> dict[str, Any]:
        # a sharded checkpoint of another tensor-parallel size is refused by load_sharded_checkpoint
        path = Path(self.broadcast(checkpoint_path))
        if path.is_file() and self.tp_plan is not None and self.tp_plan.fused:
            raise ValueError(
                f"checkpoint {str(path)!r} is a full (single-file) checkpoint, and this model's fused layers"
                f" ({', '.join(sorted(self.tp_plan.fused))}) keep their rows in tp_dp's own order, which a full"
                " checkpoint's rows do not have. Resume it under a strategy without tensor parallelism"
                " (ddp_tuned, fsdp_blocks, hsdp), let tp_dp save sharded checkpoints"
                " (save_distributed_checkpoint=True, the default), or start from its weights only: save"
                " torch.load(FILE)['state_dict'] to a file and pass it as init_from=..."
            )
        return super().load_checkpoint(path, weights_only)

    # --- loss parallel ----------------------------------------------------------------------------------

    def _loss_context(self):
        if not self._loss_parallel:
            return nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._loss_context():
            return _local_loss(super().training_step(*args, **kwargs))

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._loss_context():
            return _local_loss(super().validation_step(*args, **kwargs))

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._loss_context():
            return _local_loss(super().test_step(*args, **kwargs))

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        # The loss-parallel backward ops are only registered inside the context.
        with self._loss_context():
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="Tensor parallel inside blocks (plan inferred) + FSDP2 across, over a 2-D/3-D mesh",
        )


def _local_loss(output: Any) -> Any:
    """A replicated DTensor loss (loss parallel) as the plain tensor Lightning expects; its backward still
    runs through the DTensor graph."""
    from torch.distributed.tensor import DTensor

    if isinstance(output, DTensor):
        return output.to_local()
    if isinstance(output, dict) and isinstance(output.get("loss"), DTensor):
        return {**output, "loss": output["loss"].to_local()}
    return output
