"""The generic block planner: which Linears of one transformer block are column / row parallel.

With a trace (:mod:`~lit_parallel.parallel.tensor_parallel.trace`) the plan follows the data flow, not names: a
Linear whose inputs are outputs of other Linears of the block only is a row-parallel layer (attention
output, MLP down projection); the Linears feeding it read the block's stream and are column-parallel
(q, k, v or a fused qkv; MLP up and gate). How each column output is reshaped into heads and split into
chunks gives the divisibility rules. Without a trace the plan falls back to the module structure: layer
shapes, definition order and a family's name hints (:class:`NameHints`). Every Linear left replicated
gets the reason.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from torch import nn

from lit_parallel.parallel.tensor_parallel.plan import (
    COLWISE,
    COLWISE_FUSED,
    REPLICATED,
    ROWWISE,
    TPLayer,
    TPPlan,
    in_features,
    is_projection,
    out_features,
    projection_kind,
)
from lit_parallel.parallel.tensor_parallel.styles import parallel_style
from lit_parallel.parallel.tensor_parallel.trace import Flow, block_width

# ``(module, what, number)``: a number the tensor-parallel size must divide
Check = tuple[str, str, int]


@dataclass(frozen=True)
class NameHints:
    """What names say about a layer's role, used only when the model cannot be traced.

    Attributes:
        row: names of layers that write back to the residual stream (attention output, MLP down).
        fused: names of Linears holding several projections (their chunk layout needs a trace).
        head_dim: integer attributes of an attention module holding its head width: a column layer
            it owns then has ``out_features / head_dim`` heads, which the split must keep whole.
    """

    row: re.Pattern
    fused: re.Pattern
    head_dim: tuple[str, ...] = ("head_dim", "attention_head_size", "key_value_proj_dim")


@dataclass
class Group:
    """Column-parallel layers feeding one row-parallel layer."""

    cols: list[str]
    row: str


@dataclass
class BlockSplit:
    """What planning one block decided, for the checks that look at all blocks together.

    Attributes:
        cols: the column-parallel layers.
        heads: head counts the split divides (head-count attributes with these values are adjusted).
        local: split layer -> its per-rank ``(in_features, out_features)`` (for the simulated forward).
        groups: column layers with the row layer they feed (traced plans only).
    """

    cols: list[str] = field(default_factory=list)
    heads: set[int] = field(default_factory=set)
    local: dict[str, tuple[int, int]] = field(default_factory=dict)
    groups: list[Group] = field(default_factory=list)


def describe_linear(lin: nn.Module) -> str:
    return f"{projection_kind(lin).name} {in_features(lin)} -> {out_features(lin)}"


def out_dim(module: nn.Module) -> int:
    """The weight dimension holding ``module``'s output features (0 for ``nn.Linear``)."""
    return projection_kind(module).out_dim


def projection_style(
    plan: TPPlan, path: str, module: nn.Module, kind: str, sections: list[int] | None = None
):
    """The ``ParallelStyle`` for projection ``module`` at ``path`` (records a transposed weight's layout)."""
    dim = out_dim(module)
    if dim:
        plan.out_dims[path] = dim
    return parallel_style(
        kind,
        sections=sections,
        sequence_parallel=plan.sequence_parallel and kind == ROWWISE,
        out_dim=dim,
    )


def _is_head_count_name(attr: str) -> bool:
    lowered = attr.lower()
    return (
        not attr.startswith("_")
        and "head" in lowered
        and not any(s in lowered for s in ("dim", "size", "width"))
    )


def head_attributes(
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
        if module is None or is_projection(module):
            continue
        for attr, value in vars(module).items():
            if isinstance(value, bool) or not isinstance(value, int) or not _is_head_count_name(attr):
                continue
            if value in heads and value % tp == 0:
                found.append((path, attr, value, value // tp))
    return found


# --- from the data flow ---------------------------------------------------------------------------------


@dataclass
class _ColInfo:
    sections: list[int] | None = None  # fused: output split into these chunks (each sharded separately)
    heads: list[int] = field(default_factory=list)  # head counts per chunk (or one entry)
    head_dim: int | None = None


def _bad_columns(block: str, cols: list[str], row: str, names: set[str], flow: Flow) -> list[str]:
    """Why these column candidates cannot feed ``row`` alone (empty when they can)."""
    out_srcs = flow.inputs.get(f"{block}:out", set())
    bad = []
    for c in cols:
        c_srcs = flow.inputs.get(c, set())
        consumers = flow.consumers(c) | ({f"{block}:out"} if c in out_srcs else set())
        if c_srcs & names:
            bad.append(f"{c} reads another Linear's output")
        elif consumers - {row}:
            bad.append(f"{c}'s output also reaches {', '.join(sorted(consumers - {row}))}")
    return bad


def _groups_from_flow(
    block: str, lins: dict[str, nn.Linear], flow: Flow
) -> tuple[list[Group], dict[str, str]]:
    """Pair column layers with the row layer they feed; every other Linear gets a reason."""
    reasons: dict[str, str] = {}
    names = set(lins)
    groups: list[Group] = []
    for row in lins:
        srcs = flow.inputs.get(row)
        if srcs is None:
            reasons[row] = "not called in the traced forward"
            continue
        from_lins, other = srcs & names, srcs - names
        if not from_lins or other:
            continue
        cols = sorted(from_lins, key=flow.order.index)
        bad = _bad_columns(block, cols, row, names, flow)
        if bad:
            for n in [*cols, row]:
                reasons[n] = "; ".join(bad)
            continue
        groups.append(Group(cols=cols, row=row))
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


def _col_info(name: str, lin: nn.Linear, row: nn.Linear, flow: Flow) -> _ColInfo:
    info = _ColInfo()
    out = out_features(lin)
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
        ratio, rem = divmod(out, in_features(row))
        if len(factors) >= 3 and rem == 0 and ratio > 1 and factors[0] == ratio:
            info.sections = [out // ratio] * ratio
            info.heads = [math.prod(factors[1:-1])] * ratio
        else:
            info.heads = [factors[0]]
        info.head_dim = factors[-1]
    return info


def _plan_column(
    c: str, lin: nn.Linear, row: nn.Linear, flow: Flow, plan: TPPlan, checks: list[Check]
) -> set[int]:
    """Add column layer ``c`` (plain or fused) to the plan; return the head counts it splits."""
    info = _col_info(c, lin, row, flow)
    detail = describe_linear(lin)
    if info.sections:
        detail += f", {len(info.sections)} chunks of {'/'.join(map(str, info.sections))}"
        for i, size in enumerate(info.sections):
            checks.append((c, f"output chunk {i} width", size))
        plan.fused[c] = info.sections
    else:
        checks.append((c, "output features", out_features(lin)))
    for i, h in enumerate(info.heads):
        label = "heads" if len(info.heads) == 1 else f"heads of chunk {i}"
        checks.append((c, label, h))
    if info.heads:
        detail += f", {'/'.join(map(str, info.heads))} heads x {info.head_dim}"
    style = COLWISE_FUSED if info.sections else COLWISE
    plan.styles[c] = projection_style(plan, c, lin, style, info.sections)
    plan.layers.append(TPLayer(c, style, detail))
    return set(info.heads)


def plan_block_traced(
    root: nn.Module, block_name: str, block: nn.Module, flow: Flow, plan: TPPlan, checks: list[Check]
) -> BlockSplit:
    """Split one block by its traced data flow: column layers feeding one row layer each."""
    tp = plan.tp_size
    prefix = f"{block_name}." if block_name else ""
    lins = {prefix + n: m for n, m in block.named_modules() if is_projection(m)}
    groups, reasons = _groups_from_flow(block_name, lins, flow)
    split = BlockSplit(groups=groups)
    for g in groups:
        row = lins[g.row]
        for c in g.cols:
            split.heads |= _plan_column(c, lins[c], row, flow, plan, checks)
            split.local[c] = (in_features(lins[c]), out_features(lins[c]) // tp)
            split.cols.append(c)
        checks.append((g.row, "input features", in_features(row)))
        plan.styles[g.row] = projection_style(plan, g.row, row, ROWWISE)
        plan.layers.append(TPLayer(g.row, ROWWISE, f"{describe_linear(row)}, fed by {', '.join(g.cols)}"))
        split.local[g.row] = (in_features(row) // tp, out_features(row))
    for n, reason in reasons.items():
        plan.layers.append(TPLayer(n, REPLICATED, describe_linear(lins[n]), reason))
    return split


# --- from the module structure --------------------------------------------------------------------------


def _flat_segments(members: list[tuple[str, nn.Linear]], width: int) -> list[list[tuple[str, nn.Linear]]]:
    """Linears defined directly in a block, in definition order, cut after each layer that writes back to
    the block width, takes what an earlier layer of the segment produced (or a multiple of it) and is
    followed by a layer that does not write back (the next region's first projection)."""
    segments, seg = [], []
    for i, (n, m) in enumerate(members):
        seg.append((n, m))
        nxt = members[i + 1][1] if i + 1 < len(members) else None
        closes = out_features(m) == width and any(out_features(x) % in_features(m) == 0 for _, x in seg[:-1])
        if closes and (nxt is None or out_features(nxt) != width):
            segments.append(seg)
            seg = []
    if seg:
        segments.append(seg)
    return segments


def _segments(block_name: str, block: nn.Module, width: int) -> list[list[tuple[str, nn.Linear]]]:
    """The block's Linears grouped by parent module; those defined directly in the block cut into regions."""
    prefix = f"{block_name}." if block_name else ""
    by_parent: dict[str, list[tuple[str, nn.Linear]]] = {}
    for n, m in block.named_modules():
        if is_projection(m):
            by_parent.setdefault((prefix + n).rsplit(".", 1)[0], []).append((prefix + n, m))
    segments: list[list[tuple[str, nn.Linear]]] = []
    for parent, members in by_parent.items():
        segments += _flat_segments(members, width) if parent == block_name else [members]
    return segments


def _segment_pair(seg: list[tuple[str, nn.Linear]], width: int, hints: NameHints):
    """``(row, cols, why)``: the row layer and its column layers, or why the segment stays replicated."""
    writers = [(n, m) for n, m in seg if out_features(m) == width]
    hinted = [(n, m) for n, m in writers if hints.row.search(n)]
    row = (hinted or writers or [None])[-1]
    cols = [(n, m) for n, m in seg if row is not None and n != row[0] and in_features(m) == width]
    if row is None or not cols:
        return row, cols, "no layer pair reading and writing back the block width"
    fused = [
        n
        for n, m in cols
        if hints.fused.search(n.rsplit(".", 1)[-1])
        or (out_features(m) != in_features(row[1]) and out_features(m) % in_features(row[1]) == 0)
    ]
    if fused:
        return (
            row,
            cols,
            (
                f"{', '.join(fused)} looks fused (several projections in one Linear); its chunk"
                " layout is only visible when the model runs"
            ),
        )
    if not any(out_features(m) == in_features(row[1]) for _, m in cols):
        return row, cols, f"no column layer produces the {in_features(row[1])} features {row[0]} reads"
    return row, cols, ""


def plan_block_structural(
    root: nn.Module, block_name: str, block: nn.Module, plan: TPPlan, checks: list[Check], hints: NameHints
) -> BlockSplit:
    """Split one block by module structure: in a group of Linears the layer writing back to the block
    width is the row layer (a name hint first, else the last one), the layers reading the block width
    are column layers. Fused layers stay replicated: their chunk layout only shows when the model runs."""
    width = block_width(block)
    split = BlockSplit()
    for seg in _segments(block_name, block, width):
        row, cols, why = _segment_pair(seg, width, hints)
        if why:
            plan.layers += [TPLayer(n, REPLICATED, describe_linear(m), why) for n, m in seg]
            continue
        for n, m in cols:
            checks.append((n, "output features", out_features(m)))
            plan.styles[n] = projection_style(plan, n, m, COLWISE)
            plan.layers.append(TPLayer(n, COLWISE, describe_linear(m)))
            split.cols.append(n)
            split.local[n] = (in_features(m), out_features(m) // plan.tp_size)
        checks.append((row[0], "input features", in_features(row[1])))
        plan.styles[row[0]] = projection_style(plan, row[0], row[1], ROWWISE)
        split.local[row[0]] = (in_features(row[1]) // plan.tp_size, out_features(row[1]))
        plan.layers.append(TPLayer(row[0], ROWWISE, describe_linear(row[1])))
        for n, m in seg:
            if n != row[0] and (n, m) not in cols:
                plan.layers.append(
                    TPLayer(n, REPLICATED, describe_linear(m), "not part of a column -> row pair")
                )
    _head_dim_checks(root, block_name, split, checks, hints)
    for path in {c.rsplit(".", 1)[0] for c in split.cols} | ({block_name} if split.cols else set()):
        for attr, value in vars(root.get_submodule(path)).items():
            if _is_head_count_name(attr) and isinstance(value, int) and not isinstance(value, bool):
                checks.append((f"{path}.{attr}", "heads", value))
                split.heads.add(value)
    return split


def _head_dim_checks(
    root: nn.Module, block_name: str, split: BlockSplit, checks: list[Check], hints: NameHints
) -> None:
    """Heads per column layer from the head width of the attention module owning it (grouped key/value
    heads included), so a split never cuts a head. Layers defined directly in the block are left out:
    there the MLP's Linears share the owner with the attention's."""
    for c in split.cols:
        path = c.rsplit(".", 1)[0] if "." in c else ""
        if path == block_name:
            continue
        owner = root.get_submodule(path)
        width = out_features(root.get_submodule(c))
        dims = [getattr(owner, a, None) for a in hints.head_dim]
        head_dim = next((d for d in dims if isinstance(d, int) and not isinstance(d, bool) and d > 0), None)
        if head_dim and width % head_dim == 0:
            checks.append((c, f"heads of {head_dim} features", width // head_dim))
