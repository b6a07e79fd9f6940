"""Inferring a tensor-parallel plan for a model's transformer blocks, and checking a user's plan.

:func:`infer_tp_plan` decides, for every ``nn.Linear`` of every transformer block (found as in
:func:`~lit_parallel.parallel.find_transformer_blocks`), whether it is split column-wise, row-wise or
left replicated. The model runs once on a tiny input (on the meta device when the model lives there)
while its data flow is recorded (:mod:`~lit_parallel.parallel.tensor_parallel.trace`); each block is then planned by
the provider of its family (:mod:`~lit_parallel.parallel.tensor_parallel.families`, by default the generic data-flow
planner). Finally one rank's forward is simulated with local shapes on the meta device, so a block that
derives sizes from global attributes fails here with a clear message instead of in the first training
step. When the model cannot be run (no input can be made up), the blocks are planned from their module
structure.
"""

from __future__ import annotations

import difflib
import fnmatch
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from torch import nn

from lit_parallel.formatting import divisors, format_choices
from lit_parallel.parallel.blocks import BlockPlan, BlockTypes, find_transformer_blocks
from lit_parallel.parallel.tensor_parallel.block_plan import Check, Group, describe_linear, head_attributes
from lit_parallel.parallel.tensor_parallel.chains import plan_without_blocks
from lit_parallel.parallel.tensor_parallel.conversions import convert_for_tensor_parallel
from lit_parallel.parallel.tensor_parallel.families import provider_for
from lit_parallel.parallel.tensor_parallel.plan import (
    LOSS_PARALLEL_HEAD,
    SEQUENCE_PARALLEL,
    TPLayer,
    TPPlan,
    TPPlanError,
)
from lit_parallel.parallel.tensor_parallel.styles import parallel_style
from lit_parallel.parallel.tensor_parallel.trace import (
    Flow,
    auto_trace,
    block_width,
    is_norm,
    simulate,
    tensors_in,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle

PlanSpec = str | Mapping[str, "ParallelStyle"] | Callable[[nn.Module, "DeviceMesh"], None]

Blocks = list[tuple[str, nn.Module]]


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
            residual stream between the first and the last block is sharded.
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
    conversion_notes: list[str] = []  # modules a fused kernel keeps whole become splittable ones first
    convert_for_tensor_parallel(model, conversion_notes)
    blocks_plan = (
        block_types if isinstance(block_types, BlockPlan) else find_transformer_blocks(model, block_types)
    )
    if blocks_plan.how == "size":  # no repeated blocks: pair the Linears of its chains instead
        return plan_without_blocks(model, tp_size, sequence_parallel, loss_parallel, example_inputs)
    blocks = blocks_plan.blocks
    plan = TPPlan(
        tp_size=tp_size, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel, blocks=blocks_plan
    )
    plan.notes += conversion_notes
    plan.first_block, plan.last_block = blocks[0][0], blocks[-1][0]
    flow, why = auto_trace(model, blocks, example_inputs)
    checks: list[Check] = []
    if flow is None or any(name not in flow.block_args for name, _ in blocks):
        _plan_structural(model, blocks, flow, why, plan, checks)
    else:
        _plan_traced(model, blocks, flow, plan, checks)
    if loss_parallel:
        _add_loss_parallel_head(model, blocks, flow, plan, checks)
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    plan.layers.sort(key=lambda layer: order.get(layer.path, 0))
    return plan


def _plan_structural(
    model: nn.Module, blocks: Blocks, flow: Flow | None, why: str, plan: TPPlan, checks: list[Check]
) -> None:
    missing = [] if flow is None else [n for n, _ in blocks if n not in flow.block_args]
    plan.how = "structural"
    plan.notes.append(
        "data flow not traced ("
        + (why or f"blocks {', '.join(missing)} did not run")
        + "); split by module structure. For the traced plan, set example_input_array on the LightningModule"
        " (strategies) or pass example_inputs= (infer_tp_plan)"
    )
    if plan.sequence_parallel:
        raise TPPlanError(
            "sequence_parallel=True needs the data flow of the blocks, but the model could not be run on"
            f" a made-up input ({plan.notes[-1]}). Pass example_inputs (or a LightningModule"
            " example_input_array), or sequence_parallel=False"
        )
    for name, block in blocks:
        split = provider_for(block).plan_block(model, name, block, None, plan, checks)
        plan.head_attributes += head_attributes(name, block, split.cols, split.heads, plan.tp_size, model)
    _check_divisible(checks, plan.tp_size)


def _plan_traced(model: nn.Module, blocks: Blocks, flow: Flow, plan: TPPlan, checks: list[Check]) -> None:
    block_groups: dict[str, list[Group]] = {}
    # one block of each type is simulated with local shapes
    sims: dict[type, tuple[str, nn.Module, dict[str, tuple[int, int]]]] = {}
    for name, block in blocks:
        split = provider_for(block).plan_block(model, name, block, flow, plan, checks)
        block_groups[name] = split.groups
        plan.head_attributes += head_attributes(name, block, split.cols, split.heads, plan.tp_size, model)
        sims.setdefault(type(block), (name, block, split.local))
    _check_divisible(checks, plan.tp_size)
    _verify_local_run(model, flow, list(sims.values()), plan)
    if plan.sequence_parallel:
        sp_norms = _check_sequence_parallel(blocks, flow, block_groups)
        named = dict(model.named_modules())
        for norms in sp_norms.values():
            for n in sorted(norms):
                plan.styles[n] = parallel_style(SEQUENCE_PARALLEL)
                plan.layers.append(TPLayer(n, SEQUENCE_PARALLEL, type(named[n]).__name__))


def _check_divisible(checks: list[Check], tp: int) -> None:
    """``(module, what, number)``: refuse when ``tp`` does not divide a number; say which sizes would."""
    bad = [(m, what, n) for m, what, n in checks if n % tp]
    if not bad:
        return
    choices = format_choices(divisors(math.gcd(*[n for _, _, n in checks])))
    lines = [f"  {m}: {what} = {n} is not divisible by {tp}" for m, what, n in bad]
    raise TPPlanError(
        f"tensor_parallel_size={tp} cannot split these layers evenly (each rank must hold whole heads and"
        " equal shares of every split dimension):\n"
        + "\n".join(lines)
        + f"\nChoose tensor_parallel_size from {choices}, or pass plan={{...}} that leaves these layers"
        " replicated."
    )


def _verify_local_run(model: nn.Module, flow: Flow, sims: list[tuple], plan: TPPlan) -> None:
    """Simulate one rank's forward of each block type: keep the head-attribute adjustments only if the
    block needs them; refuse when it runs neither way."""
    tp = plan.tp_size
    for name, block, local in sims:
        attrs = [a for a in plan.head_attributes if a[0] == name or a[0].startswith(name + ".")]
        try:
            simulate(name, block, flow, {}, [], model)
        except Exception as err:  # noqa: BLE001 - the block cannot run on meta at all: nothing to verify
            plan.notes.append(f"could not simulate {name} on the meta device ({type(err).__name__}: {err})")
            continue
        if tp == 1 or not local:
            continue
        try:
            simulate(name, block, flow, local, attrs, model)
            continue
        except Exception as err:  # noqa: BLE001
            first_error = err
        if attrs and _runs_with_global_heads(name, block, flow, local, model):
            keep = {(a[0], a[1]) for a in attrs}
            plan.head_attributes = [a for a in plan.head_attributes if (a[0], a[1]) not in keep]
            plan.notes.append(f"{name}: head-count attributes left unchanged (the block infers local heads)")
            continue
        adjusted = "".join(f"; {p}.{a} set to {new}" for p, a, _, new in attrs)
        raise TPPlanError(
            f"{name} ({type(block).__name__}) does not run when each rank holds 1/{tp} of its heads"
            f" ({type(first_error).__name__}: {first_error}{adjusted}). The block probably derives a"
            " size from the full width (x.shape[-1], a stored hidden size) for a reshape or split of a"
            " split layer's output. Fix the model to use per-rank sizes: view(b, t, -1, head_dim),"
            " .chunk(3, dim=-1) instead of .split(n_embd), reshape(b, t, -1); or pass plan={...}"
            " leaving this block replicated"
        ) from first_error


def _runs_with_global_heads(name: str, block: nn.Module, flow: Flow, local: dict, model: nn.Module) -> bool:
    """Whether the block runs with local shapes when its head-count attributes keep their global values."""
    try:
        simulate(name, block, flow, local, [], model)
    except Exception:  # noqa: BLE001
        return False
    return True


def _check_sequence_parallel(
    blocks: Blocks, flow: Flow, block_groups: dict[str, list[Group]]
) -> dict[str, set[str]]:
    """Norms to run sequence-parallel per block; raise when the blocks are not pre-norm and chained."""
    problems: list[str] = []
    sp_norms: dict[str, set[str]] = {}
    for i, (name, block) in enumerate(blocks):
        x = next(iter(tensors_in(flow.block_args[name][0])), None)
        if x is None or x.dim() != 3:
            problems.append(f"{name}: its input is not (batch, sequence, features)")
            continue
        if i > 0 and flow.inputs.get(f"{name}:in") != {f"{blocks[i - 1][0]}:out"}:
            problems.append(f"{name} is not fed directly by {blocks[i - 1][0]}")
        sp_norms[name] = _sequence_parallel_norms(name, block, flow, block_groups[name], problems)
    if problems:
        raise TPPlanError(
            "sequence_parallel=True needs pre-norm blocks that are called one after the other (norm ->"
            " column-parallel layers, row-parallel output added to the residual stream); here:\n  "
            + "\n  ".join(dict.fromkeys(problems))
            + "\nUse sequence_parallel=False, or pass a plan={module: ParallelStyle} written for this model."
        )
    return sp_norms


def _sequence_parallel_norms(
    name: str, block: nn.Module, flow: Flow, groups: list[Group], problems: list[str]
) -> set[str]:
    """The block's norms that feed its column layers only; what breaks the pre-norm pattern goes to ``problems``."""
    prefix = f"{name}." if name else ""
    norms = {prefix + n for n, m in block.named_modules() if is_norm(m)}
    cols = {c for g in groups for c in g.cols}
    stream = {f"{name}:in"} | {g.row for g in groups}
    for c in cols:
        if flow.inputs.get(c, set()) & stream:
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
    return used


def _add_loss_parallel_head(
    model: nn.Module, blocks: Blocks, flow: Flow | None, plan: TPPlan, checks: list[Check]
) -> None:
    name, head = _find_head(model, blocks, flow)
    tied = [n for n, p in model.named_parameters(remove_duplicate=False) if p is head.weight]
    if len(tied) > 1:
        raise TPPlanError(
            f"loss_parallel=True would split the output head {name}, but its weight is shared with"
            f" {', '.join(t for t in tied if not t.startswith(name + '.'))} (tied embeddings); use"
            " loss_parallel=False"
        )
    checks.append((name, "output features (vocabulary)", head.out_features))
    _check_divisible(checks, plan.tp_size)
    plan.styles[name] = parallel_style(LOSS_PARALLEL_HEAD)
    plan.layers.append(TPLayer(name, LOSS_PARALLEL_HEAD, describe_linear(head) + ", logits sharded"))


def _find_head(root: nn.Module, blocks: Blocks, flow: Flow | None) -> tuple[str, nn.Linear]:
    block_ids = {id(m) for _, b in blocks for m in b.modules()}
    outside = [(n, m) for n, m in root.named_modules() if isinstance(m, nn.Linear) and id(m) not in block_ids]
    if flow is not None and flow.output:
        hits = [(n, m) for n, m in outside if n in flow.output]
        if len(hits) == 1:
            return hits[0]
    width = block_width(blocks[-1][1])
    candidates = [(n, m) for n, m in outside if m.in_features == width]
    if not candidates:
        raise TPPlanError(
            "loss_parallel=True needs an output head (a Linear after the last block that produces the"
            f" logits); {type(root).__name__} has no Linear outside its blocks reading width {width}"
        )
    return candidates[-1]


# --- plans given by the user ----------------------------------------------------------------------------


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
    wrong = f"plan={spec!r} must be 'auto', a dict {{module_path: ParallelStyle}} or fn(model, tp_mesh)"
    if isinstance(spec, str):
        if spec != "auto":
            raise ValueError(wrong)
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
    raise ValueError(wrong)
