"""When pipeline parallelism pays, for the advisor: a rule check on an :class:`~lit_parallel.parallel.advisor.Advice`.

Pipeline stages exchange only one micro-batch's activations per stage boundary, so pipeline parallelism is
the dimension to put on slow links, and the one that splits a model across nodes without gathering
parameters across them. Its cost is the bubble: with P stages and M micro-batches, GPipe and 1F1B leave
each rank idle for (P - 1) / (M + P - 1) of a step. So it is chosen only when the model state sharded
over the devices of one node (FSDP/TP inside a node, what ``hsdp`` keeps) does not fit: then P groups of
nodes each hold 1/P of the model, sharded inside the group, and M = 4P micro-batches keep the bubble near
20% or below. With one node, ``fsdp_blocks`` and ``tp_dp`` split the model without a bubble.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lit_parallel.parallel.formatting import format_bytes
from lit_parallel.parallel.pipeline import bubble_fraction

if TYPE_CHECKING:
    from lit_parallel.parallel.advisor import Advice

__all__ = ["PIPELINE_RULE_TEXT", "pipeline_check", "pipeline_plan_for"]

# (strategy, when, why) of the advisor's rule; the advisor builds its Rule from it
PIPELINE_RULE_TEXT = (
    "pp_dp",
    "several nodes, and the model state sharded over the devices of one node does not fit, but cut into"
    " stages (one per group of nodes) it does",
    "stages exchange only activations, so no parameter crosses the nodes; the cost is the bubble,"
    " (P - 1) / (M + P - 1) of every step with P stages and M micro-batches (M = 4P: under 20%)",
)


def pipeline_plan_for(node_state_bytes: float, activation_bytes: float, memory_bytes: float, nodes: int):
    """The fewest stages P (a divisor of ``nodes``, at least 2) for which 1/P of the state sharded over
    one node, plus the activations, fits; ``None`` when even one stage per node does not."""
    for stages in range(2, nodes + 1):
        if nodes % stages == 0 and node_state_bytes / stages + activation_bytes <= memory_bytes:
            return stages
    return None


def pipeline_check(a: Advice) -> tuple[bool | None, str]:
    """The advisor's pipeline rule: holds when the model fits only when cut into stages across nodes."""
    if a.nodes < 2:
        return False, "one node: fsdp_blocks / tp_dp split the model there without a pipeline bubble"
    row = a.row("HSDP")  # the model state sharded over the devices of one node
    activations = row.activation_bytes or 0.0
    if row.fits:
        return False, (
            f"sharded inside one node it fits ({format_bytes(row.total_bytes, decimal=True)}): no stages needed"
        )
    stages = pipeline_plan_for(row.state_bytes, activations, a.memory_bytes, a.nodes)
    if stages is None:
        return False, (
            f"even {a.nodes} stages (one per node) need {format_bytes(row.state_bytes / a.nodes + activations, decimal=True)}"
            f" per rank > {format_bytes(a.memory_bytes, decimal=True)}"
        )
    m = 4 * stages
    need = row.state_bytes / stages + activations
    return True, (
        f"sharded inside one node: {format_bytes(row.total_bytes, decimal=True)} per rank >"
        f" {format_bytes(a.memory_bytes, decimal=True)}; cut into pipeline_parallel_size={stages} stages of"
        f" {a.nodes // stages} node(s): {format_bytes(need, decimal=True)} per rank; with microbatches={m} the"
        f" bubble costs (P-1)/(M+P-1) = {bubble_fraction(stages, m):.0%} of each step"
    )
