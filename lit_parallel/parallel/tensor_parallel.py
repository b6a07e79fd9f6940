"""Tensor parallelism inside transformer blocks: infer a plan, check it, apply it (no Trainer needed).

:func:`infer_tp_plan` decides, for every ``nn.Linear`` of every transformer block (found as in
:func:`~lit_parallel.parallel.find_transformer_blocks`), whether it is split column-wise, row-wise or
left replicated. It looks at the data flow, not at names: the model runs once on a tiny input (on the
meta device when the model lives there) while a ``TorchFunctionMode`` records which layer's output
reaches which layer's input. A Linear whose inputs are outputs of other Linears of the block only is a
row-parallel layer (attention output, MLP down projection); the Linears feeding it read the block's
stream and are column-parallel (q, k, v or a fused qkv; MLP up and gate). Everything else stays
replicated and is reported with the reason. The same run shows how each column output is reshaped
into heads (``view(b, t, heads, head_dim)``) and split into chunks (fused qkv), which gives the
divisibility rules; finally one rank's forward is simulated with local shapes on the meta device,
so a block that derives sizes from global attributes fails here with a clear message instead of in
the first training step. When the model cannot be run (no input can be made up), the plan falls back
to the module structure: layer shapes, definition order and common names as hints. The tracing and the
simulated forward live in :mod:`lit_parallel.parallel.tp_trace`.

:func:`apply_tp` applies a plan over a 1-D tensor-parallel mesh; it runs before activation
checkpointing, compile and FSDP (torchtitan's order)::

    plan = infer_tp_plan(model, tp_size=2, sequence_parallel=True)
    apply_tp(model, mesh["tensor_parallel"], plan)
    apply_fsdp(model, mesh["data_parallel"])

Fused layers (one Linear producing q, k and v) are split chunk by chunk: their rows are reordered so
that each rank's contiguous shard holds its heads of every chunk. State dicts (sharded and full) keep
the original layout; optimizer state keeps the reordered one (resume with the same
``tensor_parallel_size``).
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
import itertools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from lit_parallel.parallel.blocks import BlockPlan, BlockTypes, find_transformer_blocks
from lit_parallel.parallel.mesh import divisors
from lit_parallel.parallel.tp_trace import (
    _auto_trace,
    _block_width,
    _first_tensor,
    _Flow,
    _is_norm,
    _simulate,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle

PlanSpec = str | Mapping[str, "ParallelStyle"] | Callable[[nn.Module, "DeviceMesh"], None]

COLWISE = "colwise"
COLWISE_FUSED = "colwise (fused)"
ROWWISE = "rowwise"
SEQUENCE_PARALLEL = "sequence parallel"
LOSS_PARALLEL_HEAD = "colwise (loss parallel)"
REPLICATED = "replicated"

# Names that hint at a layer's role when the plan falls back to the module structure.
_ROW_HINT = re.compile(
    r"(^|[._])(o|out|down|wo|w2|c_proj|proj|fc2|fc_out|dense_4h_to_h|o_proj|out_proj|down_proj)$"
)
_FUSED_HINT = re.compile(r"(qkv|c_attn|in_proj|query_key_value|gate_up)", re.IGNORECASE)


class TPPlanError(ValueError):
    """The model cannot be split as asked; the message names the module, the numbers and the fix."""


# --- the plan -------------------------------------------------------------------------------------------


@dataclass
class TPLayer:
    """What the plan does with one module.

    Attributes:
        path: qualified name, relative to the module the plan was inferred on.
        style: ``"colwise"``, ``"colwise (fused)"``, ``"rowwise"``, ``"sequence parallel"``,
            ``"colwise (loss parallel)"`` or ``"replicated"``.
        detail: shapes, heads, chunks (for the log).
        reason: why a layer stays replicated.
    """

    path: str
    style: str
    detail: str = ""
    reason: str = ""


@dataclass
class TPPlan:
    """A tensor-parallel plan: module path -> ``ParallelStyle``, plus what :func:`apply_tp` adjusts.

    Attributes:
        tp_size: the tensor-parallel degree the plan was checked for.
        styles: what ``parallelize_module`` receives.
        layers: every module the plan looked at, with its style (replicated ones with the reason).
        head_attributes: ``(module path, attribute, global value, local value)``: integer attributes
            (head counts) that :func:`apply_tp` divides by ``tp_size``.
        sequence_parallel: norms run on 1/tp of the sequence; the stream between blocks is sharded.
        loss_parallel: the output head stays sharded over the vocabulary; run the loss (and its
            backward) under ``torch.distributed.tensor.parallel.loss_parallel()``.
        how: ``"traced"`` (data flow of one forward), ``"structural"`` (module structure only),
            ``"dict"`` or ``"function"`` (given by the user).
        notes: what the inference could not do and why (logged).
        blocks: the transformer blocks the plan covers.
        fn: a user plan function ``fn(model, tp_mesh)``.
        first_block, last_block: where the stream is split over the sequence and gathered again
            (sequence parallelism).
        fused: fused layers -> the widths of their chunks (their rows are reordered per rank).
    """

    tp_size: int
    styles: dict[str, ParallelStyle] = field(default_factory=dict)
    layers: list[TPLayer] = field(default_factory=list)
    head_attributes: list[tuple[str, str, int, int]] = field(default_factory=list)
    sequence_parallel: bool = False
    loss_parallel: bool = False
    how: str = "traced"
    notes: list[str] = field(default_factory=list)
    blocks: BlockPlan | None = None
    fn: Callable[[nn.Module, DeviceMesh], None] | None = None
    first_block: str | None = None
    last_block: str | None = None
    fused: dict[str, list[int]] = field(default_factory=dict)

    @property
    def split(self) -> list[TPLayer]:
        return [layer for layer in self.layers if layer.style not in (REPLICATED, SEQUENCE_PARALLEL)]

    @property
    def replicated(self) -> list[TPLayer]:
        return [layer for layer in self.layers if layer.style == REPLICATED]

    def describe(self) -> str:
        head = f"tensor-parallel plan ({self.how}) for tensor_parallel_size={self.tp_size}"
        if self.fn is not None:
            return f"{head}: user function {getattr(self.fn, '__qualname__', self.fn)!r}"
        flags = [f"sequence parallel {'on' if self.sequence_parallel else 'off'}"]
        flags.append(f"loss parallel {'on' if self.loss_parallel else 'off'}")
        lines = [f"{head}; {', '.join(flags)}"]
        for layer in self.layers:
            text = f"  {layer.path}: {layer.style}"
            if layer.detail:
                text += f" [{layer.detail}]"
            if layer.reason:
                text += f" ({layer.reason})"
            lines.append(text)
        for path, attr, old, new in self.head_attributes:
            lines.append(f"  {path}.{attr}: {old} -> {new} per rank")
        lines.extend(f"  note: {note}" for note in self.notes)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()

    def to_parallel_layout(self, state_dict: Mapping[str, torch.Tensor], prefix: str = "") -> dict:
        """A full state dict with fused layers' rows reordered as :func:`apply_tp` stores them (for
        ``set_model_state_dict(..., broadcast_from_rank0=True)``, which copies rows as they come)."""
        out = dict(state_dict)
        for path, sections in self.fused.items():
            for name in ("weight", "bias"):
                key = f"{prefix}{path}.{name}"
                if key in out:
                    out[key] = out[key][_fused_permutation(sections, self.tp_size)]
        return out


# --- building the plan from the data flow ---------------------------------------------------------------


@dataclass
class _Group:
    """Column-parallel layers feeding one row-parallel layer."""

    cols: list[str]
    row: str


@dataclass
class _ColInfo:
    sections: list[int] | None = None  # fused: output split into these chunks (each sharded separately)
    heads: list[int] = field(default_factory=list)  # head counts per chunk (or one entry)
    head_dim: int | None = None


def _groups_from_flow(
    block: str, lins: dict[str, nn.Linear], flow: _Flow
) -> tuple[list[_Group], dict[str, str]]:
    """Pair column layers with the row layer they feed; every other Linear gets a reason."""
    reasons: dict[str, str] = {}
    names = set(lins)
    groups: list[_Group] = []
    out_srcs = flow.inputs.get(f"{block}:out", set())
    for row in lins:
        srcs = flow.inputs.get(row)
        if srcs is None:
            reasons[row] = "not called in the traced forward"
            continue
        from_lins, other = srcs & names, srcs - names
        if not from_lins or other:
            continue
        cols = sorted(from_lins, key=flow.order.index)
        bad = []
        for c in cols:
            c_srcs = flow.inputs.get(c, set())
            consumers = flow.consumers(c) | ({f"{block}:out"} if c in out_srcs else set())
            if c_srcs & names:
                bad.append(f"{c} reads another Linear's output")
            elif consumers - {row}:
                bad.append(f"{c}'s output also reaches {', '.join(sorted(consumers - {row}))}")
        if bad:
            for n in [*cols, row]:
                reasons[n] = "; ".join(bad)
            continue
        groups.append(_Group(cols=cols, row=row))
    grouped = {n for g in groups for n in [*g.cols, g.row]}
    # A row whose inputs come through a norm inside the region (per-head q/k norms) is not split.
    for row in lins:
        if row in grouped or row in reasons:
            continue
        srcs = flow.inputs.get(row, set())
        if srcs & names and srcs - names:
            inner = sorted(srcs - names)
            reasons[row] = (
                f"its input mixes Linear outputs with {', '.join(inner)}; plan='auto' splits no norm inside a region"
            )
            for c in srcs & names:
                reasons.setdefault(c, f"feeds {row}, which is not split")
    for n in lins:
        if n not in grouped and n not in reasons:
            reasons[n] = "its output does not feed a single row-parallel layer"
    return groups, reasons


def _col_info(name: str, lin: nn.Linear, row: nn.Linear, flow: _Flow) -> _ColInfo:
    info = _ColInfo()
    out = lin.out_features
    splits = flow.splits.get(name)
    views = flow.views.get(name, [])
    if splits and sum(splits) == out:
        info.sections = list(splits)
        for size in splits:
            per = [f for features, f in views if features == size]
            if per:
                info.heads.append(math.prod(per[0][:-1]))
                info.head_dim = per[0][-1]
        return info
    whole = [f for features, f in views if features == out]
    if whole:
        factors = whole[0]
        ratio, rem = divmod(out, row.in_features)
        if len(factors) >= 3 and rem == 0 and ratio > 1 and factors[0] == ratio:
            info.sections = [out // ratio] * ratio
            info.heads = [math.prod(factors[1:-1])] * ratio
        else:
            info.heads = [factors[0]]
        info.head_dim = factors[-1]
    return info


def _check_divisible(checks: list[tuple[str, str, int]], tp: int) -> None:
    """``(module, what, number)``: refuse when ``tp`` does not divide a number; say which sizes would."""
    bad = [(m, what, n) for m, what, n in checks if n % tp]
    if not bad:
        return
    ok = [str(d) for d in divisors(math.gcd(*[n for _, _, n in checks]))]
    choices = ok[0] if len(ok) == 1 else ", ".join(ok[:-1]) + " or " + ok[-1]
    lines = [f"  {m}: {what} = {n} is not divisible by {tp}" for m, what, n in bad]
    raise TPPlanError(
        f"tensor_parallel_size={tp} cannot split these layers evenly (each rank must hold whole heads and"
        " equal shares of every split dimension):\n"
        + "\n".join(lines)
        + f"\nChoose tensor_parallel_size from {choices}, or pass plan={{...}} that leaves these layers"
        " replicated."
    )


def _is_head_count_name(attr: str) -> bool:
    lowered = attr.lower()
    return (
        not attr.startswith("_")
        and "head" in lowered
        and not any(s in lowered for s in ("dim", "size", "width"))
    )


def _head_attributes(
    block_name: str, block: nn.Module, col_paths: list[str], heads: set[int], tp: int, root: nn.Module
) -> list[tuple[str, str, int, int]]:
    """Integer attributes named like head counts (``n_heads``, ``num_key_value_heads``) on the block or
    on the modules that own its column layers, whose value is a head count this plan splits."""
    named = dict(root.named_modules())
    owners = {block_name}
    for path in col_paths:
        parts = path.split(".")
        for i in range(len(block_name.split(".")) if block_name else 0, len(parts)):
            owners.add(".".join(parts[:i]))
    found = []
    for path in sorted(owners):
        module = named.get(path)
        if module is None or isinstance(module, nn.Linear):
            continue
        for attr, value in vars(module).items():
            if isinstance(value, bool) or not isinstance(value, int) or not _is_head_count_name(attr):
                continue
            if value in heads and value % tp == 0:
                found.append((path, attr, value, value // tp))
    return found


# --- styles ---------------------------------------------------------------------------------------------


def _fused_permutation(sections: Sequence[int], tp: int) -> torch.Tensor:
    """Row order ``[chunk0 part0, chunk1 part0, ..., chunk0 part1, ...]``: rank r's contiguous shard
    then holds the r-th part of every chunk (its heads of q, k and v)."""
    starts = list(itertools.accumulate([0, *sections[:-1]]))
    return torch.cat(
        [
            torch.arange(start + r * (size // tp), start + (r + 1) * (size // tp))
            for r in range(tp)
            for start, size in zip(starts, sections)
        ]
    )


@functools.cache
def _styles():
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
    from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel

    class FusedColwiseParallel(ColwiseParallel):
        """Column-parallel for a Linear whose output is split into chunks (fused q/k/v, gate/up): each
        chunk is sharded separately, so every rank computes its heads of every chunk.

        The weight's rows are reordered before sharding; ``state_dict()`` / ``load_state_dict()`` convert
        from and to the original layout (sharded over the input dimension, never gathered whole).
        """

        def __init__(self, sections: Sequence[int], **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.sections = list(sections)

        def _partition_linear_fn(self, name, module, device_mesh):
            tp = device_mesh.size()
            perm = _fused_permutation(self.sections, tp)
            with torch.no_grad():
                for param in list(module.parameters(recurse=False)):
                    param.data = param.data[perm.to(param.device)]
            super()._partition_linear_fn(name, module, device_mesh)
            _register_layout_hooks(module, perm)

        def __repr__(self) -> str:
            return f"FusedColwiseParallel(sections={self.sections})"

    class SequenceParallelNorm(SequenceParallel):
        """A norm on this rank's part of the sequence whose output feeds column-parallel layers only: the
        output is gathered once (all-gather) and handed on as a replicated DTensor, so in backward those
        layers' input gradients are reduce-scattered back to the sequence shards."""

        def _apply(self, module, device_mesh):
            return distribute_module(
                module,
                device_mesh,
                self._replicate_module_fn,
                partial(SequenceParallel._prepare_input_fn, self.sequence_sharding),
                _gather_output,
            )

        def __repr__(self) -> str:
            return "SequenceParallelNorm()"

    def _gather_output(module, outputs, device_mesh):
        return outputs.redistribute(placements=[Replicate()] * device_mesh.ndim)

    def _register_layout_hooks(module: nn.Module, perm: torch.Tensor) -> None:
        inverse = torch.argsort(perm)

        def reorder(value: torch.Tensor, index: torch.Tensor, placements_for_local) -> torch.Tensor:
            if not isinstance(value, DTensor):
                return value[index.to(value.device)]
            mesh = value.device_mesh
            target = placements_for_local(value)
            v = value.redistribute(mesh, target)
            local = v.to_local()[index.to(v.to_local().device)]
            return DTensor.from_local(local, mesh, target, shape=v.shape, stride=v.stride(), run_check=False)

        def safe_placements(value):
            # dim 0 must be whole on each rank to reorder it locally: shard dim 1 instead (2-D weight)
            if value.dim() >= 2:
                return [Shard(1)] * value.device_mesh.ndim
            return [Replicate()] * value.device_mesh.ndim

        def to_original(mod, state_dict, prefix, local_metadata):
            for n, _ in mod.named_parameters(recurse=False):
                key = prefix + n
                if key in state_dict and isinstance(state_dict[key], torch.Tensor):
                    state_dict[key] = reorder(state_dict[key].detach(), inverse, safe_placements)

        def from_original(mod, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
            for n, param in mod.named_parameters(recurse=False):
                key = prefix + n
                value = state_dict.get(key)
                if not isinstance(value, torch.Tensor) or value is param:
                    continue
                if isinstance(value, DTensor):
                    value = reorder(value, perm, safe_placements).redistribute(
                        param.device_mesh, param.placements
                    )
                elif isinstance(param, DTensor):
                    from torch.distributed.tensor import distribute_tensor

                    value = distribute_tensor(
                        value[perm.to(value.device)].to(param.device),
                        param.device_mesh,
                        param.placements,
                        src_data_rank=None,
                    )
                state_dict[key] = value

        module.register_state_dict_post_hook(to_original)
        module.register_load_state_dict_pre_hook(from_original)

    return FusedColwiseParallel, SequenceParallelNorm


def _parallel_style(kind: str, *, sections: Sequence[int] | None = None, sequence_parallel: bool = False):
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    fused_cls, sp_norm_cls = _styles()
    if kind == COLWISE:
        return ColwiseParallel()
    if kind == COLWISE_FUSED:
        return fused_cls(sections or [])
    if kind == ROWWISE:
        return RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()
    if kind == SEQUENCE_PARALLEL:
        return sp_norm_cls()
    if kind == LOSS_PARALLEL_HEAD:
        return ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    raise ValueError(kind)


# --- inference ------------------------------------------------------------------------------------------


def _describe_linear(lin: nn.Linear) -> str:
    return f"Linear {lin.in_features} -> {lin.out_features}"


def _plan_block_traced(
    root: nn.Module, block_name: str, block: nn.Module, flow: _Flow, tp: int, plan: TPPlan, checks: list
) -> tuple[dict[str, tuple[int, int]], set[int], list[_Group]]:
    prefix = f"{block_name}." if block_name else ""
    lins = {prefix + n: m for n, m in block.named_modules() if isinstance(m, nn.Linear)}
    groups, reasons = _groups_from_flow(block_name, lins, flow)
    local: dict[str, tuple[int, int]] = {}
    heads: set[int] = set()
    for g in groups:
        row = lins[g.row]
        for c in g.cols:
            lin = lins[c]
            info = _col_info(c, lin, row, flow)
            detail = _describe_linear(lin)
            if info.sections:
                detail += f", {len(info.sections)} chunks of {'/'.join(map(str, info.sections))}"
                for i, size in enumerate(info.sections):
                    checks.append((c, f"output chunk {i} width", size))
                plan.fused[c] = info.sections
            else:
                checks.append((c, "output features", lin.out_features))
            for i, h in enumerate(info.heads):
                label = "heads" if len(info.heads) == 1 else f"heads of chunk {i}"
                checks.append((c, label, h))
                heads.add(h)
            if info.heads:
                detail += f", {'/'.join(map(str, info.heads))} heads x {info.head_dim}"
            style = COLWISE_FUSED if info.sections else COLWISE
            plan.styles[c] = _parallel_style(style, sections=info.sections)
            plan.layers.append(TPLayer(c, style, detail))
            local[c] = (lin.in_features, lin.out_features // tp)
        checks.append((g.row, "input features", row.in_features))
        plan.styles[g.row] = _parallel_style(ROWWISE, sequence_parallel=plan.sequence_parallel)
        plan.layers.append(TPLayer(g.row, ROWWISE, f"{_describe_linear(row)}, fed by {', '.join(g.cols)}"))
        local[g.row] = (row.in_features // tp, row.out_features)
    for n, reason in reasons.items():
        plan.layers.append(TPLayer(n, REPLICATED, _describe_linear(lins[n]), reason))
    return local, heads, groups


def _check_sequence_parallel(
    blocks: list[tuple[str, nn.Module]], flow: _Flow, block_groups: dict[str, list[_Group]], root: nn.Module
) -> dict[str, set[str]]:
    """Norms to run sequence-parallel per block; raise when the blocks are not pre-norm and chained."""
    problems = []
    sp_norms: dict[str, set[str]] = {}
    for i, (name, block) in enumerate(blocks):
        prefix = f"{name}." if name else ""
        norms = {prefix + n for n, m in block.named_modules() if _is_norm(m)}
        groups = block_groups[name]
        cols = {c for g in groups for c in g.cols}
        rows = {g.row for g in groups}
        stream = {f"{name}:in"} | rows
        args = flow.block_args[name][0]
        x = next((a for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor)), None)
        if x is None or x.dim() != 3:
            problems.append(f"{name}: its input is not (batch, sequence, features)")
            continue
        if i > 0 and flow.inputs.get(f"{name}:in") != {f"{blocks[i - 1][0]}:out"}:
            problems.append(f"{name} is not fed directly by {blocks[i - 1][0]}")
        for c in cols:
            srcs = flow.inputs.get(c, set())
            if srcs & stream:
                problems.append(f"{c} reads the residual stream without a norm in between (post-norm block)")
        used = set()
        for n in norms:
            consumers = flow.consumers(n) | (
                {f"{name}:out"} if n in flow.inputs.get(f"{name}:out", set()) else set()
            )
            if not consumers:
                continue
            if consumers <= cols:
                used.add(n)
            else:
                problems.append(
                    f"{n}'s output reaches {', '.join(sorted(consumers - cols))}, not only split layers"
                )
        if not groups:
            problems.append(f"{name} has no split layers")
        sp_norms[name] = used
    if problems:
        raise TPPlanError(
            "sequence_parallel=True needs pre-norm blocks that are called one after the other (norm ->"
            " column-parallel layers, row-parallel output added to the residual stream); here:\n  "
            + "\n  ".join(dict.fromkeys(problems))
            + "\nUse sequence_parallel=False, or pass a plan={module: ParallelStyle} written for this model."
        )
    return sp_norms


def _flat_segments(members: list[tuple[str, nn.Linear]], width: int) -> list[list[tuple[str, nn.Linear]]]:
    """Linears defined directly in a block, in definition order, cut after each layer that writes back to
    the block width, takes what an earlier layer of the segment produced (or a multiple of it) and is
    followed by a layer that does not write back (the next region's first projection)."""
    segments, seg = [], []
    for i, (n, m) in enumerate(members):
        seg.append((n, m))
        nxt = members[i + 1][1] if i + 1 < len(members) else None
        closes = m.out_features == width and any(x.out_features % m.in_features == 0 for _, x in seg[:-1])
        if closes and (nxt is None or nxt.out_features != width):
            segments.append(seg)
            seg = []
    if seg:
        segments.append(seg)
    return segments


def _plan_structural(
    root: nn.Module, blocks: list[tuple[str, nn.Module]], tp: int, plan: TPPlan, checks: list
) -> None:
    """Split by module structure: Linears grouped by parent module (or cut into segments when defined
    directly in the block); in a group the layer writing back to the block width is the row layer (a
    name hint first, else the last one), the layers reading the block width are column layers. Fused
    layers stay replicated: their chunk layout only shows when the model runs."""
    named = dict(root.named_modules())
    for block_name, block in blocks:
        prefix = f"{block_name}." if block_name else ""
        width = _block_width(block)
        by_parent: dict[str, list[tuple[str, nn.Linear]]] = {}
        for n, m in block.named_modules():
            if isinstance(m, nn.Linear):
                by_parent.setdefault((prefix + n).rsplit(".", 1)[0], []).append((prefix + n, m))
        segments: list[list[tuple[str, nn.Linear]]] = []
        for parent, members in by_parent.items():
            segments += _flat_segments(members, width) if parent == block_name else [members]
        cols_all: list[str] = []
        for seg in segments:
            writers = [(n, m) for n, m in seg if m.out_features == width]
            hinted = [(n, m) for n, m in writers if _ROW_HINT.search(n)]
            row = (hinted or writers or [None])[-1]
            cols = [(n, m) for n, m in seg if row is not None and n != row[0] and m.in_features == width]
            why = ""
            if row is None or not cols:
                why = "no layer pair reading and writing back the block width"
            else:
                fused = [
                    n
                    for n, m in cols
                    if _FUSED_HINT.search(n.rsplit(".", 1)[-1])
                    or (m.out_features != row[1].in_features and m.out_features % row[1].in_features == 0)
                ]
                if fused:
                    why = (
                        f"{', '.join(fused)} looks fused (several projections in one Linear); its chunk"
                        " layout is only visible when the model runs"
                    )
                elif not any(m.out_features == row[1].in_features for _, m in cols):
                    why = f"no column layer produces the {row[1].in_features} features {row[0]} reads"
            if why:
                for n, m in seg:
                    plan.layers.append(TPLayer(n, REPLICATED, _describe_linear(m), why))
                continue
            for n, m in cols:
                checks.append((n, "output features", m.out_features))
                plan.styles[n] = _parallel_style(COLWISE)
                plan.layers.append(TPLayer(n, COLWISE, _describe_linear(m)))
                cols_all.append(n)
            checks.append((row[0], "input features", row[1].in_features))
            plan.styles[row[0]] = _parallel_style(ROWWISE)
            plan.layers.append(TPLayer(row[0], ROWWISE, _describe_linear(row[1])))
            for n, m in seg:
                if n != row[0] and (n, m) not in cols:
                    plan.layers.append(
                        TPLayer(n, REPLICATED, _describe_linear(m), "not part of a column -> row pair")
                    )
        heads: set[int] = set()
        for path in {c.rsplit(".", 1)[0] for c in cols_all} | ({block_name} if cols_all else set()):
            for attr, value in vars(named[path]).items():
                if _is_head_count_name(attr) and isinstance(value, int) and not isinstance(value, bool):
                    checks.append((f"{path}.{attr}", "heads", value))
                    heads.add(value)
        plan.head_attributes += _head_attributes(block_name, block, cols_all, heads, tp, root)


def _find_head(
    root: nn.Module, blocks: list[tuple[str, nn.Module]], flow: _Flow | None
) -> tuple[str, nn.Linear]:
    block_ids = {id(m) for _, b in blocks for m in b.modules()}
    outside = [(n, m) for n, m in root.named_modules() if isinstance(m, nn.Linear) and id(m) not in block_ids]
    if flow is not None and flow.output:
        hits = [(n, m) for n, m in outside if n in flow.output]
        if len(hits) == 1:
            return hits[0]
    width = _block_width(blocks[-1][1])
    candidates = [(n, m) for n, m in outside if m.in_features == width]
    if not candidates:
        raise TPPlanError(
            "loss_parallel=True needs an output head (a Linear after the last block that produces the"
            f" logits); {type(root).__name__} has no Linear outside its blocks reading width {width}"
        )
    return candidates[-1]


def infer_tp_plan(
    model: nn.Module,
    tp_size: int,
    *,
    block_types: BlockTypes | BlockPlan = "auto",
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    example_inputs: Any = None,
) -> TPPlan:
    """Infer which Linears of each transformer block are split column-wise / row-wise over ``tp_size`` ranks.

    Args:
        model: the module the plan's paths are relative to (a LightningModule works).
        tp_size: tensor-parallel degree; every split dimension and head count must be divisible by it.
        block_types: the transformer blocks (see :func:`find_transformer_blocks`) or a ready block plan.
        sequence_parallel: run each block's norms on 1/tp of the sequence (pre-norm blocks only); the
            residual stream between the first and the last block is sharded over the sequence.
        loss_parallel: keep the output head split over the vocabulary (the loss must run under
            ``loss_parallel()``; the strategy does that).
        example_inputs: what to run the model on to see its data flow: positional arguments (a tuple), a
            dict of keyword arguments, one tensor, or ``fn(model)``. ``None``: tokens of shape (2, 5) for a
            model whose single input feeds an embedding, else (2, 5, width) activations for the blocks.
            Nothing runs on real data; on a meta-device model nothing is computed at all.

    Raises:
        TPPlanError: a dimension or head count not divisible by ``tp_size``, a block that does not run
            with local shapes, or sequence/loss parallelism the model does not allow.
    """
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"tp_size={tp_size!r} must be a positive integer")
    blocks_plan = (
        block_types if isinstance(block_types, BlockPlan) else find_transformer_blocks(model, block_types)
    )
    blocks = blocks_plan.blocks
    plan = TPPlan(
        tp_size=tp_size, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel, blocks=blocks_plan
    )
    plan.first_block, plan.last_block = blocks[0][0], blocks[-1][0]
    flow, why = _auto_trace(model, blocks, example_inputs)
    checks: list[tuple[str, str, int]] = []
    if flow is None or any(name not in flow.block_args for name, _ in blocks):
        missing = [] if flow is None else [n for n, _ in blocks if n not in flow.block_args]
        plan.how = "structural"
        plan.notes.append(
            "data flow not traced ("
            + (why or f"blocks {', '.join(missing)} did not run")
            + "); split by module structure. Pass example_inputs=... for the traced plan"
        )
        if sequence_parallel:
            raise TPPlanError(
                "sequence_parallel=True needs the data flow of the blocks, but the model could not be run on"
                f" a made-up input ({plan.notes[-1]}). Pass example_inputs (or a LightningModule"
                " example_input_array), or sequence_parallel=False"
            )
        _plan_structural(model, blocks, tp_size, plan, checks)
        _check_divisible(checks, tp_size)
    else:
        block_groups: dict[str, list[_Group]] = {}
        sims: dict[type, tuple[str, nn.Module, dict, set[int]]] = {}
        for name, block in blocks:
            local, heads, groups = _plan_block_traced(model, name, block, flow, tp_size, plan, checks)
            block_groups[name] = groups
            cols = [c for g in groups for c in g.cols]
            plan.head_attributes += _head_attributes(name, block, cols, heads, tp_size, model)
            sims.setdefault(type(block), (name, block, local, heads))
        _check_divisible(checks, tp_size)
        _verify_local_run(model, flow, sims, plan)
        if sequence_parallel:
            sp_norms = _check_sequence_parallel(blocks, flow, block_groups, model)
            named = dict(model.named_modules())
            for norms in sp_norms.values():
                for n in sorted(norms):
                    plan.styles[n] = _parallel_style(SEQUENCE_PARALLEL)
                    plan.layers.append(TPLayer(n, SEQUENCE_PARALLEL, type(named[n]).__name__))
    if loss_parallel:
        name, head = _find_head(model, blocks, flow)
        tied = [n for n, p in model.named_parameters(remove_duplicate=False) if p is head.weight]
        if len(tied) > 1:
            raise TPPlanError(
                f"loss_parallel=True would split the output head {name}, but its weight is shared with"
                f" {', '.join(t for t in tied if not t.startswith(name + '.'))} (tied embeddings); use"
                " loss_parallel=False"
            )
        checks.append((name, "output features (vocabulary)", head.out_features))
        _check_divisible(checks, tp_size)
        plan.styles[name] = _parallel_style(LOSS_PARALLEL_HEAD)
        plan.layers.append(TPLayer(name, LOSS_PARALLEL_HEAD, _describe_linear(head) + ", logits sharded"))
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    plan.layers.sort(key=lambda layer: order.get(layer.path, 0))
    return plan


def _verify_local_run(model: nn.Module, flow: _Flow, sims: dict, plan: TPPlan) -> None:
    """Simulate one rank's forward of each block type: keep the head-attribute adjustments only if the
    block needs them; refuse when it runs neither way."""
    tp = plan.tp_size
    for name, block, local, _ in sims.values():
        attrs = [a for a in plan.head_attributes if a[0] == name or a[0].startswith(name + ".")]
        try:
            _simulate(name, block, flow, {}, [], model)
        except Exception as err:  # noqa: BLE001 - the block cannot run on meta at all: nothing to verify
            plan.notes.append(f"could not simulate {name} on the meta device ({type(err).__name__}: {err})")
            continue
        if tp == 1 or not local:
            continue
        try:
            _simulate(name, block, flow, local, attrs, model)
            continue
        except Exception as err:  # noqa: BLE001
            first_error = err
        if attrs:
            try:
                _simulate(name, block, flow, local, [], model)
                keep = {(a[0], a[1]) for a in attrs}
                plan.head_attributes = [a for a in plan.head_attributes if (a[0], a[1]) not in keep]
                plan.notes.append(
                    f"{name}: head-count attributes left unchanged (the block infers local heads)"
                )
                continue
            except Exception:  # noqa: BLE001
                pass
        adjusted = "".join(f"; {p}.{a} set to {new}" for p, a, _, new in attrs)
        raise TPPlanError(
            f"{name} ({type(block).__name__}) does not run when each rank holds 1/{tp} of its heads"
            f" ({type(first_error).__name__}: {first_error}{adjusted}). The block probably derives a"
            " size from the full width (x.shape[-1], a stored hidden size) for a reshape or split of a"
            " split layer's output. Fix the model to use per-rank sizes: view(b, t, -1, head_dim),"
            " .chunk(3, dim=-1) instead of .split(n_embd), reshape(b, t, -1); or pass plan={...}"
            " leaving this block replicated"
        ) from first_error


def check_tp_plan(model: nn.Module, plan: Mapping[str, ParallelStyle]) -> None:
    """A user plan ``{module_path: ParallelStyle}``: every path (``*`` wildcards allowed) must name a module."""
    from torch.distributed.tensor.parallel import ParallelStyle

    names = [n for n, _ in model.named_modules() if n]
    for path, style in plan.items():
        if not isinstance(style, ParallelStyle):
            raise TPPlanError(
                f"plan[{path!r}] = {style!r} is not a torch.distributed.tensor.parallel ParallelStyle"
                " (ColwiseParallel(), RowwiseParallel(), SequenceParallel(), ...)"
            )
        if not any(fnmatch.fnmatchcase(n, path) for n in names):
            close = difflib.get_close_matches(path, names, n=3, cutoff=0.6)
            hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            raise TPPlanError(
                f"plan names {path!r}, which is not a module of {type(model).__name__}{hint} (paths are"
                f" relative to the {type(model).__name__}, e.g. {names[min(2, len(names) - 1)]!r})"
            )


def plan_from_spec(
    model: nn.Module,
    spec: PlanSpec,
    tp_size: int,
    *,
    block_types: BlockTypes | BlockPlan = "auto",
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    example_inputs: Any = None,
) -> TPPlan:
    """``"auto"`` -> :func:`infer_tp_plan`; a dict -> checked user plan; a function -> called by :func:`apply_tp`."""
    if isinstance(spec, str):
        if spec != "auto":
            raise ValueError(
                f"plan={spec!r} must be 'auto', a dict {{module_path: ParallelStyle}} or fn(model, tp_mesh)"
            )
        return infer_tp_plan(
            model,
            tp_size,
            block_types=block_types,
            sequence_parallel=sequence_parallel,
            loss_parallel=loss_parallel,
            example_inputs=example_inputs,
        )
    if isinstance(spec, Mapping):
        check_tp_plan(model, spec)
        layers = [TPLayer(path, type(style).__name__) for path, style in spec.items()]
        return TPPlan(tp_size, dict(spec), layers, how="dict", loss_parallel=loss_parallel)
    if callable(spec):
        return TPPlan(tp_size, how="function", fn=spec, loss_parallel=loss_parallel)
    raise ValueError(
        f"plan={spec!r} must be 'auto', a dict {{module_path: ParallelStyle}} or fn(model, tp_mesh)"
    )


# --- application ----------------------------------------------------------------------------------------


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: TPPlan, *, src_data_rank: int | None = 0) -> TPPlan:
    """Split ``model`` over the 1-D ``tp_mesh`` as ``plan`` says (before AC, compile and FSDP).

    Args:
        src_data_rank: rank of ``tp_mesh`` whose weights are scattered to the others (torch's default);
            ``None`` slices each rank's own copy (no communication; the ranks must already agree, e.g.
            after a broadcast from rank 0, or on the meta device).

    Head-count attributes are divided by the tensor-parallel size; with sequence parallelism the first
    block's input is split over the sequence (dimension 1) and the last block's output gathered.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    tp = tp_mesh.size()
    if plan.tp_size != tp:
        raise TPPlanError(
            f"the plan was made for tensor_parallel_size={plan.tp_size} but the mesh has {tp} ranks;"
            " infer it again with tp_size={tp}"
        )
    if plan.fn is not None:
        plan.fn(model, tp_mesh)
        return plan
    if plan.styles:
        parallelize_module(model, tp_mesh, plan.styles, src_data_rank=src_data_rank)
    named = dict(model.named_modules())
    for path, attr, _, new in plan.head_attributes:
        setattr(named[path], attr, new)
    if plan.sequence_parallel and plan.first_block is not None:
        _install_sequence_boundaries(named[plan.first_block], named[plan.last_block], tp_mesh)
    return plan


def _install_sequence_boundaries(first: nn.Module, last: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split the stream over the sequence before the first block; gather it after the last one."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    tp = tp_mesh.size()

    def shard(module, args, kwargs):
        where = _first_tensor(args, kwargs)
        if where is None:
            return None
        kind, key = where
        x = args[key] if kind == "arg" else kwargs[key]
        if isinstance(x, DTensor):
            return None
        if x.dim() < 2 or x.shape[1] % tp:
            raise TPPlanError(
                f"sequence_parallel=True: the sequence length {x.shape[1] if x.dim() > 1 else '?'} of the"
                f" input to {type(module).__name__} (dimension 1 of shape {tuple(x.shape)}) is not divisible"
                f" by tensor_parallel_size={tp}; pad the sequences to a multiple of {tp}"
            )
        x = DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False).redistribute(placements=[Shard(1)])
        x = x.to_local()
        if kind == "arg":
            return args[:key] + (x,) + args[key + 1 :], kwargs
        return args, {**kwargs, key: x}

    def gather(module, args, out):
        if not isinstance(out, torch.Tensor) or isinstance(out, DTensor):
            return out
        y = DTensor.from_local(out, tp_mesh, [Shard(1)], run_check=False).redistribute(
            placements=[Replicate()]
        )
        return y.to_local()

    first.register_forward_pre_hook(shard, with_kwargs=True)
    last.register_forward_hook(gather)


@torch.no_grad()
def local_parameter_bytes(module: nn.Module) -> dict[str, int]:
    """Bytes of each parameter this rank holds (the local shard of a DTensor)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in module.named_parameters():
        t = p.to_local() if isinstance(p, DTensor) else p
        out[name] = t.numel() * t.element_size()
    return out
