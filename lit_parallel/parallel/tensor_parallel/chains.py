"""Tensor-parallel plans for models without transformer blocks: column/row pairs on chains of Linears.

A plain MLP (``nn.Sequential(Linear, Tanh, Linear, ...)``) has no repeated blocks, but a Linear whose
output reaches exactly one other Linear through element-wise operations only (activations, dropout,
scaling) is a column-parallel layer, and that other Linear is its row-parallel partner: each rank
computes 1/tp of the hidden features and the row layer's all-reduce sums the partial outputs.
:func:`plan_linear_chains` runs the model once on a tiny input while recording, for every tensor, the
Linear it comes from and whether only element-wise operations happened since; Linears are then paired
greedily in the order they ran. Whatever cannot be paired is replicated, with the reason in the plan.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lit_parallel._compat import tree_flatten
from lit_parallel.parallel.example_inputs import call_with, first_parametrised_leaf, token_ids
from lit_parallel.parallel.tensor_parallel.block_plan import describe_linear
from lit_parallel.parallel.tensor_parallel.plan import (
    COLWISE,
    REPLICATED,
    ROWWISE,
    TPLayer,
    TPPlan,
    TPPlanError,
)
from lit_parallel.parallel.tensor_parallel.styles import parallel_style

# Operations that act on each feature on its own: a column shard passes through them unchanged.
ELEMENTWISE = frozenset(
    """relu relu6 gelu silu mish tanh sigmoid hardtanh hardsigmoid hardswish elu selu celu leaky_relu softplus
    softsign logsigmoid tanhshrink threshold dropout alpha_dropout feature_alpha_dropout neg abs exp
    square sqrt rsqrt __neg__ __abs__ mul add sub div true_divide __mul__ __rmul__ __add__ __radd__
    __sub__ __rsub__ __truediv__ __rtruediv__ __pow__ pow clamp clip contiguous clone float to
    """.split()
)

_TAG = "_lp_chain_source"  # (Linear name, True while only element-wise operations happened)


@dataclass
class ChainFlow:
    """What one forward showed about the Linears of a model."""

    order: list[str] = field(default_factory=list)
    calls: dict[str, int] = field(default_factory=dict)
    inputs: dict[str, set[tuple[str, bool]]] = field(default_factory=dict)
    escapes: dict[str, str] = field(default_factory=dict)  # Linear -> where its output goes otherwise
    active: int = 0  # Linears being called (their own F.linear is not a use of their input)


def _tags(obj: Any) -> set[tuple[str, bool]]:
    return {
        getattr(t, _TAG) for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor) and hasattr(t, _TAG)
    }


def _is_scalar(x: Any) -> bool:
    return not isinstance(x, torch.Tensor) or x.dim() == 0


class _ChainMode(TorchFunctionMode):
    def __init__(self, flow: ChainFlow, states: set[int]):
        super().__init__()
        self.flow, self.states = flow, states

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tags = _tags((args, kwargs))
        name = getattr(func, "__name__", "")
        if not tags or (name == "linear" and self.flow.active):  # recorded by the Linear's pre-hook
            return out
        if not any(isinstance(leaf, torch.Tensor) for leaf in tree_flatten(out)[0]):
            return out  # metadata (.shape, .dim()): no data flows on
        base = name[:-1] if name.endswith("_") and not name.startswith("_") else name
        tensors = [a for a in itertools.chain(args, kwargs.values()) if isinstance(a, torch.Tensor)]
        pure = base in ELEMENTWISE and len(tags) == 1 and sum(not _is_scalar(t) for t in tensors) <= 1
        new = {(src, ok and pure) for src, ok in tags}
        if not pure:
            for src, ok in tags:
                if ok:
                    self.flow.escapes.setdefault(src, f"its output goes through {name}")
        for leaf in tree_flatten(out)[0] + ([args[0]] if base != name and args else []):
            if isinstance(leaf, torch.Tensor) and id(leaf) not in self.states and len(new) == 1:
                setattr(leaf, _TAG, next(iter(new)))
        return out


def _pre(flow: ChainFlow, name: str, module: nn.Module, args: tuple) -> None:
    flow.inputs.setdefault(name, set()).update(_tags(args))
    flow.calls[name] = flow.calls.get(name, 0) + 1
    flow.active += 1


def _post(flow: ChainFlow, name: str, module: nn.Module, args: tuple, out: Any) -> None:
    flow.active -= 1
    if name not in flow.order:
        flow.order.append(name)
    setattr(out, _TAG, (name, True))


def trace_chains(model: nn.Module, drive) -> ChainFlow:
    """Run ``drive()`` once (eval mode, no grad) and record how the model's Linears feed each other."""
    flow = ChainFlow()
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    states = {id(t) for t in itertools.chain(model.parameters(), model.buffers())}
    handles = []
    was_training = model.training
    try:
        for n, m in linears.items():
            handles.append(m.register_forward_pre_hook(partial(_pre, flow, n)))
            handles.append(m.register_forward_hook(partial(_post, flow, n)))
        model.eval()
        with torch.no_grad(), _ChainMode(flow, states):
            out = drive()
        for src, ok in _tags(out):
            if ok:
                flow.escapes.setdefault(src, "its output is the model's output")
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    return flow


def _made_up_input(model: nn.Module, example_inputs: Any) -> tuple[Any, str]:
    """A zero-argument call of the model, or (None, why not)."""
    if example_inputs is not None:
        return call_with(model, example_inputs), ""
    first = first_parametrised_leaf(model)
    param = next(model.parameters(), None)
    if isinstance(first, nn.Embedding):
        return partial(model, token_ids(2, 5, param.device)), ""
    if isinstance(first, nn.Linear):
        x = torch.zeros(2, first.in_features, dtype=param.dtype, device=param.device)
        return partial(model, x), ""
    kind = type(first).__name__ if first is not None else "no layer with parameters"
    return None, (
        f"its first layer is {kind}, so no input can be made up; set example_input_array on the"
        " LightningModule (or pass example_inputs= to infer_tp_plan)"
    )


def _owner(model: nn.Module, linears: dict[str, nn.Linear]) -> nn.Module:
    """The deepest submodule of ``model`` that contains every one of ``linears`` (``model`` itself if none)."""
    parents = [name.split(".")[:-1] for name in linears]
    if not parents:
        return model
    common: list[str] = []
    for parts in zip(*parents):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return model.get_submodule(".".join(common)) if common else model


def _partner(flow: ChainFlow, col: str, used: set[str]) -> tuple[str | None, str]:
    """The Linear ``col``'s output reaches purely and alone, or (None, why there is none)."""
    if col in flow.escapes:
        return None, flow.escapes[col]
    readers = [n for n, srcs in flow.inputs.items() if any(src == col for src, _ in srcs)]
    if not readers:
        return None, "its output reaches no other Linear"
    if len(readers) > 1:
        return None, f"its output reaches several Linears ({', '.join(sorted(readers))})"
    row = readers[0]
    if row in used:
        return None, f"{row} is already part of another pair"
    if flow.inputs[row] != {(col, True)}:
        return None, f"{row}'s input is not {col}'s output through element-wise operations only"
    return row, ""


def plan_linear_chains(model: nn.Module, plan: TPPlan, example_inputs: Any = None) -> TPPlan:
    """Fill ``plan`` with column/row pairs of Linears (see the module docstring); every other Linear is
    listed as replicated with the reason. The model runs once on ``example_inputs`` (or on a made-up
    input when its first layer is a Linear or an Embedding)."""
    tp = plan.tp_size
    plan.how = "linear chains"
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    # Without example inputs, run the smallest module holding every Linear: a LightningModule usually has no
    # forward of its own (training_step calls self.model), and made-up inputs fit that module's first layer.
    drive, why = _made_up_input(
        model if example_inputs is not None else _owner(model, linears), example_inputs
    )
    flow = None
    if drive is not None:
        try:
            flow = trace_chains(model, drive)
        except Exception as err:  # noqa: BLE001 - any failure of user code means "no trace", said in the note
            why = (
                f"running the model failed ({type(err).__name__}: {err}); set example_input_array on the"
                " LightningModule (or pass example_inputs= to infer_tp_plan)"
            )
    if flow is None:
        plan.notes.append(f"no transformer blocks, and the model could not be traced: {why}")
        plan.layers += [TPLayer(n, REPLICATED, describe_linear(m), "not traced") for n, m in linears.items()]
        return plan
    reasons: dict[str, str] = {}
    used: set[str] = set()
    for col in flow.order:
        if col in used:
            continue
        row, why = _partner(flow, col, used)
        if row is None or flow.calls[col] > 1 or flow.calls[row] > 1:
            reasons.setdefault(col, why or "called more than once in one forward")
            continue
        hidden = linears[col].out_features
        if hidden % tp:
            reasons[col] = reasons[row] = f"{hidden} hidden features are not divisible by {tp}"
            continue
        used |= {col, row}
        plan.styles[col] = parallel_style(COLWISE)
        plan.styles[row] = parallel_style(ROWWISE)
        plan.layers.append(TPLayer(col, COLWISE, describe_linear(linears[col])))
        plan.layers.append(TPLayer(row, ROWWISE, f"{describe_linear(linears[row])}, fed by {col}"))
    for n, m in linears.items():
        if n not in used:
            reason = reasons.get(n) or ("not called in the traced forward" if n not in flow.calls else "")
            plan.layers.append(
                TPLayer(n, REPLICATED, describe_linear(m), reason or "no column layer feeds it")
            )
    pairs = len(used) // 2
    plan.notes.append(
        f"no transformer blocks: {pairs} column/row pair{'s' * (pairs != 1)} on chains of Linears,"
        f" {len(linears) - len(used)} Linear{'s' * (len(linears) - len(used) != 1)} replicated"
    )
    return plan


def plan_without_blocks(
    model: nn.Module, tp_size: int, sequence_parallel: bool, loss_parallel: bool, example_inputs: Any
) -> TPPlan:
    """The plan of a model without transformer blocks (:func:`plan_linear_chains`); sequence and loss
    parallelism need blocks and an output head, so they are refused here."""
    for flag, value in (("sequence_parallel", sequence_parallel), ("loss_parallel", loss_parallel)):
        if value:
            raise TPPlanError(
                f"{flag}=True needs transformer blocks, but {type(model).__name__} has no repeated blocks"
                f" (its Linears are split as column/row pairs instead); use {flag}=False"
            )
    return plan_linear_chains(model, TPPlan(tp_size=tp_size), example_inputs)
