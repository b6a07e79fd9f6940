"""Measuring ``pp_dp`` for `lit-parallel advise --verify` and `lit-parallel lab memory`.

The step is the one the planner predicts (:mod:`lit_parallel.parallel.peak_pipeline`): the model's
``forward`` pipelined by :class:`~lit_parallel.strategies.pipeline.PipelineParallelStrategy` over every rank
of the launch (one stage per rank, data parallel size 1), the planner's default loss on each micro-batch,
AdamW. Every rank measures its own peak with :class:`~lit_parallel.parallel.live_memory.LiveMemory` (the
second step, as for the other strategies); the stage with the largest peak is the figure.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lit_parallel.parallel.peak_pipeline import pipeline_microbatches

PIPELINE_SCHEDULE = "1F1B"  # the strategy's default


def _pipeline_module(model: nn.Module):
    import lightning as L

    from lit_parallel.parallel.step_simulation import default_loss

    class PipelineVerifyStep(L.LightningModule):
        """The pp_dp contract around the verified model: forward, the planner's loss per micro-batch, AdamW."""

        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, *args: Any) -> Any:
            return self.model(*args)

        def pipeline_split_batch(self, batch: Any) -> tuple[tuple, Any]:
            args = tuple(batch)
            return args, args[0]  # default_loss needs the first input (token ids are the targets)

        def pipeline_loss(self, output: Any, first_input: Any) -> torch.Tensor:
            return default_loss(output, (first_input,))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.model.parameters(), lr=1e-5)

    return PipelineVerifyStep()


def measure_pipeline_step(
    model: nn.Module,
    inputs: tuple,
    *,
    devices: int,
    microbatches: int | None = None,
    schedule: str = PIPELINE_SCHEDULE,
    repeats: int | None = None,
    between: Any = None,
):
    """Train ``model`` under ``pp_dp`` (``devices`` stages, data parallel 1) for ``4 + repeats`` steps on
    ``inputs``; this rank's peak of the fourth step and the lower quartile of the later steps. Call in every rank of a
    launch of ``devices`` ranks. Returns ``(peak, seconds)``; ``between``: as in
    :func:`~lit_parallel.advise_verify.measure_step`."""
    import lit_parallel as lp
    from lit_parallel.advise_verify import STEP_REPEATS, measure_step

    batch = next(a for a in inputs if isinstance(a, torch.Tensor)).shape[0]
    m = microbatches or pipeline_microbatches(batch, devices)
    if m is None:
        raise ValueError(
            f"a batch of {batch} does not split into between {devices} and {4 * devices} equal micro-batches,"
            f" which pp_dp with {devices} stages (1F1B) needs; use a batch size divisible by {devices}"
        )
    strategy = lp.PipelineParallelStrategy(pipeline_parallel_size=devices, microbatches=m, schedule=schedule)
    return measure_step(model, inputs, strategy=strategy, devices=devices, repeats=repeats or STEP_REPEATS,
                        module=_pipeline_module(model), live_from_start=held_by_the_pipeline, between=between)  # fmt: skip


def held_by_the_pipeline(trainer: Any, batch: Any) -> list[torch.Tensor]:
    """What a pipeline rank holds through a whole step though its first use may come late: the step's
    batch (a stage that is neither first nor last never reads it) and torch's receive buffers, made at the
    first step and kept, one per micro-batch for the activations and for the gradients coming back."""
    from lit_parallel._compat import tree_flatten

    held = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]
    pipeline = getattr(trainer.strategy, "pipeline", None)
    for stage in getattr(pipeline, "pipe_stages", ()):
        for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values()):
            held += [info.buffer for info in infos if isinstance(getattr(info, "buffer", None), torch.Tensor)]
    return held


def pipeline_step_s(pred: Any) -> dict[str, float | None]:
    """``pp_dp``'s seconds of one step for an ``advise`` prediction (the shape of ``Prediction.step_s``):
    each stage's compute per micro-batch from its share of the ops and FLOPs
    (:mod:`~lit_parallel.parallel.pipeline_time`), the schedule over them (the slowest stage busy, the others
    once: the bubble), the largest stage's AdamW step, the stage boundary transfers (and FSDP2's
    collectives over the stage's data-parallel ranks) at the measured latency and bandwidth, the measured
    bookkeeping per slot (per FSDP group, parameter tensor and parameter byte of the largest stage),
    Lightning's per-step overhead. ``None`` entries: not predictable (no timing, no pipeline)."""
    from lit_parallel.parallel.calibration import pipeline_slot_s
    from lit_parallel.parallel.pipeline_time import StageWork, transfer_seconds, uneven_pipeline_step
    from lit_parallel.parallel.step_time import comm_seconds

    pipe, t = pred.report.pipeline, pred.timing
    if t is None or pipe is None:
        return {"compute_s": None, "optimizer_s": None, "comm_s": None, "step_s": None}
    lay, share = pipe.layout, pipe.stage_share
    m = lay.microbatches
    # without a count per stage: stages equal, as their parameters (one stage's groups: its blocks + root)
    equal = StageWork(share, share, round(share * (pred.groups - 1)) + 1, round(share * t.tensors))
    work = pred.stage_work or [equal] * lay.stages
    # every micro-batch dispatches the stage's ops again; its FLOPs are 1/M of the step's
    slot_s = [w.ops * t.ops * t.op_s + w.flops * t.flops / m * t.flop_s for w in work]
    cost = (pred.costs or {}).get("pp_dp")  # measured per slot by advise --verify's calibration
    groups, tensors = max(w.groups for w in work), max(w.tensors for w in work)
    # the measured cost per slot already holds the calibration's transfers (one each way of a few bytes,
    # latency and all): only the model's bytes are added to it; without one, a latency each way as well
    transfer = transfer_seconds(pipe.boundary_bytes, 0.0 if cost else pred.latency_s, pred.busbw_gbps)
    grad = 4 if pred.report.precision == "32-true" else 2
    per_slot = (
        pipeline_slot_s(cost, groups, tensors, share * pred.report.shape.params * grad) if cost else 0.0
    )
    time = uneven_pipeline_step(slot_s, microbatches=m, transfer_s=transfer, overhead_per_slot_s=per_slot)
    opt = share * (t.tensors * t.optimizer_tensor_s + t.elements / lay.data_parallel * t.optimizer_element_s)
    comm = time.p2p_s + time.overhead_s  # transfers and the schedule's per-slot bookkeeping
    if pred.busbw_gbps and lay.data_parallel > 1:
        grad = 4 if pred.report.precision == "32-true" else 2
        comm += comm_seconds("fsdp_blocks", round(share * pred.report.shape.params), devices=lay.data_parallel,
                             nodes=1, grad_bytes=grad, busbw_gbps=pred.busbw_gbps, latency_s=pred.latency_s,
                             groups=groups)  # fmt: skip
    compute = time.compute_s + time.bubble_s
    return {
        "compute_s": compute,
        "optimizer_s": opt,
        "comm_s": comm,
        "step_s": compute + opt + comm + pred.overhead_s,
    }


def pipeline_worker_entry(
    model: nn.Module, inputs: tuple, *, devices: int, repeats: int | None = None, timer: Any = None
) -> dict[str, Any]:
    """``pp_dp`` measured in every rank of an ``advise --verify`` launch (``devices`` ranks = stages), in the
    shape the launch reports the other strategies: ``{"peaks": [per rank], "step_s": s, "timing": t}``
    (``t``: ``timer``'s parts timed between the steps, as the slowest rank saw them,
    :func:`~lit_parallel.advise_rounds.slowest_rank_timing`). Raises what the strategy raised (a model pp_dp
    cannot split, such as one with weights tied across stages): the caller ends the launch, since another
    rank may be waiting inside a pipeline step."""
    import torch.distributed as dist

    from lit_parallel.advise_rounds import slowest_rank_timing
    from lit_parallel.advise_verify import peak_dict

    peak, step_s = measure_pipeline_step(
        model, inputs, devices=devices, repeats=repeats, between=timer.sample if timer else None
    )
    peaks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak_dict(peak))
    return {"peaks": peaks, "step_s": step_s, "timing": slowest_rank_timing(timer)}
