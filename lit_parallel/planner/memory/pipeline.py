"""Per-rank peak memory of pipeline parallelism (``pp_dp``), predicted before any run.

The layout is the strategy's (:class:`~lit_parallel.strategies.pipeline.PipelineParallelStrategy`): the
model is cut into ``P`` stages at block boundaries by :func:`~lit_parallel.parallel.pipeline.plan.plan_pipeline`
(balanced by parameter count; embeddings on the first stage, final norm and head on the last), each stage
sharded by FSDP2 over its ``d`` data-parallel ranks, the step's batch cut into ``M`` micro-batches and run
by the default schedule, ``1F1B`` (``GPipe`` is predicted too). ``advise`` shows one stage per node on
several nodes (``d`` = devices per node), one stage per device on one node (``d = 1``), and
``M = 4 P`` micro-batches as the advisor chooses (fewer when the batch does not divide: see
:func:`pipeline_microbatches`).

One micro-batch is simulated on the meta device (:mod:`~lit_parallel.planner.memory.pipeline_simulation`:
forward, the planner's loss, backward into gradients that already exist, as every micro-batch but the
first runs), with the saved activations attributed to the modules before the blocks, to each block and to
what follows them (head and loss). What stage ``s`` holds at its peak,
the steady state of the schedule, after its first backward (``c``: bytes of the compute dtype; ``b``:
ZeRO's bytes per parameter of the precision):

* parameters: its pieces' sharded parameters, ``b.params / d`` each, plus what is gathered (``c`` each)
  at the worst moment of a backward (:func:`backward_moment`): FSDP2 reshards every block after its
  forward (the strategy's ``reshard_after_forward=True``) and keeps the stage's root pieces (embeddings,
  head) gathered; torch's ``PipelineStage`` turns resharding after backward off until the step's last
  backward, so the blocks a backward has reached stay gathered until the next forward (FSDP2 gathers into
  its own buffers also when ``d = 1``; with ``d > 1`` the next block's all-gather is prefetched too);
* gradients: last step's sharded gradients (the strategy holds the schedule's gradients apart until
  Lightning has zeroed the old ones, so both exist during the schedule) plus the unsharded gradients FSDP2
  accumulates over the micro-batches (gradient sync is off until the last), ``b.grads`` each;
* optimizer state: AdamW's, sharded over ``d``, and one fp32 step counter per parameter tensor;
* activations: the saved activations of the micro-batches in flight: ``min(P - s, M)`` under 1F1B, ``M``
  under GPipe, less those of the oldest one's blocks its backward has passed at that moment (the
  simulation saves what the fused attention kernel saves, as a real step does), less the tensors that
  live in the pipeline's own buffers (counted once, below): the model's inputs, the stage's received
  activation, the stage's output;
* temporaries (:func:`boundary_terms`): the step's batch (every rank holds it; the micro-batches are
  slices of it); torch's receive buffers, allocated at the first step and kept, one per micro-batch for
  the activation and the model's inputs passed along (stages after the first) and for the gradient coming
  back (stages before the last); every micro-batch's output on the last stage (the schedule keeps them
  until the next step); the stage output of each micro-batch in flight; what 1F1B's sends hold: the
  output of the second-last warmup forward (until the cooldown) and the gradient the previous backward
  sent back (until the next one's); the largest temporaries of one micro-batch's forward or backward
  (a backward into existing gradients: each parameter's new gradient next to the accumulated one; with
  activation checkpointing they include the block backward recomputes).

The optimizer step (stage state, its gradients, AdamW's scratch, the kept buffers, the batch and the last
stage's outputs) is the other moment; the larger one, on the stage with the largest total, is the
prediction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from lit_parallel.parallel.pipeline.plan import PipelinePlan
from lit_parallel.planner.memory.pipeline_simulation import MicroBatchSimulation, simulate_micro_batch
from lit_parallel.planner.pipeline_layout import (
    PREDICTED_SCHEDULES,
    PipelineLayout,
    micro_batch_args,
    pipeline_layout,
    pipeline_plan,
)
from lit_parallel.planner.precision import PrecisionBytes

__all__ = [
    "MicroBatchSimulation",
    "StageBytes",
    "PipelinePrediction",
    "backward_moment",
    "boundary_terms",
    "in_flight",
    "predict_pipeline",
    "simulate_micro_batch",
    "stage_peaks",
]


def in_flight(schedule: str, stage: int, stages: int, microbatches: int) -> int:
    """Micro-batches whose activations stage ``stage`` holds at once: GPipe runs every forward first (all
    ``M``); 1F1B starts backward as soon as the last stage can, so stage ``s`` holds ``min(P - s, M)``."""
    if schedule == "GPipe":
        return microbatches
    if schedule == "1F1B":
        return min(stages - stage, microbatches)
    raise ValueError(
        f"schedule={schedule!r} is not predicted; the planner predicts {', '.join(PREDICTED_SCHEDULES)}"
    )


@dataclass(frozen=True)
class StageBytes:
    """One stage's peak: bytes by category, the moment, and the stage's index."""

    stage: int
    params: float
    grads: float
    optimizer: float
    activations: float
    temporaries: float
    phase: str

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.temporaries


def _stage_counts(module: nn.Module, pieces: list[str]) -> tuple[int, int, int, int]:
    """(parameters, trainable, trainable tensors, largest trainable tensor) of a stage's pieces."""
    params = list(dict.fromkeys(p for name in pieces for p in module.get_submodule(name).parameters()))
    trainable = [p for p in params if p.requires_grad]
    return (
        sum(p.numel() for p in params),
        sum(p.numel() for p in trainable),
        len(trainable),
        max((p.numel() for p in trainable), default=0),
    )


def _numel(module: nn.Module, name: str) -> int:
    return sum(p.numel() for p in module.get_submodule(name).parameters())


def backward_moment(
    k: int,
    prefix: float,
    blocks: list[float],
    suffix: float,
    root: float,
    gathered: list[float],
    prefetch: bool,
) -> tuple[float, float]:
    """(parameters gathered, saved activations) at the worst moment of a stage's backward of its oldest
    micro-batch in flight, ``k`` in flight, each saving ``prefix + sum(blocks) + suffix``. FSDP2 reshards
    every block after its forward (the strategy's ``reshard_after_forward=True``) and keeps only the stage's
    root pieces gathered; torch's ``PipelineStage`` turns resharding after backward off, so in backward the
    blocks already run stay gathered (with ``d > 1`` the next block's all-gather is prefetched as well)
    while the current micro-batch's activations are freed block by block. ``gathered``: each block's
    gathered bytes; ``root``: the rest of the stage's."""
    rest = (k - 1) * (prefix + sum(blocks) + suffix)
    moments = [(root, rest + prefix + sum(blocks) + suffix)]  # the head and the loss go back first
    for j in reversed(range(len(blocks))):
        ahead = gathered[j - 1] if prefetch and j else 0.0
        moments.append((root + sum(gathered[j:]) + ahead, rest + prefix + sum(blocks[: j + 1])))
    return max(moments, key=sum)


def boundary_terms(
    sim: MicroBatchSimulation, ids: list[int], stage: int, stages: int, microbatches: int, schedule: str
) -> tuple[float, float, float, list[float], float]:
    """What stage ``stage`` (blocks ``ids``) holds at a pipeline's boundaries, besides its blocks' saved
    activations: ``(kept, in_step, head, blocks, tail)``.

    ``kept``, from one step to the next (the optimizer step included): the step's batch (on every rank);
    torch's receive buffers, one per micro-batch, for the activation and the inputs passed along (stages
    after the first) and for the gradient coming back (stages before the last); the last stage's outputs
    of every micro-batch (the schedule returns them merged; ``clear_runtime_states`` drops them at the next
    step). ``in_step``, during the schedule: the stage output of each micro-batch in flight, and under 1F1B
    what its sends hold: the output of the second-last warmup forward (its send's work is kept until the
    cooldown) and the gradient the previous backward sent back (until the next backward sends its own).
    ``head``, ``blocks``, ``tail``: the saved activations of the stage's pieces less what is counted above
    (the model's inputs saved: slices of the batch, or on later stages their receive buffers; the receive
    buffer the first block saves; the output the last block saves; the output the loss saves)."""
    last, m = stage == stages - 1, microbatches
    out_b = 0.0 if last else sim.outputs[ids[-1]]
    in_b = 0.0 if stage == 0 else sim.outputs[ids[0] - 1]
    blocks = [sim.blocks[i] - sim.block_inputs[i] for i in ids]
    if stage:
        blocks[0] -= sim.input_saved[ids[0]]
    if not last:
        blocks[-1] -= sim.output_saved[ids[-1]]
    head = sim.prefix - sim.prefix_inputs if stage == 0 else 0.0
    tail = sim.suffix - sim.suffix_inputs - sim.model_output_saved if last else 0.0
    kept = m * (
        sim.inputs + out_b + (in_b + sim.inputs if stage else 0.0) + (sim.model_output if last else 0.0)
    )
    k = in_flight(schedule, stage, stages, m)
    in_step = k * out_b
    if schedule == "1F1B":
        in_step += (out_b if k >= 2 and m >= 2 * k - 1 else 0.0) + (in_b if m >= k + 1 else 0.0)
    return kept, in_step, head, blocks, tail


def stage_peaks(
    module: nn.Module,
    plan: PipelinePlan,
    block_names: list[str],
    layout: PipelineLayout,
    sim: MicroBatchSimulation,
    b: PrecisionBytes,
    *,
    device_type: str = "cuda",
) -> list[StageBytes]:
    """Every stage's peak (the module docstring's terms) for ``layout`` from one micro-batch's simulation
    (with activation checkpointing, the simulation's temporaries hold the block recomputed in backward)."""
    index = {n: i for i, n in enumerate(block_names)}
    d, m, c = layout.data_parallel, layout.microbatches, b.compute
    opt_elem = 4 if b.optimizer >= 8 else 2  # AdamW's scratch in the master dtype
    out = []
    for stage in plan.stages:
        s = stage.index
        params, trainable, tensors, largest = _stage_counts(module, stage.pieces)
        k = in_flight(layout.schedule, s, plan.num_stages, m)
        ids = [index[n] for n in stage.blocks]
        kept, in_step, head, blocks, tail = boundary_terms(sim, ids, s, plan.num_stages, m, layout.schedule)
        optimizer = trainable * b.optimizer / d + 4 * tensors
        scratch = (trainable / d if device_type == "cuda" else 2 * largest) * opt_elem
        per_block = [_numel(module, n) * c for n in stage.blocks]
        root = params * c - sum(per_block)
        gathered, live = backward_moment(k, head, blocks, tail, root, per_block, d > 1)
        out.append(
            max(
                StageBytes(
                    s,
                    params * b.params / d + gathered,
                    trainable * b.grads / d + trainable * b.grads,
                    optimizer,
                    live,
                    kept + in_step + sim.temporaries,
                    "backward",
                ),
                StageBytes(
                    s,
                    params * b.params / d,
                    trainable * b.grads / d,
                    optimizer,
                    0.0,
                    scratch + kept,
                    "optimizer step",
                ),
                key=lambda x: x.total,
            )
        )
    return out


@dataclass(frozen=True)
class PipelinePrediction:
    """``pp_dp`` for one model and cluster shape: the layout, the largest stage's peak without and with
    activation checkpointing, one micro-batch's stage boundary bytes, and the largest stage's share of the
    parameters (its share of the compute, for the step time)."""

    layout: PipelineLayout
    off: StageBytes
    on: StageBytes
    boundary_bytes: float
    stage_share: float

    def as_dict(self) -> dict[str, Any]:
        lay = self.layout
        return {
            "stages": lay.stages,
            "microbatches": lay.microbatches,
            "data_parallel": lay.data_parallel,
            "schedule": lay.schedule,
            "micro_batch": lay.micro_batch,
            "largest_stage": self.off.stage,
            "boundary_bytes": self.boundary_bytes,
            "largest_stage_param_share": self.stage_share,
        }


def predict_pipeline(
    module: nn.Module,
    block_names: list[str],
    b: PrecisionBytes,
    *,
    devices: int,
    nodes: int,
    batch_size: int,
    seq_len: int | None = None,
    example_inputs: Any = None,
    device_type: str = "cuda",
    stages: int | None = None,
) -> PipelinePrediction:
    """The largest stage's peak of ``pp_dp`` (1F1B, the layout of :func:`pipeline_layout`) for a step of
    ``batch_size`` samples per pipeline. Raises ``ValueError`` saying why when it cannot be predicted (no
    blocks, one rank, a batch smaller than the stages, weights tied across stages, ...)."""
    if not block_names:
        raise ValueError("pp_dp cuts the model between transformer blocks, and none were found")
    layout = pipeline_layout(devices, nodes, batch_size, stages=stages)
    if layout is None:
        raise ValueError(
            f"pp_dp needs at least 2 stages (one per node, or per device on one node) and a batch of at"
            f" least as many samples; here {devices} device(s) x {nodes} node(s), batch {batch_size}"
        )
    if len(block_names) < layout.stages:
        raise ValueError(f"{len(block_names)} blocks cannot be cut into {layout.stages} stages")
    dtype = b.compute_dtype
    plan = pipeline_plan(module, block_names, layout)  # raises for weights tied across stages
    args = micro_batch_args(module, layout.micro_batch, seq_len, example_inputs)
    sim = simulate_micro_batch(module, block_names, args, dtype=dtype)
    sim_ac = simulate_micro_batch(module, block_names, args, dtype=dtype, activation_checkpointing=True)
    off = stage_peaks(module, plan, block_names, layout, sim, b, device_type=device_type)
    on = stage_peaks(module, plan, block_names, layout, sim_ac, b, device_type=device_type)
    total = sum(p.numel() for p in dict.fromkeys(module.parameters())) or 1
    return PipelinePrediction(
        layout,
        max(off, key=lambda x: x.total),
        max(on, key=lambda x: x.total),
        boundary_bytes=max(sim.outputs, default=0.0),
        stage_share=max(s.params for s in plan.stages) / total,
    )
