"""The tensor-parallel plan as data: what each module becomes, and how the plan is described in the log.

:class:`TPPlan` is what :func:`~lit_parallel.parallel.tensor_parallel.infer.infer_tp_plan` produces and
:func:`~lit_parallel.parallel.tensor_parallel.apply.apply_tp` consumes. Its description is short by default (one
line per distinct block plan, so an 80-layer model logs a few lines) and per layer with ``detail=True``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from lit_parallel.parallel.blocks import BlockPlan

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle

COLWISE = "colwise"
COLWISE_FUSED = "colwise (fused)"
ROWWISE = "rowwise"
SEQUENCE_PARALLEL = "sequence parallel"
LOSS_PARALLEL_HEAD = "colwise (loss parallel)"
REPLICATED = "replicated"


class TPPlanError(ValueError):
    """The model cannot be split as asked; the message names the module, the numbers and the fix."""


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


@dataclass(frozen=True)
class ProjectionKind:
    """A kind of module that projects its input's last dimension (``nn.Linear``, HF's transposed
    ``Conv1D``): what the planner needs to split it.

    Attributes:
        name: for messages (``"Linear"``).
        matches: ``matches(module)`` is true for modules of this kind.
        in_features, out_features: the module's input and output widths.
        out_dim: the weight dimension that holds the output features (0 for ``nn.Linear``'s
            ``(out, in)`` weight, 1 for a weight stored ``(in, out)``); the bias is always ``(out,)``.
    """

    name: str
    matches: Callable[[nn.Module], bool]
    in_features: Callable[[nn.Module], int]
    out_features: Callable[[nn.Module], int]
    out_dim: int = 0


LINEAR = ProjectionKind(
    "Linear",
    lambda m: isinstance(m, nn.Linear),
    lambda m: m.in_features,
    lambda m: m.out_features,
)

# Asked in order. Families with their own projection modules add an entry (see tp_families).
PROJECTION_KINDS: list[ProjectionKind] = [LINEAR]


def projection_kind(module: nn.Module) -> ProjectionKind | None:
    """The :class:`ProjectionKind` of ``module``, or None when it is not a projection."""
    return next((k for k in PROJECTION_KINDS if k.matches(module)), None)


def is_projection(module: nn.Module) -> bool:
    return projection_kind(module) is not None


def in_features(module: nn.Module) -> int:
    return projection_kind(module).in_features(module)


def out_features(module: nn.Module) -> int:
    return projection_kind(module).out_features(module)


def fused_permutation(sections: Sequence[int], tp: int) -> torch.Tensor:
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
        out_dims: split projections whose weight holds the output features on a dimension other
            than 0 (HF ``Conv1D``: 1) -> that dimension.
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
    out_dims: dict[str, int] = field(default_factory=dict)

    @property
    def split(self) -> list[TPLayer]:
        return [layer for layer in self.layers if layer.style not in (REPLICATED, SEQUENCE_PARALLEL)]

    @property
    def replicated(self) -> list[TPLayer]:
        return [layer for layer in self.layers if layer.style == REPLICATED]

    def describe(self, detail: bool = False) -> str:
        """One line per distinct block plan (blocks planned alike collapse into one line, shown with the
        first one's paths), then the layers outside blocks and the notes; ``detail=True``: one line per
        layer with shapes, heads and reasons."""
        head = f"tensor-parallel plan ({self.how}) for tensor_parallel_size={self.tp_size}"
        if self.fn is not None:
            return f"{head}: user function {getattr(self.fn, '__qualname__', self.fn)!r}"
        flags = [f"sequence parallel {'on' if self.sequence_parallel else 'off'}"]
        flags.append(f"loss parallel {'on' if self.loss_parallel else 'off'}")
        lines = [f"{head}; {', '.join(flags)}"]
        lines += _layer_lines(self) if detail else _block_lines(self)
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
                    dim = self.out_dims.get(path, 0) if name == "weight" else 0
                    perm = fused_permutation(sections, self.tp_size)
                    out[key] = out[key].index_select(dim, perm.to(out[key].device))
        return out


# --- descriptions ---------------------------------------------------------------------------------------


def _layer_text(layer: TPLayer, detail: bool) -> str:
    text = f"{layer.path}: {layer.style}"
    if detail and layer.detail:
        text += f" [{layer.detail}]"
    if detail and layer.reason:
        text += f" ({layer.reason})"
    return text


def _head_text(path: str, attr: str, old: int, new: int) -> str:
    return f"{path}.{attr}: {old} -> {new} per rank"


def _layer_lines(plan: TPPlan) -> list[str]:
    lines = [f"  {_layer_text(layer, detail=True)}" for layer in plan.layers]
    lines += [f"  {_head_text(*attr)}" for attr in plan.head_attributes]
    return lines


@dataclass
class _BlockGroup:
    """Blocks whose plans are the same once each block's own prefix is taken away."""

    names: list[str]
    kind: str
    layers: list[TPLayer]
    head_attributes: list[tuple[str, str, int, int]]


def _under(path: str, block: str) -> bool:
    return not block or path == block or path.startswith(block + ".")


def _relative(text: str, block: str) -> str:
    return text.replace(f"{block}.", "{block}.") if block else text


def _group_blocks(plan: TPPlan) -> tuple[list[_BlockGroup], list[TPLayer], list[tuple]]:
    """Blocks with the same relative plan; layers and head attributes outside every block."""
    groups: dict[tuple, _BlockGroup] = {}
    inside: set[int] = set()
    placed: set[int] = set()
    for name, block in plan.blocks.blocks if plan.blocks is not None else []:
        layers = [x for x in plan.layers if _under(x.path, name) and id(x) not in inside]
        attrs = [a for a in plan.head_attributes if _under(a[0], name) and id(a) not in placed]
        inside |= {id(x) for x in layers}
        placed |= {id(a) for a in attrs}
        key = (
            type(block).__name__,
            tuple((_relative(x.path, name), x.style, _relative(x.reason, name)) for x in layers),
            tuple((_relative(a[0], name), *a[1:]) for a in attrs),
        )
        if key in groups:
            groups[key].names.append(name)
        else:
            groups[key] = _BlockGroup([name], type(block).__name__, layers, attrs)
    outside = [x for x in plan.layers if id(x) not in inside]
    loose = [a for a in plan.head_attributes if id(a) not in placed]
    return list(groups.values()), outside, loose


def _names_text(names: list[str], kind: str) -> str:
    if len(names) == 1:
        return f"block {names[0]} ({kind})"
    shown = ", ".join(names) if len(names) <= 3 else f"{names[0]}, {names[1]}, ... {names[-1]}"
    return f"{len(names)} blocks {shown} ({kind}), each as {names[0]}"


def _block_lines(plan: TPPlan) -> list[str]:
    groups, outside, loose = _group_blocks(plan)
    lines = []
    for g in groups:
        items = [_layer_text(x, detail=False) for x in g.layers]
        items += [_head_text(*a) for a in g.head_attributes]
        lines.append(f"  {_names_text(g.names, g.kind)}: {'; '.join(items) or 'nothing split'}")
        reasons: dict[str, list[str]] = {}
        for x in g.layers:
            if x.reason:
                reasons.setdefault(x.reason, []).append(x.path)
        lines += [f"    replicated {', '.join(paths)}: {why}" for why, paths in reasons.items()]
    lines += [f"  {_layer_text(x, detail=True)}" for x in outside]
    lines += [f"  {_head_text(*a)}" for a in loose]
    return lines
