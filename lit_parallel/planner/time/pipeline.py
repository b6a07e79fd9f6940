"""``pp_dp``'s step time: what each stage computes, counted on the meta device, and the schedule over it.

A stage's share of the parameters says little about its share of the work: a vocabulary embedding holds
many parameters and computes nothing, a convolution's first layers hold few and compute most. So one
micro-batch's forward (and the loss, on the last stage) runs on the meta device with every op and FLOP
counted and charged to the stage that runs it (:func:`stage_work`): a block's ops to the block's stage,
the ops before the first block to the first stage, the ops after the last block to the last stage, the
ops between two blocks to the stage of the block before. Backward follows the same split.

With the machine's cost per op and per FLOP (:class:`~lit_parallel.planner.time.step.StepTime`) each
stage's time per micro-batch ``t_s`` follows; 1F1B and GPipe then take ``sum(t_s) + (M - 1) x max(t_s)``
(:func:`uneven_pipeline_step`): the slowest stage busy for all ``M`` micro-batches, the others' time once
as the pipeline fills and drains. Every slot of the schedule (``M + P - 1``) also pays the schedule's and
FSDP2's bookkeeping, which grows with the FSDP groups of a stage (its blocks and its root), and one
activation sent forward and one gradient sent back.

Step time (:func:`pipeline_step_time`): with equal stages of compute ``t`` per step, GPipe and 1F1B take
``(M + P - 1)`` slots of one micro-batch's forward and backward, ``t / M``, each slot also paying the
stage boundary's point-to-point transfers (activation forward, gradient back; latency + bytes /
bandwidth each): the idle fraction, the bubble, is ``(P - 1) / (M + P - 1)``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import nn

from lit_parallel.planner.pipeline_layout import PREDICTED_SCHEDULES, PipelineLayout, pipeline_plan


@dataclass(frozen=True)
class StageWork:
    """One stage's share of a micro-batch's ops and FLOPs, its FSDP groups (its blocks + its root) and its
    parameter tensors (0: not counted)."""

    ops: float
    flops: float
    groups: int
    tensors: int = 0


def stage_work(module: nn.Module, stage_blocks: list[list[str]], args: tuple) -> list[StageWork]:
    """Each stage's share of the ops and FLOPs of one forward (and the loss) of ``module`` on the meta
    ``args``, stages given as their blocks' names in order."""
    from torch.utils.flop_counter import FlopCounterMode

    from lit_parallel.parallel.example_inputs import to_meta
    from lit_parallel.planner.simulation import default_loss, meta_copy
    from lit_parallel.planner.time.step import _OpCounter

    meta = meta_copy(module)
    stage_of = {name: s for s, names in enumerate(stage_blocks) for name in names}
    ops = [0] * len(stage_blocks)
    flops = [0] * len(stage_blocks)
    ops_mode, flop_mode = _OpCounter(), FlopCounterMode(display=False)
    state = {"stage": 0, "ops": 0, "flops": 0}

    def charge_to(stage: int) -> None:  # what ran since the last boundary belongs to the current stage
        now_ops, now_flops = ops_mode.ops, flop_mode.get_total_flops()
        ops[state["stage"]] += now_ops - state["ops"]
        flops[state["stage"]] += now_flops - state["flops"]
        state.update(stage=stage, ops=now_ops, flops=now_flops)

    last = len(stage_blocks) - 1
    handles = []
    for name, s in stage_of.items():
        block = meta.get_submodule(name)
        handles.append(block.register_forward_pre_hook(lambda m, a, s=s: charge_to(s)))
    final = meta.get_submodule(stage_blocks[-1][-1])
    handles.append(final.register_forward_hook(lambda m, a, o: charge_to(last)))
    try:
        meta_args = tuple(to_meta(a) for a in args)
        with flop_mode, ops_mode:
            default_loss(meta(*meta_args), meta_args)
            charge_to(last)
    finally:
        for h in handles:
            h.remove()
    total_ops, total_flops = max(1, sum(ops)), max(1, sum(flops))
    return [
        StageWork(o / total_ops, f / total_flops, len(names) + 1)
        for o, f, names in zip(ops, flops, stage_blocks, strict=True)
    ]


def uneven_pipeline_step(
    slot_s: list[float], *, microbatches: int, transfer_s: float = 0.0, overhead_per_slot_s: float = 0.0
) -> PipelineStepTime:
    """One 1F1B (or GPipe) step over stages that take ``slot_s[s]`` seconds per micro-batch (forward +
    backward): the slowest stage busy ``M`` times, every other stage's time once (the bubble), and per slot
    (``M + P - 1``) one transfer each way and the bookkeeping ``overhead_per_slot_s``."""
    if microbatches < 1 or not slot_s:
        raise ValueError(f"microbatches={microbatches} and {len(slot_s)} stages must be at least 1")
    slowest = max(slot_s)
    slots = microbatches + len(slot_s) - 1
    return PipelineStepTime(
        microbatches * slowest,
        sum(slot_s) - slowest,
        slots * 2 * transfer_s if len(slot_s) > 1 else 0.0,
        slots * overhead_per_slot_s,
    )


def transfer_seconds(boundary_bytes: float, latency_s: float, bandwidth_gbps: float | None) -> float:
    """One stage boundary transfer (a micro-batch's activation, or its gradient): latency + bytes /
    bandwidth (GB/s); without a bandwidth, the latency alone."""
    return latency_s + (boundary_bytes / (bandwidth_gbps * 1e9) if bandwidth_gbps else 0.0)


def pipeline_stage_work(
    module: nn.Module, block_names: list[str], layout: PipelineLayout, args: tuple
) -> list[StageWork]:
    """:func:`stage_work` for the stages ``pp_dp`` makes of ``module`` with ``layout`` (a
    :class:`~lit_parallel.planner.pipeline_layout.PipelineLayout`), on one micro-batch's meta ``args``."""

    plan = pipeline_plan(module, block_names, layout)
    work = stage_work(module, [list(s.blocks) for s in plan.stages], args)
    return [
        replace(w, tensors=stage_tensors(module, s.pieces)) for w, s in zip(work, plan.stages, strict=True)
    ]


def stage_tensors(module: nn.Module, pieces: list[str]) -> int:
    """Parameter tensors a stage made of the submodules ``pieces`` of ``module`` holds (a tied one once)."""
    return len({id(p) for name in pieces for p in module.get_submodule(name).parameters()})


@dataclass(frozen=True)
class PipelineStepTime:
    """Seconds of one pipeline step: busy compute, the bubble, the stage boundary transfers."""

    compute_s: float
    bubble_s: float
    p2p_s: float
    overhead_s: float = 0.0

    @property
    def step_s(self) -> float:
        return self.compute_s + self.bubble_s + self.p2p_s + self.overhead_s


def pipeline_step_time(
    stage_compute_s: float,
    *,
    microbatches: int,
    stages: int,
    schedule: str = "1F1B",
    boundary_bytes: float = 0.0,
    latency_s: float = 0.0,
    bandwidth_gbps: float | None = None,
    slot_overhead_s: float = 0.0,
) -> PipelineStepTime:
    """One step of GPipe or 1F1B over equal stages.

    Args:
        stage_compute_s: forward + backward of one stage over the whole step's batch (all micro-batches).
        boundary_bytes: the activation one micro-batch sends to the next stage (its gradient comes back
            with the same size).
        latency_s, bandwidth_gbps: one point-to-point transfer's latency and bandwidth (GB/s); without a
            bandwidth only the latency is counted.
        slot_overhead_s: fixed seconds every slot costs besides compute and transfers (the schedule's and
            FSDP2's per-micro-batch bookkeeping); 0 by default.

    Returns:
        ``M`` slots of compute, ``P - 1`` slots idle (the bubble, ``(P - 1) / (M + P - 1)`` of the step),
        and in each of the ``M + P - 1`` slots one activation sent forward and one gradient sent back.
    """
    if schedule not in PREDICTED_SCHEDULES:
        raise ValueError(
            f"schedule={schedule!r} is not predicted; choose one of {', '.join(PREDICTED_SCHEDULES)}"
        )
    if microbatches < 1 or stages < 1:
        raise ValueError(f"microbatches={microbatches} and stages={stages} must be at least 1")
    return uneven_pipeline_step(
        [stage_compute_s / microbatches] * stages,
        microbatches=microbatches,
        transfer_s=transfer_seconds(boundary_bytes, latency_s, bandwidth_gbps),
        overhead_per_slot_s=slot_overhead_s,
    )
