"""Which strategy fits: the one ordered rule table, evaluated on per-rank memory of every strategy.

Memory follows ZeRO's accounting (Rajbhandari et al. 2020) for Adam: with mixed precision every
parameter costs 2 + 2 + 12 = 16 bytes, in fp32 4 + 4 + 8 (:mod:`lit_parallel.planner.precision`); each
strategy divides what it shards by the ranks it shards over (:mod:`lit_parallel.planner.memory.table`).
A model is measured by :mod:`lit_parallel.planner.model_summary` (parameters, blocks) and
:mod:`lit_parallel.planner.activations` (one forward traced on the meta device).

"Fits" leaves headroom (:func:`usable_memory`): a layout predicted at 99 % of a device's memory runs out of
it on CUDA, where the caching allocator fragments, temporaries come and go between the moments the
prediction counts, and the CUDA context and NCCL's buffers take memory outside the allocator. A row fits
when its predicted bytes are at most ``(1 - memory_headroom) x device memory``, less
:data:`CUDA_RESERVED_BYTES` per process when the device is a GPU.

GB means 10^9 bytes. :data:`RULES` is the decision table; :func:`advise` evaluates it, the
``auto_parallel`` strategy calls :func:`advise` at setup, and the documentation prints
:func:`rules_markdown`. Nothing here imports Lightning.

When pipeline parallelism pays (:func:`pipeline_check`, rule 4): pipeline stages exchange only one micro-batch's activations per stage boundary, so pipeline parallelism is
the dimension to put on slow links, and the one that splits a model across nodes without gathering
parameters across them. Its cost is the bubble: with P stages and M micro-batches, GPipe and 1F1B leave
each rank idle for (P - 1) / (M + P - 1) of a step. So it is chosen only when the model state sharded
over the devices of one node (FSDP/TP inside a node, what ``hsdp`` keeps) does not fit: then P groups of
nodes each hold 1/P of the model, sharded inside the group, and M = 4P micro-batches keep the bubble near
20% or below. With one node, ``fsdp_blocks`` and ``tp_dp`` split the model without a bubble.

When expert parallelism pays (:func:`expert_parallel_choice`, rule 5): under ``fsdp_blocks`` every rank
gathers every expert of a block in forward and again in backward, although each token uses only its top-k.
With ``expert_parallel_size = e`` a rank holds ``1/e`` of each MoE layer's experts (FSDP-sharded over the
``N / e`` ranks that hold the same ones) and gathers only those, and the tokens travel to their experts by an
all-to-all each way instead. The model state per rank stays FSDP's (``(P - X) / N + (X / e) / (N / e) = P /
N``); what shrinks is the gathered working set and the experts' all-gather and reduce-scatter bytes, by ``e``
on the experts' share. So it is chosen when that share is large: experts at least
:data:`EXPERT_SHARE_THRESHOLD` of the parameters (Mixtral, Qwen-MoE, DeepSeek-MoE: around 90% and more),
where they are most of what FSDP gathers and the saving outweighs the all-to-alls. ``e`` is the largest size
that divides both every MoE layer's experts (each rank holds the same number) and the devices of one node:
the ``e`` ranks of an all-to-all group are consecutive, so they stay inside a node, where the links are fast;
every MoE layer waits for its all-to-all, and across nodes it would run at the slower inter-node bandwidth.

When tensor parallelism pays for the activations (rule 6): sharding divides the model state, never the
activations, which each rank keeps for its own micro-batch. A long sequence without activation checkpointing
can need more than the state (a Llama-70B shape at 2048 tokens: about 65 GB per rank in bf16), so sharding
over every rank may still not fit where tensor parallelism, which splits what happens inside a block over
the devices of a node, does. Rule 2 looks at one block only; rule 6 at the whole model, with its activations.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from lit_parallel.formatting import GB, divisors, format_bytes
from lit_parallel.parallel.pipeline.plan import bubble_fraction
from lit_parallel.planner.activations import ActivationEstimate, estimate_activations
from lit_parallel.planner.memory.rank_state import exact_rows
from lit_parallel.planner.memory.table import (
    MemoryRow,
    StateRow,
    expert_parallel_label,
    memory_rows,
    memory_table,
)
from lit_parallel.planner.model_summary import ModelSummary, build_on_meta, load_model_class, summarize_model
from lit_parallel.planner.precision import PRECISIONS, PrecisionBytes, canonical_precision, precision_bytes

# the advisor, and the summary, precision and memory-table names its answers are made of
__all__ = [
    "GB",
    "PRECISIONS",
    "RULES",
    "ActivationEstimate",
    "Advice",
    "MemoryRow",
    "PIPELINE_RULE_TEXT",
    "ModelSummary",
    "PrecisionBytes",
    "Rule",
    "StateRow",
    "advise",
    "build_on_meta",
    "CUDA_RESERVED_BYTES",
    "DEFAULT_MEMORY_HEADROOM",
    "EXPERT_SHARE_THRESHOLD",
    "device_memory_bytes",
    "expert_parallel_choice",
    "estimate_activations",
    "load_model_class",
    "memory_rows",
    "pipeline_check",
    "pipeline_plan_for",
    "precision_bytes",
    "rules_markdown",
    "summarize_model",
    "usable_memory",
]


# sanity bounds on what a user types: beyond them the figure is a typo, not a cluster
MAX_PARAMS = 10**15
MAX_MEMORY_GB = 1e5

# The share of a device's memory "fits" keeps free: allocator fragmentation and temporaries the prediction
# does not count (docs/how-to/choosing-a-strategy.md, "Headroom")
DEFAULT_MEMORY_HEADROOM = 0.10
# Memory a process takes on a GPU outside PyTorch's caching allocator: the CUDA context (kernels, cuBLAS and
# cuDNN handles and workspaces) and NCCL's communication buffers; an estimate (docs/how-to/choosing-a-strategy.md)
CUDA_RESERVED_BYTES = 1.0e9
# The share of the parameters the experts must hold for expert parallelism to be listed and chosen (rule 5):
# from half on they are most of what FSDP gathers and reduce-scatters each step and of a block's working set,
# which expert parallelism divides; below it most of the traffic is unchanged and the all-to-alls (one each
# way per MoE layer, forward and backward, with a host sync each) may cost more than they save
EXPERT_SHARE_THRESHOLD = 0.5


def usable_memory(capacity_bytes: float, *, memory_headroom: float, device_type: str) -> float:
    """The bytes of a device of ``capacity_bytes`` that "fits" may fill: ``(1 - memory_headroom) x capacity``,
    less :data:`CUDA_RESERVED_BYTES` on a CUDA device."""
    reserved = CUDA_RESERVED_BYTES if device_type == "cuda" else 0.0
    return capacity_bytes * (1.0 - memory_headroom) - reserved


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
    stages = pipeline_plan_for(row.state_bytes, activations, a.usable_bytes, a.nodes)
    if stages is None:
        return False, (
            f"even {a.nodes} stages (one per node) need {format_bytes(row.state_bytes / a.nodes + activations, decimal=True)}"
            f" per rank > {a.usable_phrase()}"
        )
    m = 4 * stages
    need = row.state_bytes / stages + activations
    return True, (
        f"sharded inside one node: {format_bytes(row.total_bytes, decimal=True)} per rank >"
        f" {a.usable_phrase()}; cut into pipeline_parallel_size={stages} stages of"
        f" {a.nodes // stages} node(s): {format_bytes(need, decimal=True)} per rank; with microbatches={m} the"
        f" bubble costs (P-1)/(M+P-1) = {bubble_fraction(stages, m):.0%} of each step"
    )


def expert_parallel_choice(summary: ModelSummary | None, devices: int) -> tuple[int | None, str]:
    """The ``expert_parallel_size`` the advisor uses with ``fsdp_blocks`` for ``summary``'s model on nodes of
    ``devices`` devices, and why: the largest size above 1 dividing both every MoE layer's experts and
    ``devices``, when the experts hold at least :data:`EXPERT_SHARE_THRESHOLD` of the parameters; ``1``
    with the reason when there is none; ``None`` when the model is unknown (a parameter count only)."""
    if summary is None:
        return (
            None,
            "not evaluated: a parameter count does not say which parameters are experts (pass a model)",
        )
    if not summary.experts_per_layer:
        return 1, "no MoE layers (no stacked expert weights, no ModuleList of experts next to a router)"
    share = summary.expert_params / summary.params if summary.params else 0.0
    layers = _experts_phrase(summary.experts_per_layer)
    held = f"experts hold {share:.0%} of the parameters ({summary.expert_params:,} of {summary.params:,}; {layers})"
    if share < EXPERT_SHARE_THRESHOLD:
        return 1, (
            f"{held}, less than {EXPERT_SHARE_THRESHOLD:.0%}: most of what FSDP gathers is not experts, so"
            " splitting them would not pay for the all-to-alls"
        )
    common = math.gcd(*summary.experts_per_layer)
    sizes = [d for d in divisors(common) if d > 1 and devices % d == 0]
    if not sizes:
        return 1, (
            f"{held}, but no expert_parallel_size above 1 divides both the experts of every MoE layer"
            f" ({common} in common) and the {devices} device(s) of a node"
        )
    return sizes[-1], (
        f"{held}; expert_parallel_size={sizes[-1]}: the largest that divides the experts of every MoE layer"
        f" ({common} in common) and the {devices} devices of a node (all-to-alls stay inside a node)"
    )


def _experts_phrase(experts_per_layer: tuple[int, ...]) -> str:
    counts = sorted(set(experts_per_layer))
    each = f"{counts[0]} experts" if len(counts) == 1 else f"{'/'.join(map(str, counts))} experts"
    n = len(experts_per_layer)
    return f"{n} MoE layer{'s' if n > 1 else ''} of {each}"


# --- the rules ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """One row of the decision table: if ``when`` holds, use ``strategy``.

    ``check(advice)`` returns ``(holds, evidence)``; ``holds`` is ``None`` when the rule cannot be
    evaluated (e.g. the size of a block is unknown), which counts as not holding.
    """

    number: int
    strategy: str
    when: str
    why: str
    check: Callable[[Advice], tuple[bool | None, str]] = field(repr=False, compare=False)
    argument: str = ""  # the argument of ``strategy`` the rule sets, in words (rule 5: expert_parallel_size)


def _rule_fits_one_device(a: Advice) -> tuple[bool | None, str]:
    row = a.row("DDP")
    return row.fits, f"DDP needs {format_bytes(row.total_bytes, decimal=True)} per rank{a.memory_phrase(row)}"


def _rule_block_too_large(a: Advice) -> tuple[bool | None, str]:
    need = a.block_working_bytes
    if need is None:
        return None, a.block_unknown_reason
    act = (
        f" + {format_bytes(a.activations.largest_block_bytes, decimal=True)} activations"
        if a.activations is not None
        else "; activations unknown"
    )
    verdict = "more than" if need > a.usable_bytes else "fits"
    return need > a.usable_bytes, (
        f"the largest block needs {format_bytes(need, decimal=True)} ({a.largest_block_params:,} params x ({a.bytes.compute} +"
        f" {a.bytes.compute}) bytes for parameters and gradients in compute precision{act}): {verdict} one"
        f" device ({a.usable_phrase()})"
    )


def _rule_hsdp(a: Advice) -> tuple[bool | None, str]:
    row = a.row("HSDP")
    if a.nodes < 2:
        return False, "one node: nothing to replicate across nodes"
    return (
        row.fits,
        f"{a.nodes} nodes; sharded inside one node: {format_bytes(row.total_bytes, decimal=True)}{a.memory_phrase(row)}",
    )


def _rule_expert_parallel(a: Advice) -> tuple[bool | None, str]:
    size, reason = expert_parallel_choice(a.model, a.devices)
    if size is None or size == 1:
        return None if size is None else False, reason
    row = a.row("FSDP+EP")
    block = ""
    if a.largest_block_params is not None and a.model is not None and a.model.largest_block_expert_params:
        experts = a.model.largest_block_expert_params
        gathered = a.largest_block_params - experts + experts // size
        block = (
            f"; a rank gathers {gathered:,} of the largest block's {a.largest_block_params:,} parameters (its"
            f" {experts:,} expert parameters / {size})"
        )
    state = f"; per rank {format_bytes(row.total_bytes, decimal=True)} (as FSDP){a.memory_phrase(row)}"
    if not row.fits:
        state += ": does not fit either, but nothing above holds"
    return True, f"{reason}{block}{state}"


def _rule_tensor_parallel_fits(a: Advice) -> tuple[bool | None, str]:
    fsdp, tp = a.row("FSDP/ZeRO-3"), a.row("TP+DP")
    sharded = f"sharded over all {a.world_size} ranks: {format_bytes(fsdp.total_bytes, decimal=True)}"
    if fsdp.fits:
        return False, f"{sharded}{a.memory_phrase(fsdp)}: no tensor parallelism needed"
    split = (
        f"tensor parallel {a.devices} x FSDP over {a.nodes} node(s): {format_bytes(tp.total_bytes, decimal=True)}"
        f"{a.memory_phrase(tp)}"
    )
    if not tp.fits:
        return False, f"{sharded} and {split}"
    act = (
        f" (activations {format_bytes(fsdp.activation_bytes or 0.0, decimal=True)} under FSDP,"
        f" {format_bytes(tp.activation_bytes or 0.0, decimal=True)} split inside blocks)"
    )
    return True, f"{sharded}{a.memory_phrase(fsdp)}; {split}{act}"


def _rule_otherwise(a: Advice) -> tuple[bool | None, str]:
    row = a.row("FSDP/ZeRO-3")
    need = f"sharded over all {a.world_size} ranks: {format_bytes(row.total_bytes, decimal=True)}"
    if row.fits:
        return True, f"{need}{a.memory_phrase(row)}"
    # chosen because nothing else holds, although it does not fit either: say so, not "yes"
    return True, f"no rule above holds, but this does not fit either: {need}{a.memory_phrase(row)}"


RULES: tuple[Rule, ...] = (
    Rule(
        1,
        "ddp_tuned",
        "the whole model state (parameters, gradients, optimizer state; plus activations when known) fits"
        " one device",
        "nothing to shard: DDP communicates least (one all-reduce of the gradients per step) and is the"
        " simplest",
        _rule_fits_one_device,
    ),
    Rule(
        2,
        "tp_dp",
        "one transformer block (its parameters and gradients in compute precision, plus its activations)"
        " does not fit one device even when everything else is sharded",
        "FSDP gathers a whole block on every rank; only tensor parallelism splits a block. It"
        " communicates in every block, so its size is the devices of one node",
        _rule_block_too_large,
    ),
    Rule(
        3,
        "hsdp",
        "several nodes, and the model state sharded over the devices of one node fits",
        "parameters are gathered over the fast links inside a node; across nodes only the gradient"
        " shards are all-reduced",
        _rule_hsdp,
    ),
    Rule(4, *PIPELINE_RULE_TEXT, pipeline_check),
    Rule(
        5,
        "fsdp_blocks",
        f"the model's experts (its MoE layers) hold at least {EXPERT_SHARE_THRESHOLD:.0%} of its parameters, and"
        " an expert-parallel size above 1 divides both the experts of every MoE layer and the devices of a node",
        "each rank then holds and gathers 1/e of every layer's experts (model state per rank as FSDP's), so"
        " the gathered block and the experts' gather traffic shrink by e; tokens travel to their experts by"
        " all-to-all instead, which pays when experts are most of the model. e is the largest such size: the"
        " all-to-all groups stay inside a node",
        _rule_expert_parallel,
        argument="expert_parallel_size=e",
    ),
    Rule(
        6,
        "tp_dp",
        "the model state and activations sharded over every rank (FSDP) do not fit one device, but with"
        " tensor parallelism inside a node (blocks split over its devices, FSDP across nodes) they do",
        "FSDP divides the model state but not the activations: every rank keeps those of its own"
        " micro-batch. Tensor parallelism also splits what happens inside a block, so its activations too",
        _rule_tensor_parallel_fits,
    ),
    Rule(
        7,
        "fsdp_blocks",
        "otherwise",
        "sharding over every rank gives the smallest model state per rank",
        _rule_otherwise,
    ),
)


def rules_markdown() -> str:
    """The decision table as a Markdown table (printed in the documentation)."""
    lines = ["| # | when | use | why |", "|---|---|---|---|"]
    for rule in RULES:
        use = f"`{rule.strategy}`" + (f" with `{rule.argument}`" if rule.argument else "")
        lines.append(f"| {rule.number} | {rule.when} | {use} | {rule.why} |")
    return "\n".join(lines)


# --- the advice -----------------------------------------------------------------------------------------


@dataclass
class Advice:
    """The memory table and the recommendation for one model on one cluster shape.

    Attributes:
        params: parameters of the model (all of them: their bytes are stored).
        trainable_params: parameters that get gradients and optimizer state.
        devices: devices (ranks) per node.
        nodes: nodes.
        memory_bytes: memory of one device.
        memory_headroom: the share of ``memory_bytes`` a strategy must leave free to fit.
        device_type: ``"cuda"``: :data:`CUDA_RESERVED_BYTES` per process are not available either.
        precision: the Lightning precision flag the accounting uses.
        rows: per-rank memory of every strategy, in table order.
        expert_parallel_size: the expert-parallel size of the FSDP+EP row (:func:`expert_parallel_choice`;
            1: no such row); rule 5 chooses it.
        recommendation: the registry name of the strategy the rules choose (its arguments:
            :attr:`strategy_arguments`).
        rule: the rule that chose it.
        evaluations: ``(rule, holds, evidence)`` of every rule evaluated, in order, up to the chosen one.
        warnings: problems with the recommendation (it does not fit either, ...).
    """

    params: int
    trainable_params: int
    devices: int
    nodes: int
    memory_bytes: float
    memory_source: str
    precision: str
    bytes: PrecisionBytes
    model: ModelSummary | None = None
    largest_block_params: int | None = None
    rows: list[MemoryRow] = field(default_factory=list)
    recommendation: str = ""
    rule: Rule | None = None
    evaluations: list[tuple[Rule, bool | None, str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    memory_headroom: float = DEFAULT_MEMORY_HEADROOM
    device_type: str = "cuda"
    expert_parallel_size: int = 1

    @property
    def strategy_arguments(self) -> dict[str, Any]:
        """The arguments the chosen rule sets on the recommended strategy (rule 5: ``expert_parallel_size``)."""
        if self.rule is not None and self.rule.argument and self.expert_parallel_size > 1:
            return {"expert_parallel_size": self.expert_parallel_size}
        return {}

    @property
    def choice(self) -> str:
        """The recommendation with its arguments: ``fsdp_blocks(expert_parallel_size=4)``, or the registry name."""
        if self.strategy_arguments:
            return expert_parallel_label(self.expert_parallel_size)
        return self.recommendation

    @property
    def usable_bytes(self) -> float:
        """What a strategy's bytes per rank may reach and still fit (:func:`usable_memory`)."""
        return usable_memory(
            self.memory_bytes, memory_headroom=self.memory_headroom, device_type=self.device_type
        )

    def usable_phrase(self) -> str:
        """``"71.00 GB usable of 80.00 GB"``: the bound every rule compares with."""
        usable, total = (
            format_bytes(self.usable_bytes, decimal=True),
            format_bytes(self.memory_bytes, decimal=True),
        )
        return f"{usable} usable of {total}"

    def headroom_phrase(self) -> str:
        """How the usable bytes follow from the device's, in words."""
        reserved = (
            f" and {format_bytes(CUDA_RESERVED_BYTES, decimal=True)} for the CUDA context and NCCL"
            if self.device_type == "cuda"
            else ""
        )
        return (
            f"{format_bytes(self.usable_bytes, decimal=True)} usable: {format_bytes(self.memory_bytes, decimal=True)}"
            f" less {self.memory_headroom:.0%} headroom{reserved}"
        )

    @property
    def world_size(self) -> int:
        return self.devices * self.nodes

    @property
    def activations(self) -> ActivationEstimate | None:
        return self.model.activations if self.model is not None else None

    @property
    def block_working_bytes(self) -> float | None:
        """Largest block's parameters + gradients in compute precision (+ its activations when known)."""
        if self.largest_block_params is None:
            return None
        act = self.activations.largest_block_bytes if self.activations is not None else 0.0
        return self.largest_block_params * 2 * self.bytes.compute + act

    @property
    def block_unknown_reason(self) -> str:
        if self.model is not None:
            return f"not evaluated: {self.model.block_description or 'no transformer blocks found'}"
        return "not evaluated: the size of one block is unknown (pass a model, or block_params=)"

    def row(self, name: str) -> MemoryRow:
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(f"no row {name!r}; rows are {[r.name for r in self.rows]}")

    def verdict(self, rule: Rule, holds: bool | None) -> str:
        """How a rule's outcome reads: ``yes`` / ``no`` / ``n/a``, and for the fallback rule that holds
        although its strategy does not fit, ``last resort`` (never "yes" next to "more than")."""
        if holds and rule is RULES[-1] and not self.row("FSDP/ZeRO-3").fits:
            return "last resort"
        if holds and rule.argument and not self.row("FSDP+EP").fits:  # rule 5 holds whether it fits or not
            return "last resort"
        return {True: "yes", False: "no", None: "n/a"}[holds]

    def memory_phrase(self, row: MemoryRow) -> str:
        rel = "<=" if row.fits else ">"
        return f" {rel} {self.usable_phrase()} of device memory"

    def describe(self) -> str:
        """The recommendation and the rules that led to it, in plain text (for logs)."""
        lines = [
            f"auto_parallel: {self.params:,} parameters, {self.nodes} node(s) x {self.devices} device(s),"
            f" {format_bytes(self.memory_bytes, decimal=True)} per device ({self.memory_source}; {self.headroom_phrase()}),"
            f" precision {self.precision} ({self.bytes.params} + {self.bytes.grads} + {self.bytes.optimizer} bytes per"
            " parameter)"
        ]
        for rule, holds, evidence in self.evaluations:
            mark = self.verdict(rule, holds)
            lines.append(f"  rule {rule.number} ({rule.strategy}): {mark}: {evidence}")
        lines.append(f"  -> {self.choice} (rule {self.rule.number if self.rule else '?'})")
        lines.append(self.table_text())
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)

    def table_text(self) -> str:
        """The per-rank memory table as aligned text."""
        act = self.activations is not None
        head = ["strategy", "params", "grads", "optimizer", "model state"] + (["activations"] if act else [])
        head += ["fits"]
        body = []
        for r in self.rows:
            cells = [
                r.name + (f" ({r.strategy})" if r.strategy else ""),
                format_bytes(r.param_bytes, decimal=True),
                format_bytes(r.grad_bytes, decimal=True),
                format_bytes(r.optimizer_bytes, decimal=True),
                format_bytes(r.state_bytes, decimal=True),
            ]
            if act:
                cells.append(format_bytes(r.activation_bytes or 0.0, decimal=True))
            cells.append("yes" if r.fits else "no")
            body.append(cells)
        widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
        fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
        return "\n".join("  " + fmt.format(*row) for row in [head, *body])

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly form (``lit-parallel advise --json``)."""
        return {
            "params": self.params,
            "trainable_params": self.trainable_params,
            "devices": self.devices,
            "nodes": self.nodes,
            "memory_gb": self.memory_bytes / GB,
            "memory_headroom": self.memory_headroom,
            "device_type": self.device_type,
            "usable_gb": self.usable_bytes / GB,
            "precision": self.precision,
            "bytes_per_param": {
                "params": self.bytes.params,
                "grads": self.bytes.grads,
                "optimizer": self.bytes.optimizer,
            },
            "rows": [
                {
                    "name": r.name,
                    "strategy": r.strategy,
                    "param_gb": r.param_bytes / GB,
                    "grad_gb": r.grad_bytes / GB,
                    "optimizer_gb": r.optimizer_bytes / GB,
                    "state_gb": r.state_bytes / GB,
                    "activation_gb": None if r.activation_bytes is None else r.activation_bytes / GB,
                    "fits": r.fits,
                    "host_copy_gb": None if r.host_copy_bytes is None else r.host_copy_bytes / GB,
                }
                for r in self.rows
            ],
            "recommendation": self.recommendation,
            "strategy_arguments": self.strategy_arguments,
            "expert_parallel_size": self.expert_parallel_size,
            "rule": self.rule.number if self.rule else None,
            "evaluations": [
                {"rule": rule.number, "strategy": rule.strategy, "holds": holds, "evidence": ev}
                for rule, holds, ev in self.evaluations
            ],
            "block_working_gb": None if self.block_working_bytes is None else self.block_working_bytes / GB,
            "warnings": list(self.warnings),
        }


def advise(
    params: int | None = None,
    *,
    model: nn.Module | type | str | None = None,
    devices: int = 1,
    nodes: int = 1,
    memory_gb: float | None = None,
    precision: str = "bf16-mixed",
    block_params: int | None = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
    model_kwargs: dict[str, Any] | None = None,
    example_inputs: Any = None,
    block_types: Any = "auto",
    memory_headroom: float = DEFAULT_MEMORY_HEADROOM,
    device_type: str | None = None,
) -> Advice:
    """Per-rank memory of every strategy and the strategy :data:`RULES` choose.

    Args:
        params: number of parameters (``7e9`` works); or give ``model``.
        model: an ``nn.Module`` (a LightningModule works), its class, or ``"package.module:Class"``
            (built with ``model_kwargs`` on the meta device: no memory is used). Gives the parameter
            count, the largest transformer block, and an activation estimate from one traced forward.
        devices: devices (ranks) per node.
        nodes: number of nodes.
        memory_gb: memory of one device in GB (1e9 bytes); default: the first CUDA device's, or this
            machine's RAM divided by ``devices`` without CUDA.
        precision: a Lightning precision flag: ``"bf16-mixed"`` / ``"16-mixed"`` (2 + 2 + 12 bytes per
            parameter), ``"32-true"`` (4 + 4 + 8), ``"bf16-true"`` / ``"16-true"`` (2 + 2 + 4).
        block_params: parameters of the largest transformer block, when only ``params`` is given
            (rule 2 is not evaluated without it).
        batch_size: per-rank micro-batch for the activation estimate (default: the example's, or 1).
        seq_len: sequence length of made-up token inputs (default: the model's ``block_size`` /
            ``max_seq_len`` / ... attribute).
        example_inputs: the input to trace (default: ``model.example_input_array``, or tokens when the
            model starts with an ``nn.Embedding``).
        block_types: how to find the transformer blocks (as in ``fsdp_blocks``; default ``"auto"``).
        memory_headroom: the share of device memory a strategy must leave free to fit (default 0.10):
            the caching allocator's fragmentation and temporaries the accounting does not count.
        device_type: the type of the device the memory is of (``"cuda"``, ``"cpu"``, ...); on ``"cuda"``
            :data:`CUDA_RESERVED_BYTES` per process (CUDA context, NCCL buffers) are not usable either.
            Default: ``"cpu"`` when the memory is this machine's RAM (no ``memory_gb``, no CUDA),
            else ``"cuda"``.
    """
    _check_arguments(params, model, devices, nodes)
    precision = canonical_precision(precision)
    bytes_ = precision_bytes(precision)
    summary = None
    if model is not None:
        summary = summarize_model(
            model,
            precision=precision,
            batch_size=batch_size,
            seq_len=seq_len,
            model_kwargs=model_kwargs,
            example_inputs=example_inputs,
            block_types=block_types,
        )
        params = summary.params
        block_params = summary.largest_block_params if block_params is None else block_params
    advice = _measure(
        params,
        block_params,
        summary,
        devices,
        nodes,
        memory_gb,
        precision,
        bytes_,
        memory_headroom,
        device_type,
        block_types,
    )
    _apply_rules(advice)
    return advice


def _check_arguments(params: Any, model: Any, devices: Any, nodes: Any) -> None:
    if (params is None) == (model is None):
        raise ValueError("give exactly one of params= (a number of parameters) or model= (a module or class)")
    for name, value in (("devices", devices), ("nodes", nodes)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")


def _measure(
    params: Any,
    block_params: Any,
    summary: ModelSummary | None,
    devices: int,
    nodes: int,
    memory_gb: float | None,
    precision: str,
    bytes_: PrecisionBytes,
    memory_headroom: float = DEFAULT_MEMORY_HEADROOM,
    device_type: str | None = None,
    block_types: Any = "auto",
) -> Advice:
    """The advice before the rules: the counts checked, the device memory, and the memory table."""
    params, block_params = _checked_counts(params, block_params)
    memory_bytes, source = _device_memory(memory_gb, devices)
    if device_type is None:
        device_type = "cpu" if source.startswith("CPU RAM") else "cuda"
    usable = _checked_usable(memory_bytes, memory_headroom, device_type)
    ep = expert_parallel_choice(summary, devices)[0] or 1
    advice = Advice(
        params=params,
        trainable_params=summary.trainable_params if summary is not None else params,
        devices=devices,
        nodes=nodes,
        memory_bytes=memory_bytes,
        memory_source=source,
        precision=precision,
        bytes=bytes_,
        model=summary,
        largest_block_params=block_params,
        memory_headroom=memory_headroom,
        device_type=device_type,
        expert_parallel_size=ep,
    )
    advice.rows = memory_table(
        params,
        devices=devices,
        nodes=nodes,
        precision=precision,
        memory_bytes=usable,
        trainable_params=advice.trainable_params,
        tp_split_params=summary.block_params if summary is not None and summary.num_blocks else None,
        activations=advice.activations,
        expert_params=summary.expert_params if summary is not None else 0,
        expert_parallel=ep,
        param_tensors=summary.param_tensors if summary is not None else 0,
        buffer_bytes=summary.buffer_bytes if summary is not None else 0,
        device_type=device_type,
    )
    if summary is not None and summary.module is not None:
        # the model's shapes are known: each row is the state of the rank holding the most (padded shards,
        # what tensor parallelism replicates), as a dry run of the strategy finds it
        advice.rows, notes = exact_rows(
            advice.rows,
            summary.module,
            devices=devices,
            nodes=nodes,
            precision=precision,
            memory_bytes=usable,
            block_types=block_types,
            expert_parallel=ep,
        )
        advice.model = replace(summary, notes=(*summary.notes, *notes))
    return advice


def _checked_usable(memory_bytes: float, memory_headroom: Any, device_type: Any) -> float:
    if not isinstance(device_type, str):
        raise ValueError(
            f"device_type={device_type!r} must be a device type, 'cuda' or 'cpu' (the device the memory is of)"
        )
    if isinstance(memory_headroom, bool) or not isinstance(memory_headroom, (int, float)):
        raise ValueError(f"memory_headroom={memory_headroom!r} must be a fraction of device memory, e.g. 0.1")
    if not 0 <= memory_headroom < 1:
        raise ValueError(
            f"memory_headroom={memory_headroom!r} must be at least 0 and below 1 (a fraction of device memory"
            f" kept free; default {DEFAULT_MEMORY_HEADROOM})"
        )
    usable = usable_memory(memory_bytes, memory_headroom=memory_headroom, device_type=device_type)
    if usable <= 0:
        raise ValueError(
            f"{format_bytes(memory_bytes, decimal=True)} per device leaves nothing to train in after"
            f" {memory_headroom:.0%} headroom and the {format_bytes(CUDA_RESERVED_BYTES, decimal=True)} a CUDA"
            " process reserves (CUDA context, NCCL buffers): give the device's real memory (memory_gb), or"
            " device_type='cpu' when it is not a GPU"
        )
    return usable


def _checked_counts(params: Any, block_params: Any) -> tuple[int, int | None]:
    params = _as_count(params, "params")
    if params < 1:
        raise ValueError(f"params={params} must be at least 1")
    if params > MAX_PARAMS:
        raise ValueError(
            f"params={params:.3g} is more than {MAX_PARAMS:.0e} parameters, far beyond any model trained;"
            " check the exponent (7e9 is seven billion)"
        )
    if block_params is not None:
        block_params = _as_count(block_params, "block_params")
        if not 0 < block_params <= params:
            raise ValueError(f"block_params={block_params:,} must be between 1 and params={params:,}")
    return params, block_params


def _apply_rules(advice: Advice) -> None:
    """Evaluate :data:`RULES` in order until one holds; warn when the choice cannot work as it stands."""
    for rule in RULES:
        holds, evidence = rule.check(advice)
        advice.evaluations.append((rule, holds, evidence))
        if holds:
            advice.recommendation, advice.rule = rule.strategy, rule
            break
    chosen = next((r for r in advice.rows if r.strategy == advice.choice), None)  # pp_dp: none
    if chosen is not None and not chosen.fits:
        advice.warnings.append(
            f"{advice.choice} needs {format_bytes(chosen.total_bytes, decimal=True)} per rank, more"
            f" than the {advice.usable_phrase()} of one device: add devices or nodes,"
            " turn on activation_checkpointing, lower the micro-batch, or use cpu_offload=True (fsdp_blocks)"
        )
    if advice.recommendation == "tp_dp" and advice.devices == 1:
        advice.warnings.append(
            "tp_dp splits blocks over the devices of one node, but there is one device per node: a block"
            " that does not fit one device cannot be split here"
        )


def _as_count(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r} must be a number of parameters, e.g. 7e9")
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"{name}={value!r} must be a whole number of parameters")
    return int(value)


# --- device memory --------------------------------------------------------------------------------------


def _ram_bytes() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _device_memory(memory_gb: float | None, devices: int) -> tuple[float, str]:
    if memory_gb is not None:
        if isinstance(memory_gb, bool) or not isinstance(memory_gb, (int, float)) or not memory_gb > 0:
            raise ValueError(f"memory_gb={memory_gb!r} must be a positive number of GB (1e9 bytes)")
        if not memory_gb <= MAX_MEMORY_GB:
            raise ValueError(
                f"memory_gb={memory_gb!r} is not the memory of one device (at most {MAX_MEMORY_GB:g} GB here);"
                " give a finite figure, e.g. 80 for an 80 GB GPU"
            )
        return float(memory_gb) * GB, "given"
    if torch.cuda.is_available():
        return device_memory_bytes(torch.device("cuda", 0), devices)
    return device_memory_bytes(torch.device("cpu"), devices)


def device_memory_bytes(device: torch.device, processes_per_node: int) -> tuple[float, str]:
    """Memory one rank can use on ``device``: a CUDA device's total memory, or RAM / processes on CPU."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return float(props.total_memory), f"{props.name} total memory"
    total = _ram_bytes()
    return (
        total / processes_per_node,
        f"CPU RAM {format_bytes(total, decimal=True)} / {processes_per_node} process(es)",
    )
