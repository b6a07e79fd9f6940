"""The ``pp_dp`` layout the planner predicts: stages, micro-batches, data-parallel ranks per stage and the
strategy's own cut of a model into stages. Memory (:mod:`~lit_parallel.planner.memory.pipeline`) and step time
(:mod:`~lit_parallel.planner.time.pipeline`) are both predicted for this layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lit_parallel.parallel.blocks import BlockPlan
from lit_parallel.parallel.example_inputs import as_args, meta_example_input
from lit_parallel.parallel.pipeline.plan import PipelinePlan, plan_pipeline

PREDICTED_SCHEDULES = ("1F1B", "GPipe")


def pipeline_microbatches(batch_size: int, stages: int) -> int | None:
    """``4 x stages`` micro-batches as the advisor chooses, or the most below that divide ``batch_size`` (at
    least ``stages``, as 1F1B needs); ``None`` when none does."""
    for m in range(4 * stages, stages - 1, -1):
        if batch_size % m == 0:
            return m
    return None


@dataclass(frozen=True)
class PipelineLayout:
    """Stages ``P``, micro-batches ``M``, data-parallel ranks per stage ``d``, the schedule, and the
    micro-batch (``batch_size / M`` samples)."""

    stages: int
    microbatches: int
    data_parallel: int
    schedule: str
    micro_batch: int

    def describe(self) -> str:
        return (
            f"{self.stages} stages x {self.data_parallel} data-parallel, {self.schedule}, {self.microbatches}"
            f" micro-batches of {self.micro_batch}"
        )


def pipeline_layout(
    devices: int, nodes: int, batch_size: int, schedule: str = "1F1B", stages: int | None = None
) -> PipelineLayout | None:
    """The layout ``advise`` predicts: one stage per node on several nodes, else one per device; ``None``
    when there is one rank, or the batch cannot be cut into micro-batches (fewer samples than stages)."""
    world = devices * nodes
    p = stages or (nodes if nodes > 1 else devices)
    if p < 2 or world % p:
        return None
    m = pipeline_microbatches(batch_size, p)
    if m is None:
        return None
    return PipelineLayout(p, m, world // p, schedule, batch_size // m)


def pipeline_plan(module: nn.Module, block_names: list[str], layout: PipelineLayout) -> PipelinePlan:
    """The strategy's stages for ``layout`` (:func:`~lit_parallel.parallel.pipeline.plan.plan_pipeline`)."""
    blocks = BlockPlan([(n, module.get_submodule(n)) for n in block_names], (), 0)
    return plan_pipeline(
        module, blocks, pp_size=layout.stages, schedule=layout.schedule, microbatches=layout.microbatches
    )


def micro_batch_args(module: nn.Module, micro_batch: int, seq_len: int | None, example_inputs: Any) -> tuple:
    if example_inputs is not None:  # a given input of the whole batch: its first micro_batch samples
        example_inputs = tuple(
            a[:micro_batch] if isinstance(a, torch.Tensor) and a.dim() else a for a in as_args(example_inputs)
        )
    return meta_example_input(module, batch_size=micro_batch, seq_len=seq_len, given=example_inputs).args
