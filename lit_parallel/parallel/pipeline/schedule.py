"""Running a pipeline: stages parallelized over the data-parallel mesh, torch's schedules, losses, clipping.

Pure PyTorch (no Lightning). The order inside each stage follows :func:`~lit_parallel.parallel.parallelize`:
pipeline split first (so each stage is parallelized on its own), then tensor parallelism, activation
checkpointing per block, FSDP2 per block and on the stage. torch's ``PipelineStage`` knows FSDP2: it turns
the gradient reduce-scatter off for all micro-batches but the last and scales the gradients by ``1 / M``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lit_parallel.parallel.expert_parallel import (
    apply_expert_parallel,
    experts_sharded_first,
    outside_experts,
    plan_expert_parallel,
    without_expert_modules,
)
from lit_parallel.parallel.fsdp import apply_fsdp, fsdp_kwargs, grad_norm, scale_grads_
from lit_parallel.parallel.materialize import broadcast_from_rank0, has_meta, materialize_owned, mesh_device
from lit_parallel.parallel.mesh import ParallelDims
from lit_parallel.parallel.parallelize import apply_activation_checkpointing, no_cache_under_recomputation
from lit_parallel.parallel.pipeline.plan import SCHEDULES, PipelinePlan
from lit_parallel.parallel.pipeline.stage import StageModule, build_stage_modules
from lit_parallel.parallel.tensor_parallel.apply import apply_tp

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from lit_parallel.parallel.tensor_parallel import TPPlan

__all__ = [
    "HeldGradients",
    "Pipeline",
    "build_pipeline",
    "clip_grad_norm_across_stages",
    "parallelize_stages",
]


def parallelize_stages(
    model: nn.Module,
    plan: PipelinePlan,
    dims: ParallelDims,
    *,
    tp_plan: TPPlan | None = None,
    activation_checkpointing: bool = False,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
    shard: bool = True,
    filled_by_state_dict: bool = False,
    sync_chunk_bytes: int | None = None,
    expert_capacity_factor: float | None = None,
) -> list[StageModule]:
    """Prune ``model`` to this rank's stages and parallelize each stage over the data-parallel ranks
    (``shard=False``: no FSDP2, for the zero-bubble schedules on one data-parallel rank).

    A model on the meta device is materialised first, only this rank's stages kept, with the random numbers
    of a whole-model initialisation (:func:`~lit_parallel.parallel.materialize.materialize_owned`);
    ``filled_by_state_dict``: a full state dict is loaded afterwards (``init_from``). With
    ``dims.expert_parallel > 1`` the MoE layers this rank kept are split over the stage's expert-parallel
    ranks (the ranks of one stage run the same micro-batches in the same order, so their all-to-alls pair
    up) and returned plans are kept on each stage as ``stage.expert_plan``."""
    pp_rank = dims.mesh["pipeline_parallel"].get_local_rank()
    if has_meta(model):
        mine = [p for s in plan.stages_of(pp_rank) for p in s.pieces]
        every = [p for s in plan.stages for p in s.pieces]
        device = mesh_device(dims.mesh)
        materialize_owned(model, mine, every, device, filled_by_state_dict=filled_by_state_dict)
    else:
        # Every rank starts from rank 0's weights (the whole model, before the stages are cut from it), so each
        # one can take its stages' pieces and tensor-parallel shards locally; copied in bounded pieces.
        broadcast_from_rank0([*model.parameters(), *model.buffers()], sync_chunk_bytes)
    stages = build_stage_modules(model, plan, pp_rank)
    experts = None
    if dims.ep_enabled:
        # this rank's stages may hold no MoE layer (the strategy checked the whole model)
        experts = plan_expert_parallel(
            model, dims.expert_parallel, capacity_factor=expert_capacity_factor, require_layers=False
        )
    if tp_plan is not None:
        present = _present_part(tp_plan, model)
        present = present if experts is None else without_expert_modules(present, experts)
        apply_tp(model, dims.tp_mesh(), present, src_data_rank=None)
    if experts is not None:
        apply_expert_parallel(experts, dims.expert_mesh())
    if activation_checkpointing:
        no_cache_under_recomputation(model)
    modules = dict(model.named_modules())
    for stage in stages:
        stage.expert_plan = experts
        blocks = [modules[name] for name in stage.plan.blocks]
        blocks = blocks if experts is None else outside_experts(experts, blocks)
        if activation_checkpointing:
            for block in blocks:
                apply_activation_checkpointing(block)
        if not shard:
            stage.register_hooks()
            continue
        ready: Iterable[nn.Module] = blocks
        if experts is not None:
            kwargs = fsdp_kwargs(reshard_after_forward, mp_policy)
            ready = experts_sharded_first(stage, blocks, experts, dims, kwargs)
        apply_fsdp(
            stage, dims.fsdp_mesh(), ready, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy
        )
        stage.register_hooks()
    return stages


def _present_part(tp_plan: TPPlan, model: nn.Module) -> TPPlan:
    """The plan (inferred on the whole model) for the modules this rank kept: other stages' are gone."""
    import dataclasses

    from lit_parallel.parallel.pipeline.stage import _Skip

    present = {n for n, m in model.named_modules() if not isinstance(m, _Skip)}
    return dataclasses.replace(
        tp_plan,
        styles={p: s for p, s in tp_plan.styles.items() if p in present},
        head_attributes=[h for h in tp_plan.head_attributes if h[0] in present],
    )


@dataclass
class Pipeline:
    """This rank's stages and the schedule that runs them; ``step`` trains, ``evaluate`` only runs forward."""

    plan: PipelinePlan
    stages: list[StageModule]
    schedule: Any
    holds_last: bool
    group: Any
    pipe_stages: list = field(default_factory=list)  # torch's PipelineStage objects, one per stage

    def step(self, inputs: tuple, targets: Any, *, train: bool = True) -> torch.Tensor | None:
        """One step on this rank's batch; returns the mean micro-batch loss on the last stage, else ``None``."""
        losses: list[torch.Tensor] = []
        holds_first = any(s.plan.index == 0 for s in self.stages)
        args = inputs if holds_first else ()
        target = targets if self.holds_last else None
        for stage in self.stages:
            stage.reset_counters()
            stage.input_dtypes = tuple(i.dtype if isinstance(i, torch.Tensor) else None for i in inputs)
        run = self.schedule.step if train else self.schedule.eval
        run(*args, target=target, losses=losses)
        if not self.holds_last:
            return None
        return torch.stack([loss.detach().float() for loss in losses]).mean()


def build_pipeline(
    plan: PipelinePlan,
    stages: list[StageModule],
    dims: ParallelDims,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    device: torch.device,
    *,
    schedule: str | None = None,
    microbatches: int | None = None,
) -> Pipeline:
    """torch's ``PipelineStage`` for each of this rank's stages and a schedule over them: the plan's, or
    ``schedule`` with ``microbatches`` (a shorter batch: :func:`~lit_parallel.parallel.pipeline.plan.micro_batches_for`).

    ``loss_fn(output, targets)`` must return the micro-batch loss divided by the number of micro-batches
    (and by the gradient accumulation): the gradients are those of the step's mean loss."""
    import torch.distributed.pipelining as pipelining

    name = plan.schedule if schedule is None else schedule
    if SCHEDULES[name][1:] != SCHEDULES[plan.schedule][1:]:
        raise ValueError(
            f"schedule={name!r} lays stages out differently from the plan's {plan.schedule!r}; use one with"
            f" {SCHEDULES[plan.schedule][1]} stage(s) per rank, {SCHEDULES[plan.schedule][2]!r} order"
        )
    group = dims.mesh["pipeline_parallel"].get_group()
    cls = getattr(pipelining, SCHEDULES[name][0])
    pipe_stages = [
        pipelining.PipelineStage(stage, stage.plan.index, plan.num_stages, device, group=group)
        for stage in stages
    ]
    # scale_grads=False: torch would divide the whole .grad by M after each step, also what earlier steps
    # of a gradient accumulation left there; ``loss_fn`` is scaled by 1 / M instead (see Pipeline.step)
    first = pipe_stages[0] if SCHEDULES[name][1] == 1 else pipe_stages
    count = plan.microbatches if microbatches is None else microbatches
    runner = cls(first, n_microbatches=count, loss_fn=loss_fn, scale_grads=False)
    holds_last = any(s.is_last for s in stages)
    return Pipeline(plan, stages, runner, holds_last, group, pipe_stages)


class HeldGradients:
    """Gradients of one schedule step kept apart until the caller's backward adds them.

    Lightning zeroes gradients between ``training_step`` and ``backward`` at the start of an accumulation
    window; the schedule's backward runs inside ``training_step``. So the step's gradients are computed from
    ``None``, held here, the earlier ones put back (Lightning may zero them), and :meth:`release` adds the
    step's gradients to whatever is there then - exactly what a backward after the zeroing computes.
    """

    def __init__(self, parameters: Iterable[torch.Tensor]) -> None:
        self.params = list(parameters)
        self.held: list[torch.Tensor | None] | None = None
        self._earlier: list[torch.Tensor | None] = []

    def __enter__(self) -> HeldGradients:
        self._earlier = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        return self

    def __exit__(self, *exc: Any) -> None:
        self.held = [p.grad for p in self.params]
        for p, g in zip(self.params, self._earlier):
            p.grad = g
        self._earlier = []

    @torch.no_grad()
    def release(self) -> None:
        if self.held is None:
            return
        for p, g in zip(self.params, self.held):
            if g is not None:
                p.grad = g if p.grad is None else p.grad.add_(g)
        self.held = None


def step_mean_loss(local: torch.Tensor | None, dims: ParallelDims, device: torch.device) -> torch.Tensor:
    """The whole step's mean loss on every rank: the last stages' means averaged over the data-parallel ranks."""
    value = torch.zeros((), dtype=torch.float32, device=device) if local is None else local.to(device).clone()
    dist.all_reduce(value)
    # every rank of the last stage (data-parallel x tensor-parallel of them) contributed one mean
    return value / (dims.data_parallel * dims.tensor_parallel)


@torch.no_grad()
def clip_grad_norm_across_stages(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    group: Any,
    norm_type: float = 2.0,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Clip by one global norm over every stage: each rank's stage norm (reduced over its data- and
    tensor-parallel shards) is combined over the pipeline ranks, then every gradient is scaled.

    Everything stays on the gradients' device: the stage norm comes back there, the pipeline all-reduce
    runs there (NCCL refuses CPU tensors), and the scale is applied there, copied once per other device
    (CPU-offloaded gradients), never once per parameter. Returns the total norm (fp32, on that device).

    Args:
        group: the pipeline-parallel process group.
        device: the group's device, for a rank whose stages have no gradient (default: the gradients').
    """
    parameters = list(parameters)
    local = grad_norm(parameters, norm_type)
    if device is not None:
        local = local.to(device, non_blocking=local.device.type == "cpu")
    inf = norm_type == float("inf")
    # float64: the p-th powers of the stage norms are summed
    value = (local.double() if inf else local.double() ** norm_type).reshape(1)
    dist.all_reduce(value, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
    total = value[0] if inf else value[0] ** (1.0 / norm_type)
    scale_grads_(parameters, torch.clamp(max_norm / (total + 1e-6), max=1.0).float())
    return total.float()
