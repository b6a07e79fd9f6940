"""PipelineParallelStrategy ("pp_dp"): pipeline stages (outermost), FSDP2 and optional TP inside each stage.

A thin shell: the plan comes from :func:`~lit_parallel.parallel.pipeline.plan.plan_pipeline`, the stages from
:func:`~lit_parallel.parallel.pipeline.schedule.parallelize_stages`, the schedule from torch's
``torch.distributed.pipelining``. Lightning's loop stays in charge of the optimizer, accumulation, clipping,
logging and checkpoints; the strategy's ``training_step`` runs the schedule (forward and backward of every
micro-batch), so Lightning's backward call becomes a no-op.

The LightningModule contract: the strategy pipelines ``forward(inputs)``; the module provides
``pipeline_loss(output, targets) -> Tensor`` (the mean loss of a micro-batch) and may override
``pipeline_split_batch(batch) -> (inputs, targets)`` (default: the batch is an ``(inputs, targets)`` pair).
``training_step`` / ``validation_step`` / ``test_step`` of the module are not called; the strategy logs
``train_loss`` / ``val_loss`` / ``test_loss`` (the whole step's mean loss, equal on every rank).
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.utilities.model_helpers import is_overridden
from typing_extensions import override

from lit_parallel import _compat
from lit_parallel._logging import info
from lit_parallel.checkpoint.load import verify_checkpoint
from lit_parallel.parallel.blocks import find_transformer_blocks
from lit_parallel.parallel.mesh import ParallelDims, Size, check_size
from lit_parallel.parallel.pipeline.checkpoint import (
    globalize_param_groups,
    load_full_checkpoint_file,
    load_full_state_dict_into_stages,
    load_pipeline_checkpoint,
)
from lit_parallel.parallel.pipeline.plan import ZERO_BUBBLE, check_schedule, micro_batches_for, plan_pipeline
from lit_parallel.parallel.pipeline.schedule import (
    HeldGradients,
    Pipeline,
    build_pipeline,
    parallelize_stages,
    step_mean_loss,
)
from lit_parallel.parallel.tensor_parallel import plan_from_spec
from lit_parallel.plugins.precision.fsdp import FSDPHalfPrecision
from lit_parallel.plugins.precision.pipeline import PipelineClipping, PipelineHalfPrecision, PipelinePrecision
from lit_parallel.reliability import DebugLevel, PreemptionSignal
from lit_parallel.reliability.async_checkpoints import AsyncCheckpoint
from lit_parallel.reliability.stall import StallTimeout
from lit_parallel.strategies.arguments import CommonArguments, checked_argument_names
from lit_parallel.strategies.fsdp import TransformerFSDPStrategy

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.fsdp import MixedPrecisionPolicy


def _default_split_batch(batch: Any) -> tuple[Any, Any]:
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise ValueError(
        f"pp_dp expects each batch to be an (inputs, targets) pair, got {type(batch).__name__}"
        f"{f' of length {len(batch)}' if isinstance(batch, (tuple, list)) else ''}; define"
        " pipeline_split_batch(batch) -> (inputs, targets) on the LightningModule"
    )


def _run_by_the_pipeline(self: Any, *args: Any, **kwargs: Any) -> None:
    raise RuntimeError("pp_dp runs training, validation and test steps through the pipeline, not this method")


def _shapes(inputs: tuple, targets: Any) -> tuple[int, tuple]:
    """The batch's sample count and the shapes and dtypes its tensors have (what torch's stages fix)."""
    tensors = [t for t in (*inputs, targets) if isinstance(t, torch.Tensor)]
    size = tensors[0].shape[0] if tensors else 0
    return size, tuple((tuple(t.shape), t.dtype) for t in tensors)


class PipelineParallelStrategy(TransformerFSDPStrategy):
    """Pipeline parallelism over ``pipeline_parallel_size`` ranks (outermost mesh dimension), FSDP2 over the
    data-parallel ranks inside each stage, tensor parallelism inside a stage when ``tensor_parallel_size > 1``.

    Args:
        pipeline_parallel_size: ranks the stages are spread over (P).
        schedule: ``"1F1B"`` (default), ``"GPipe"``, ``"Interleaved1F1B"``, ``"LoopedBFS"`` (2 stages per
            rank), ``"InterleavedZeroBubble"``, ``"ZBVZeroBubble"``, ``"DualPipeV"`` (2 stages per rank,
            zero-bubble: only with ``data_parallel_size=1``, see the docs).
        microbatches: micro-batches each step's batch is cut into (M); the batch size should divide by it.
            A batch it does not divide (a dataset's last, shorter batch) runs exactly as fewer equal
            micro-batches (the largest count below M that divides it). The bubble (idle fraction) of GPipe and 1F1B is ``(P - 1) / (M + P - 1)``.
        data_parallel_size: ``"auto"`` (default): what the other sizes leave.
        data_parallel_replicate_size: replicas x shards inside each stage (HSDP); 1 = FSDP.
        tensor_parallel_size: tensor parallelism inside each stage (1 = off).
        expert_parallel_size, expert_capacity_factor: MoE experts of each stage split over that many of the
            stage's data-parallel ranks, as in ``fsdp_blocks``.
        split: ``"auto"``: stages start at block boundaries, balanced by parameter count (embeddings on the
            first stage, final norm and head on the last); or the names of the blocks where stages 2, 3, ...
            start (``["h.2"]``).
        init_from: a full ``state_dict`` file (keys of the LightningModule) loaded into the stages after
            setup: rank 0 reads it, every rank keeps its own stages' entries. Combine with a model built on the
            meta device in ``configure_model``: each rank then materialises only its own stages (modules'
            ``reset_parameters`` draw the random numbers of a whole-model initialisation).
        block_types, reshard_after_forward, mixed_precision, activation_checkpointing, process_group_backend,
        timeout, debug_level, watchdog, preemption_signal, stall_timeout, auto_resume, async_checkpoint: as
            in ``fsdp_blocks``.

    Checkpoints are always distributed (DCP, each rank its stages' shards, state-dict keys of the whole
    model): they load under any pipeline size and under the other strategies, and back.
    """

    strategy_name = "pp_dp"

    @checked_argument_names
    def __init__(
        self,
        pipeline_parallel_size: int = 2,
        schedule: str = "1F1B",
        microbatches: int = 4,
        data_parallel_size: Size = "auto",
        data_parallel_replicate_size: int = 1,
        tensor_parallel_size: int = 1,
        expert_parallel_size: int = 1,
        expert_capacity_factor: float | None = None,
        split: str | Sequence[str] = "auto",
        block_types: Any = "auto",
        reshard_after_forward: bool = True,
        mixed_precision: MixedPrecisionPolicy | None = None,
        activation_checkpointing: bool = False,
        init_from: str | Path | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        debug_level: DebugLevel | None = None,
        watchdog: bool = True,
        preemption_signal: PreemptionSignal = "auto",
        stall_timeout: StallTimeout = "auto",
        auto_resume: bool = False,
        async_checkpoint: AsyncCheckpoint = False,
    ) -> None:
        check_size("pipeline_parallel_size", pipeline_parallel_size)
        check_size("microbatches", microbatches)
        check_size("data_parallel_size", data_parallel_size, auto=True)
        check_size("data_parallel_replicate_size", data_parallel_replicate_size)
        check_size("tensor_parallel_size", tensor_parallel_size)
        check_schedule(schedule, pipeline_parallel_size, microbatches)
        if not (split == "auto" or (isinstance(split, Sequence) and not isinstance(split, str))) or (
            not isinstance(split, str) and not all(isinstance(s, str) for s in split)
        ):
            raise ValueError(f"split={split!r} must be 'auto' or a list of block names where stages start")
        super().__init__(
            block_types=block_types,
            reshard_after_forward=reshard_after_forward,
            mixed_precision=mixed_precision,
            activation_checkpointing=activation_checkpointing,
            init_from=init_from,
            save_distributed_checkpoint=True,
            expert_parallel_size=expert_parallel_size,
            expert_capacity_factor=expert_capacity_factor,
            **CommonArguments.pick(locals()),
        )
        self._pp_size, self._schedule, self._microbatches = pipeline_parallel_size, schedule, microbatches
        self._dp_size, self._replicate_size = data_parallel_size, data_parallel_replicate_size
        self._tp_size = tensor_parallel_size
        self._split = split if isinstance(split, str) else list(split)
        self.pipeline_plan = None
        self.pipeline: Pipeline | None = None
        self._loss_scale = 1.0
        self._param_order: dict[str, int] = {}
        self._held: HeldGradients | None = None
        self._pipelines: dict[tuple, Pipeline] = {}
        self._stages: list = []

    # --- configuration, checked before any process exists -----------------------------------------------

    @override
    def _parallel_dims(self) -> ParallelDims:
        dims = ParallelDims.for_pipeline(
            world_size=self.num_nodes * self.num_processes,
            pipeline_parallel=self._pp_size,
            data_parallel=self._dp_size,
            data_parallel_replicate=self._replicate_size,
            tensor_parallel=self._tp_size,
            expert_parallel=self._ep_size,
        )
        check_schedule(self._schedule, self._pp_size, self._microbatches, dims.data_parallel)
        return dims

    @override
    def _resolve_precision(self) -> None:
        if isinstance(self._precision_plugin, PipelineClipping):
            return
        super()._resolve_precision()
        flag = self._precision_plugin.precision
        if self._schedule in ZERO_BUBBLE and flag == "bf16-mixed":
            raise ValueError(
                f"schedule={self._schedule!r} runs without FSDP2, whose policy implements bf16-mixed here; use"
                " precision='bf16-true' or '32-true' with it, or schedule='1F1B'"
            )
        cls = (
            PipelineHalfPrecision
            if isinstance(self._precision_plugin, FSDPHalfPrecision)
            else PipelinePrecision
        )
        self._precision_plugin = cls(flag)

    def _plan(self, model: pl.LightningModule):
        blocks = find_transformer_blocks(model, self._block_types)
        return plan_pipeline(
            model,
            blocks,
            pp_size=self._pp_size,
            schedule=self._schedule,
            microbatches=self._microbatches,
            split=self._split,
        )

    @override
    def connect(self, model: pl.LightningModule) -> None:
        if not callable(getattr(model, "pipeline_loss", None)):
            raise TypeError(
                f"pp_dp pipelines {type(model).__name__}.forward(inputs) and needs the loss as a separate hook:"
                " define pipeline_loss(self, output, targets) -> Tensor on the LightningModule (the mean loss"
                " of one micro-batch; output is what forward returns)"
            )
        for name in ("training_step", "validation_step", "test_step"):
            # Lightning runs a loop only for a module that defines its step; the pipeline runs them instead
            if not is_overridden(name, model):
                setattr(model, name, types.MethodType(_run_by_the_pipeline, model))
        super().connect(model)
        if not is_overridden("configure_model", model) and any(True for _ in model.parameters()):
            self._plan(model)  # a split that cannot work fails before any process group
            self._plan_experts(model)

    # --- lifecycle --------------------------------------------------------------------------------------

    @override
    def _parallelize(self) -> None:
        assert self.model is not None
        if self._stages:
            return  # already cut into stages (fit, then test on the same Trainer)
        self._refuse_prebuilt_dtensors()
        self.model = self.precision_plugin.convert_module(self.model)
        self.pipeline_plan = plan = self._plan(self.model)
        self._plan_experts(self.model)  # the whole model has MoE layers; the stages take theirs
        self._param_order = {n: i for i, (n, _) in enumerate(self.model.named_parameters())}
        info(f"{self.strategy_name}: mesh {self.parallel_dims.describe()}\n{plan.table()}")
        tp_plan = None
        if self._tp_size > 1:
            # inferred on the whole model, before the stages are cut from it
            blocks = find_transformer_blocks(self.model, self._block_types)
            tp_plan = plan_from_spec(self.model, "auto", self._tp_size, block_types=blocks)
            info(f"{self.strategy_name}: {tp_plan.describe()}")
        stages = parallelize_stages(
            self.model,
            plan,
            self.parallel_dims,
            tp_plan=tp_plan,
            activation_checkpointing=self._activation_checkpointing,
            mp_policy=self._mp_policy,
            reshard_after_forward=self._reshard_after_forward,
            shard=self._schedule not in ZERO_BUBBLE,
            filled_by_state_dict=self._init_from is not None,
            expert_capacity_factor=self._capacity_factor,
        )
        self._stages = stages
        plans = [s.expert_plan for s in stages if s.expert_plan is not None]
        self.expert_plan = plans[0] if plans else None
        if self._init_from is not None:
            load_full_state_dict_into_stages(self.model, self._init_from if self.global_rank == 0 else None)
            info(f"{self.strategy_name}: loaded full state dict {str(self._init_from)!r} into the stages")
        self.precision_plugin.pp_group = self._pp_group()  # type: ignore[attr-defined]
        self.precision_plugin.pp_device = self.root_device  # type: ignore[attr-defined]

    def _pp_group(self) -> Any:
        return self.parallel_dims.mesh["pipeline_parallel"].get_group()

    def _pipeline_for(self, key: tuple, schedule: str, microbatches: int) -> Pipeline:
        """torch's stages fix the tensor shapes they exchange at their first step, and its schedules the
        number of micro-batches: one pipeline per shape of the batch (a smaller last batch, a validation
        batch size), built when first seen."""
        if key not in self._pipelines:
            self._pipelines[key] = build_pipeline(
                self.pipeline_plan,
                self._stages,
                self.parallel_dims,
                self._micro_batch_loss,
                self.root_device,
                schedule=schedule,
                microbatches=microbatches,
            )
        return self._pipelines[key]

    def _micro_batch_loss(self, output: Any, targets: Any) -> torch.Tensor:
        return self.lightning_module.pipeline_loss(output, targets) * self._loss_scale

    def _run(self, batch: Any, train: bool) -> torch.Tensor:
        module = self.lightning_module
        split = getattr(module, "pipeline_split_batch", None)
        inputs, targets = split(batch) if callable(split) else _default_split_batch(batch)
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        size, shapes = _shapes(inputs, targets)
        # a batch that microbatches does not divide (a dataset's last, shorter batch) runs as fewer equal
        # micro-batches: the mean of their means is still the batch's mean (see micro_batches_for)
        schedule, count = micro_batches_for(self._schedule, self._pp_size, self._microbatches, size)
        key = (shapes, schedule, count)
        if not _compat.has_feature("pipelining_mode_switch"):  # torch < 2.12: one pipeline per mode too
            _compat.log_degraded("pipelining_mode_switch")
            key = (*key, train)
        if key not in self._pipelines and count != self._microbatches:
            info(
                f"{self.strategy_name}: a batch of {size} samples does not split into microbatches="
                f"{self._microbatches} equal micro-batches; it runs as {count} micro-batch(es) of"
                f" {size // count} under {schedule} (exact; a batch size divisible by {self._microbatches}"
                " keeps the pipeline full)"
            )
        self.pipeline = self._pipeline_for(key, schedule, count)
        # gradients of the step's mean loss, divided by the accumulation as Lightning does with a returned loss
        accumulate = self.lightning_module.trainer.accumulate_grad_batches if train else 1
        self._loss_scale = 1.0 / (count * accumulate)
        if train:
            self._held = HeldGradients(self.lightning_module.parameters())
            with self._held:
                local = self.pipeline.step(inputs, targets, train=True)
        else:
            local = self.pipeline.step(inputs, targets, train=False)
        return step_mean_loss(local, self.parallel_dims, self.root_device) / self._loss_scale

    def _step(self, batch: Any, train: bool, name: str) -> torch.Tensor:
        with (
            self.precision_plugin.train_step_context() if train else self.precision_plugin.val_step_context()
        ):
            loss = self._run(batch, train)
        # equal on every rank already; sync_dist for evaluation only silences Lightning's epoch-level warning.
        # In the progress bar only when there is one: Lightning reads every prog_bar value on the host after
        # each batch (a device sync per step), shown or not.
        trainer = self.lightning_module.trainer
        self.lightning_module.log(
            name, loss, prog_bar=trainer.progress_bar_callback is not None, sync_dist=not train
        )
        return loss

    @override
    def training_step(self, batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> torch.Tensor:
        # the schedule ran forward and backward of every micro-batch; Lightning's backward call is a no-op
        return self._step(batch, True, "train_loss")

    @override
    def validation_step(self, batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> torch.Tensor:
        with torch.no_grad():
            return self._step(batch, False, "val_loss")

    @override
    def test_step(self, batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> torch.Tensor:
        with torch.no_grad():
            return self._step(batch, False, "test_loss")

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "pp_dp runs training, validation and test through the pipeline; predict is not pipelined. Save a"
            " checkpoint and predict under fsdp_blocks or ddp_tuned (checkpoints load across strategies)"
        )

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        # the schedule already ran backward through every stage; its gradients are added now, after
        # Lightning's zero_grad (see HeldGradients)
        if self._held is not None:
            self._held.release()
            self._held = None
        return closure_loss

    # --- checkpoints: the optimizer's groups name the whole model (see parallel/pipeline/checkpoint.py) ----

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        state = super().optimizer_state(optimizer)
        return globalize_param_groups(state, self._param_order, self._pp_group())

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        self.reliability.progress.at(f"restoring the checkpoint {str(path)!r}")
        strict = self.lightning_module.strict_loading
        if verify_checkpoint(path) != "sharded":
            return load_full_checkpoint_file(self.model, self.optimizers, path, self._param_order, strict)
        return load_pipeline_checkpoint(self.model, self.optimizers, path, strict)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="Pipeline parallel (torch.distributed.pipelining schedules) x FSDP2 x TP",
        )
