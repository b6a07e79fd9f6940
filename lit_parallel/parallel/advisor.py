"""Which strategy fits: per-rank model-state memory for every strategy, and the one ordered rule table.

Memory follows ZeRO's accounting (Rajbhandari et al. 2020) for Adam: with mixed precision every
parameter costs 2 bytes (fp16/bf16 parameter) + 2 bytes (gradient) + 12 bytes (fp32 master weight,
momentum and variance) = 16 bytes; in fp32 it costs 4 + 4 + 8. Each strategy divides what it shards by
the number of ranks it shards over (:func:`~lit_parallel.parallel.estimate_memory` does the dividing):

============  ================================  ================================================
row           shards                            over
============  ================================  ================================================
DDP           nothing                           -
ZeRO-1        optimizer state                   all ranks
ZeRO-2        optimizer state + gradients       all ranks
FSDP/ZeRO-3   + parameters                      all ranks
HSDP          everything                        the devices of one node (replicated across nodes)
TP+DP         everything                        tensor parallel inside a node x FSDP across nodes
============  ================================  ================================================

GB means 10^9 bytes. :data:`RULES` is the decision table; :func:`advise` evaluates it, the
``auto_parallel`` strategy calls :func:`advise` at setup, and the documentation prints
:func:`rules_markdown`. Nothing here imports Lightning.
"""

from __future__ import annotations

import importlib
import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lit_parallel.parallel.blocks import NoBlocksFoundError, find_transformer_blocks
from lit_parallel.parallel.memory import estimate_memory

GB = 1e9


@dataclass(frozen=True)
class PrecisionBytes:
    """Bytes per parameter that training keeps (ZeRO's accounting), and the compute dtype's size.

    Attributes:
        params: the stored parameter (2 for fp16/bf16, 4 for fp32).
        grads: its gradient.
        optimizer: Adam's state: fp32 master weight + momentum + variance (12) with mixed precision,
            momentum + variance (8) in fp32, both in half precision (4) with ``*-true`` half precision.
        compute: bytes of one element in the compute dtype (block parameters gathered for a forward,
            their gradients, activations).
    """

    params: int
    grads: int
    optimizer: int
    compute: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


PRECISIONS: dict[str, PrecisionBytes] = {
    "bf16-mixed": PrecisionBytes(2, 2, 12, 2),
    "16-mixed": PrecisionBytes(2, 2, 12, 2),
    "32-true": PrecisionBytes(4, 4, 8, 4),
    "bf16-true": PrecisionBytes(2, 2, 4, 2),
    "16-true": PrecisionBytes(2, 2, 4, 2),
}
_PRECISION_ALIASES = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed", "fp32": "32-true"}


def precision_bytes(precision: str) -> PrecisionBytes:
    """The accounting for a Lightning precision flag (``"bf16-mixed"``, ``"32-true"``, ...)."""
    flag = _PRECISION_ALIASES.get(str(precision), str(precision))
    if flag not in PRECISIONS:
        raise ValueError(
            f"precision={precision!r} is not one of {', '.join(PRECISIONS)}; mixed precision"
            " (bf16-mixed, 16-mixed) counts 2 + 2 + 12 bytes per parameter, 32-true counts 4 + 4 + 8"
        )
    return PRECISIONS[flag]


# --- the memory table -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryRow:
    """Per-rank bytes of one strategy.

    Attributes:
        name: the row's label (``"DDP"``, ``"ZeRO-1"``, ...).
        strategy: the lit_parallel registry name that runs it (``None`` for ZeRO-1, which no strategy
            here implements).
        sharding: what is divided and over how many ranks, in words.
        activation_bytes: per-rank activations for the given micro-batch; ``None`` without a model.
        fits: model state (+ activations when known) <= the device memory.
    """

    name: str
    strategy: str | None
    sharding: str
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    activation_bytes: float | None
    fits: bool

    @property
    def state_bytes(self) -> float:
        """Parameters + gradients + optimizer state."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def total_bytes(self) -> float:
        """Model state plus activations (when known)."""
        return self.state_bytes + (self.activation_bytes or 0.0)


@dataclass(frozen=True)
class ActivationEstimate:
    """Bytes autograd keeps for backward in one forward of one micro-batch (parameters excluded).

    Attributes:
        total_bytes: the whole model.
        block_bytes: inside transformer blocks (the part tensor parallelism divides).
        largest_block_bytes: the largest single block.
        batch_size: the micro-batch the estimate is for.
        input_description: the input that was traced.
    """

    total_bytes: float
    block_bytes: float
    largest_block_bytes: float
    batch_size: int
    input_description: str


@dataclass(frozen=True)
class ModelSummary:
    """What the advisor needs to know about a model."""

    name: str
    params: int
    trainable_params: int
    largest_block_params: int | None = None
    block_params: int = 0
    num_blocks: int = 0
    block_description: str = ""
    activations: ActivationEstimate | None = None
    notes: tuple[str, ...] = ()


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


def format_size(n: float) -> str:
    """Decimal units, as the table's GB (1e9 bytes): ``3.44 GB``, ``512.0 MB``."""
    for unit, size in (("TB", 1e12), ("GB", GB), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


def _rule_fits_one_device(a: Advice) -> tuple[bool | None, str]:
    row = a.row("DDP")
    return row.fits, f"DDP needs {format_size(row.total_bytes)} per rank{a.memory_phrase(row)}"


def _rule_block_too_large(a: Advice) -> tuple[bool | None, str]:
    need = a.block_working_bytes
    if need is None:
        return None, a.block_unknown_reason
    act = (
        f" + {format_size(a.activations.largest_block_bytes)} activations"
        if a.activations is not None
        else "; activations unknown"
    )
    verdict = "more than" if need > a.memory_bytes else "fits"
    return need > a.memory_bytes, (
        f"the largest block needs {format_size(need)} ({a.largest_block_params:,} params x ({a.bytes.compute} +"
        f" {a.bytes.compute}) bytes for parameters and gradients in compute precision{act}): {verdict} one"
        f" device ({format_size(a.memory_bytes)})"
    )


def _rule_hsdp(a: Advice) -> tuple[bool | None, str]:
    row = a.row("HSDP")
    if a.nodes < 2:
        return False, "one node: nothing to replicate across nodes"
    return (
        row.fits,
        f"{a.nodes} nodes; sharded inside one node: {format_size(row.total_bytes)}{a.memory_phrase(row)}",
    )


def _rule_otherwise(a: Advice) -> tuple[bool | None, str]:
    row = a.row("FSDP/ZeRO-3")
    return (
        True,
        f"sharded over all {a.world_size} ranks: {format_size(row.total_bytes)}{a.memory_phrase(row)}",
    )


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
    Rule(
        4,
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
        lines.append(f"| {rule.number} | {rule.when} | `{rule.strategy}` | {rule.why} |")
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
        precision: the Lightning precision flag the accounting uses.
        rows: per-rank memory of every strategy, in table order.
        recommendation: the registry name of the strategy the rules choose.
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

    def memory_phrase(self, row: MemoryRow) -> str:
        rel = "<=" if row.fits else ">"
        return f" {rel} {format_size(self.memory_bytes)} of device memory"

    def describe(self) -> str:
        """The recommendation and the rules that led to it, in plain text (for logs)."""
        lines = [
            f"auto_parallel: {self.params:,} parameters, {self.nodes} node(s) x {self.devices} device(s),"
            f" {format_size(self.memory_bytes)} per device ({self.memory_source}), precision {self.precision}"
            f" ({self.bytes.params} + {self.bytes.grads} + {self.bytes.optimizer} bytes per parameter)"
        ]
        for rule, holds, evidence in self.evaluations:
            mark = {True: "yes", False: "no", None: "n/a"}[holds]
            lines.append(f"  rule {rule.number} ({rule.strategy}): {mark}: {evidence}")
        lines.append(f"  -> {self.recommendation} (rule {self.rule.number if self.rule else '?'})")
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
                format_size(r.param_bytes),
                format_size(r.grad_bytes),
                format_size(r.optimizer_bytes),
                format_size(r.state_bytes),
            ]
            if act:
                cells.append(format_size(r.activation_bytes or 0.0))
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
                }
                for r in self.rows
            ],
            "recommendation": self.recommendation,
            "rule": self.rule.number if self.rule else None,
            "evaluations": [
                {"rule": rule.number, "strategy": rule.strategy, "holds": holds, "evidence": ev}
                for rule, holds, ev in self.evaluations
            ],
            "block_working_gb": None if self.block_working_bytes is None else self.block_working_bytes / GB,
            "warnings": list(self.warnings),
        }


def memory_rows(
    params: int,
    *,
    devices: int,
    nodes: int = 1,
    precision: str = "bf16-mixed",
    trainable_params: int | None = None,
    tp_split_params: int | None = None,
) -> list[tuple[str, str | None, str, float, float, float]]:
    """``(name, strategy, sharding, param_bytes, grad_bytes, optimizer_bytes)`` per rank for every row.

    Args:
        tp_split_params: parameters tensor parallelism splits (those inside transformer blocks); the
            rest is sharded over the data-parallel ranks only. ``None``: every parameter is split.
    """
    b = precision_bytes(precision)
    world = devices * nodes
    trainable = params if trainable_params is None else trainable_params

    def split(strategy: str, shard: int | None, world_size: int) -> tuple[float, float, float]:
        # estimate_memory divides what each ZeRO stage shards. Adam's optimizer bytes per parameter
        # (12 or 8 or 4) are given as its two states of half that size each.
        kw = {"world_size": world_size, "shard_size": shard, "optimizer": "adam"}
        p = estimate_memory(params, strategy=strategy, param_dtype=b.params, **kw)
        t = estimate_memory(
            trainable, strategy=strategy, param_dtype=b.grads, optimizer_state_dtype=b.optimizer // 2, **kw
        )
        return p.param_bytes, t.grad_bytes, t.optimizer_bytes

    tp, dp = devices, nodes
    inside = params if tp_split_params is None else tp_split_params
    frac = inside / params if params else 1.0
    # TP+DP: block parameters are split over tp and sharded over dp (1/world); the rest only over dp.
    blk = split("zero3", world, world)
    rest = split("zero3", dp, dp)
    tp_row = tuple(frac * x + (1 - frac) * y for x, y in zip(blk, rest))
    return [
        ("DDP", "ddp_tuned", "nothing sharded", *split("ddp", None, world)),
        ("ZeRO-1", None, f"optimizer state / {world}", *split("zero1", world, world)),
        ("ZeRO-2", None, f"optimizer state + gradients / {world}", *split("zero2", world, world)),
        ("FSDP/ZeRO-3", "fsdp_blocks", f"everything / {world}", *split("zero3", world, world)),
        (
            "HSDP",
            "hsdp",
            f"everything / {devices} (one node), x{nodes} replicas",
            *split("hsdp", devices, world),
        ),
        (
            "TP+DP",
            "tp_dp",
            f"tensor parallel {tp} x FSDP over {dp}"
            + (f" (blocks / {world}, the rest / {dp})" if tp_split_params is not None and frac < 1 else ""),
            *tp_row,
        ),
    ]


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
    """
    if (params is None) == (model is None):
        raise ValueError("give exactly one of params= (a number of parameters) or model= (a module or class)")
    for name, value in (("devices", devices), ("nodes", nodes)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    bytes_ = precision_bytes(precision)
    summary: ModelSummary | None = None
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
        if block_params is None:
            block_params = summary.largest_block_params
    assert params is not None
    params = _as_count(params, "params")
    if params < 1:
        raise ValueError(f"params={params} must be at least 1")
    if block_params is not None:
        block_params = _as_count(block_params, "block_params")
        if not 0 < block_params <= params:
            raise ValueError(f"block_params={block_params:,} must be between 1 and params={params:,}")
    memory_bytes, source = _device_memory(memory_gb, devices)

    trainable = summary.trainable_params if summary is not None else params
    split_params = summary.block_params if summary is not None and summary.num_blocks else None
    act = summary.activations if summary is not None else None
    rows = []
    for name, strategy, sharding, p, g, o in memory_rows(
        params,
        devices=devices,
        nodes=nodes,
        precision=precision,
        trainable_params=trainable,
        tp_split_params=split_params,
    ):
        a = None
        if act is not None:
            # tensor parallelism splits what happens inside blocks; data parallelism splits nothing
            a = (
                act.block_bytes / devices + (act.total_bytes - act.block_bytes)
                if name == "TP+DP"
                else act.total_bytes
            )
        fits = p + g + o + (a or 0.0) <= memory_bytes
        rows.append(MemoryRow(name, strategy, sharding, p, g, o, a, fits))

    advice = Advice(
        params=params,
        trainable_params=trainable,
        devices=devices,
        nodes=nodes,
        memory_bytes=memory_bytes,
        memory_source=source,
        precision=precision,
        bytes=bytes_,
        model=summary,
        largest_block_params=block_params,
        rows=rows,
    )
    for rule in RULES:
        holds, evidence = rule.check(advice)
        advice.evaluations.append((rule, holds, evidence))
        if holds:
            advice.recommendation, advice.rule = rule.strategy, rule
            break
    chosen = next(r for r in rows if r.strategy == advice.recommendation)
    if not chosen.fits:
        advice.warnings.append(
            f"{advice.recommendation} needs {format_size(chosen.total_bytes)} per rank, more than the"
            f" {format_size(memory_bytes)} of one device: add devices or nodes, turn on activation_checkpointing,"
            " lower the micro-batch, or use cpu_offload=True (fsdp_blocks)"
        )
    if advice.recommendation == "tp_dp" and devices == 1:
        advice.warnings.append(
            "tp_dp splits blocks over the devices of one node, but there is one device per node: a block"
            " that does not fit one device cannot be split here"
        )
    return advice


def _as_count(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ValueError(f"{name}={value!r} must be a number of parameters, e.g. 7e9")
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"{name}={value!r} must be a whole number of parameters")
    return int(value)


def parse_count(text: str) -> int:
    """``"7e9"``, ``"7B"``, ``"350M"``, ``"1.3b"``, ``"125_000_000"`` -> a number of parameters."""
    s = str(text).strip().replace("_", "").replace(",", "")
    scale = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
    factor = 1.0
    if s and s[-1].lower() in scale:
        factor, s = scale[s[-1].lower()], s[:-1]
    try:
        value = float(s) * factor
    except ValueError:
        raise ValueError(
            f"{text!r} is not a number of parameters; write e.g. 7e9, 7B, 350M or 125000000"
        ) from None
    if not math.isfinite(value) or value < 1 or abs(value - round(value)) > 1e-6 * max(1.0, value):
        raise ValueError(f"{text!r} is not a positive whole number of parameters")
    return int(round(value))


def _ram_bytes() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _device_memory(memory_gb: float | None, devices: int) -> tuple[float, str]:
    if memory_gb is not None:
        if isinstance(memory_gb, bool) or not isinstance(memory_gb, (int, float)) or not memory_gb > 0:
            raise ValueError(f"memory_gb={memory_gb!r} must be a positive number of GB (1e9 bytes)")
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
    return total / processes_per_node, f"CPU RAM {format_size(total)} / {processes_per_node} process(es)"


# --- measuring a model ----------------------------------------------------------------------------------

_SEQ_ATTRIBUTES = (
    "block_size",
    "max_seq_len",
    "max_position_embeddings",
    "n_positions",
    "seq_len",
    "context_length",
)


def load_model_class(path: str) -> type:
    """``"package.module:Class"`` (or ``"package.module.Class"``) -> the class."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"model={path!r} must look like 'package.module:Class'")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(
            f"model={path!r}: cannot import {module_name!r} ({err}); is it on PYTHONPATH?"
        ) from err
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"model={path!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, nn.Module)) and not callable(obj):
        raise ValueError(f"model={path!r} is not an nn.Module class or a function that returns one")
    return obj


def build_on_meta(factory: Callable[..., nn.Module], kwargs: dict[str, Any] | None = None) -> nn.Module:
    """Build a model on the meta device (shapes only, no memory); runs ``configure_model`` if it has one."""
    with torch.device("meta"):
        module = factory(**(kwargs or {}))
        if not isinstance(module, nn.Module):
            raise ValueError(f"{factory!r} returned {type(module).__name__}, not an nn.Module")
        configure = getattr(module, "configure_model", None)
        if callable(configure):
            configure()
    return module


def summarize_model(
    model: nn.Module | type | str,
    *,
    precision: str = "bf16-mixed",
    batch_size: int | None = None,
    seq_len: int | None = None,
    model_kwargs: dict[str, Any] | None = None,
    example_inputs: Any = None,
    block_types: Any = "auto",
) -> ModelSummary:
    """Parameters, the largest transformer block and an activation estimate of ``model``.

    A class or import path is built on the meta device (no memory used). A built module is measured
    as it is; its forward for the activation estimate runs on meta-device stand-ins of its parameters.
    """
    if isinstance(model, str):
        model = load_model_class(model)
    if isinstance(model, nn.Module):
        name = type(model).__name__
        module = model
        if model_kwargs:
            raise ValueError("model_kwargs= is for a class or import path, not a built module")
    elif callable(model):
        name = getattr(model, "__name__", str(model))
        module = build_on_meta(model, model_kwargs)
    else:
        raise ValueError(f"model={model!r} must be an nn.Module, its class, or 'package.module:Class'")
    params = sum(p.numel() for p in module.parameters())
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    notes: list[str] = []
    try:
        plan = find_transformer_blocks(module, block_types)
    except NoBlocksFoundError as err:
        plan = None
        notes.append(str(err).split(";")[0])
    largest = None
    if plan is not None:
        largest = max(n for sizes in plan.params_per_block().values() for n in sizes)
    activations = None
    try:
        activations = estimate_activations(
            module,
            precision=precision,
            batch_size=batch_size,
            seq_len=seq_len,
            example_inputs=example_inputs,
            blocks=[m for _, m in plan.blocks] if plan is not None else (),
        )
    except _NoInput as err:
        notes.append(str(err))
    except Exception as err:  # a model that cannot run on the meta device: say so, keep the rest
        notes.append(
            f"no activation estimate: tracing the forward on the meta device failed ({type(err).__name__}:"
            f" {err}); set example_input_array to an input the forward accepts"
        )
    return ModelSummary(
        name=name,
        params=params,
        trainable_params=trainable,
        largest_block_params=largest,
        block_params=plan.block_params if plan is not None else 0,
        num_blocks=plan.num_blocks if plan is not None else 0,
        block_description=plan.describe() if plan is not None else (notes[0] if notes else ""),
        activations=activations,
        notes=tuple(notes),
    )


class _NoInput(ValueError):
    pass


def _to_meta(t: Any, dtype: torch.dtype | None = None) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    if dtype is not None and t.is_floating_point():
        return torch.empty(t.shape, dtype=dtype, device="meta")
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _example_input(module: nn.Module, batch_size: int | None, seq_len: int | None) -> tuple[tuple, str, int]:
    example = getattr(module, "example_input_array", None)
    if example is not None:
        args = example if isinstance(example, tuple) else (example,)
        b = next((a.shape[0] for a in args if isinstance(a, torch.Tensor) and a.dim()), 1)
        if batch_size is not None and batch_size != b:
            args = tuple(_resize_batch(a, batch_size) for a in args)
            b = batch_size
        shapes = ", ".join(str(tuple(a.shape)) for a in args if isinstance(a, torch.Tensor))
        return tuple(_to_meta(a) for a in args), f"example_input_array {shapes}", b
    first = next(
        (m for m in module.modules() if not list(m.children()) and any(True for _ in m.parameters(False))),
        None,
    )
    if isinstance(first, nn.Embedding):
        length = seq_len or _find_seq_len(module)
        if length is None:
            raise _NoInput(
                "no activation estimate: the model reads tokens but its sequence length is unknown; pass"
                " seq_len (--seq-len) or set example_input_array"
            )
        b = batch_size or 1
        return (torch.zeros(b, length, dtype=torch.long, device="meta"),), f"tokens ({b}, {length})", b
    raise _NoInput("no activation estimate: set example_input_array on the model (one micro-batch of input)")


def _resize_batch(t: Any, batch_size: int) -> Any:
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        return t
    return torch.empty((batch_size, *t.shape[1:]), dtype=t.dtype, device="meta")


def _find_seq_len(module: nn.Module) -> int | None:
    holders = [module]
    for attr in ("cfg", "config", "hparams", "model"):
        holders.append(getattr(module, attr, None))
        holders.append(getattr(getattr(module, "model", None), attr, None))
    for holder in holders:
        for attr in _SEQ_ATTRIBUTES:
            if holder is None:
                continue
            value = holder.get(attr) if isinstance(holder, dict) else getattr(holder, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _overrides_forward(module: nn.Module) -> bool:
    forward = type(module).forward
    return forward is not nn.Module.forward and not forward.__qualname__.startswith("LightningModule.")


def _forward_target(module: nn.Module, blocks: Sequence[nn.Module]) -> nn.Module:
    """The module whose forward to trace: ``module``, or (a LightningModule without ``forward``) the
    child that holds the blocks, e.g. ``self.model``."""
    if _overrides_forward(module) or not blocks:
        return module
    ids = {id(b) for b in blocks}
    for child in module.children():
        if _overrides_forward(child) and ids <= {id(m) for m in child.modules()}:
            return child
    return module


def _pop_hook(stack: list[int]) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any, output: Any) -> None:  # returns None: keeps the output
        stack.pop()

    return hook


def estimate_activations(
    module: nn.Module,
    *,
    precision: str = "bf16-mixed",
    batch_size: int | None = None,
    seq_len: int | None = None,
    example_inputs: Any = None,
    blocks: Sequence[nn.Module] = (),
) -> ActivationEstimate:
    """Bytes autograd saves for backward in one forward, traced on the meta device (no memory used).

    The forward runs on meta-device stand-ins of the parameters and buffers (``torch.func.functional_call``),
    in the compute dtype of ``precision``. Every tensor saved for backward is counted once (by storage);
    parameters are not activations. Saved tensors are attributed to the block running when they are
    saved.
    """
    from torch.func import functional_call

    b = precision_bytes(precision)
    dtype = torch.bfloat16 if b.compute == 2 else torch.float32
    if example_inputs is not None:
        args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
        n = next((a.shape[0] for a in args if isinstance(a, torch.Tensor) and a.dim()), 1)
        args, what = tuple(_to_meta(a) for a in args), "given example inputs"
    else:
        args, what, n = _example_input(module, batch_size, seq_len)
    args = tuple(_to_meta(a, dtype) for a in args)
    target = _forward_target(module, blocks)
    stand_ins = {
        name: torch.empty(
            p.shape, dtype=dtype if p.is_floating_point() else p.dtype, device="meta"
        ).requires_grad_(p.requires_grad and p.is_floating_point())
        for name, p in target.named_parameters()
    }
    stand_ins.update({name: _to_meta(t, dtype) for name, t in target.named_buffers()})
    param_storages = {t.untyped_storage()._cdata for t in stand_ins.values()}
    seen: dict[int, int] = {}
    owner: dict[int, int] = {}
    stack: list[int] = []
    handles = []
    for i, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(lambda m, a, i=i: stack.append(i)))
        handles.append(block.register_forward_hook(_pop_hook(stack)))

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage()._cdata
        if key not in param_storages and key not in seen:
            seen[key] = t.untyped_storage().nbytes()
            owner[key] = stack[-1] if stack else -1
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = functional_call(target, stand_ins, args, strict=False)
    finally:
        for h in handles:
            h.remove()
    del out
    per_block = [0.0] * len(blocks)
    for key, nbytes in seen.items():
        if owner[key] >= 0:
            per_block[owner[key]] += nbytes
    return ActivationEstimate(
        total_bytes=float(sum(seen.values())),
        block_bytes=float(sum(per_block)),
        largest_block_bytes=float(max(per_block, default=0.0)),
        batch_size=n,
        input_description=what,
    )


def parse_model_kwargs(text: str | None) -> dict[str, Any]:
    """``--model-kwargs '{"n_layer": 48}'`` -> a dict."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"--model-kwargs {text!r} is not JSON ({err}); write e.g. '{{\"n_layer\": 48}}'"
        ) from None
    if not isinstance(value, dict):
        raise ValueError(f"--model-kwargs {text!r} must be a JSON object, e.g. '{{\"n_layer\": 48}}'")
    return value
