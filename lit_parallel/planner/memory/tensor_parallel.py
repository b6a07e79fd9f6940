"""One tensor-parallel rank's model, on the meta device: what ``tp_dp``'s memory is predicted from.

:func:`tp_local_model` copies a (meta) model and gives every layer a plan splits the shapes one rank holds
(a column-wise layer ``out / tp`` outputs, a row-wise layer ``in / tp`` inputs and the full output, a head
embedding ``dim / tp`` per row) and every head-count attribute its per-rank value, as
:func:`~lit_parallel.parallel.tensor_parallel.apply.apply_tp` does to the real model. The step simulated on it
(:mod:`~lit_parallel.planner.simulation`) holds what one rank holds: the activations a split layer
makes split, those it reads (its input, the residual stream, norms) whole. :func:`tp_peaks` is
``tp_dp``'s peak from it (:mod:`~lit_parallel.planner.memory.peak` calls it when it has the plan);
:func:`all_reduces_per_step` counts the all-reduces its step runs (what ``tp_dp``'s step time is priced by).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
from torch import nn

from lit_parallel.measure.live_memory import LiveMemory
from lit_parallel.parallel.tensor_parallel.plan import (
    COLWISE,
    COLWISE_FUSED,
    LOSS_PARALLEL_HEAD,
    ROWWISE,
    TPPlan,
    projection_kind,
)
from lit_parallel.planner.fused_attention import fused_attention_on_meta
from lit_parallel.planner.memory.peak import (
    TP_ALL_REDUCE_COPIES,
    ModelShape,
    Peak,
    fsdp_moments,
    padded,
)
from lit_parallel.planner.memory.table import memory_rows
from lit_parallel.planner.precision import compute_dtype, precision_bytes
from lit_parallel.planner.simulation import simulate_step

_COLUMN = (COLWISE, COLWISE_FUSED, LOSS_PARALLEL_HEAD)
_SIZE_ATTRIBUTES = {  # a projection's own size attributes, by which dimension they hold
    "out": ("out_features", "nf"),
    "in": ("in_features", "nx"),
}


def _meta_parameter(like: torch.Tensor, shape: tuple[int, ...]) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=like.dtype, device="meta"), requires_grad=like.requires_grad)


def _shrink(module: nn.Module, style: str, tp: int) -> None:
    """Give ``module`` the shapes one of ``tp`` ranks holds under ``style`` (in place, on meta)."""
    if isinstance(module, nn.Embedding):  # split over its embedding dimension (one value per head)
        w = module.weight
        module.weight = _meta_parameter(w, (w.shape[0], w.shape[1] // tp))
        module.embedding_dim //= tp
        return
    kind = projection_kind(module)
    if kind is None:
        raise ValueError(f"{type(module).__name__} is split by the plan but is not a projection or embedding")
    w, out_dim = module.weight, kind.out_dim
    dim = out_dim if style in _COLUMN else 1 - out_dim  # row-wise: the input features
    shape = list(w.shape)
    shape[dim] //= tp
    module.weight = _meta_parameter(w, tuple(shape))
    bias = getattr(module, "bias", None)
    if style in _COLUMN and isinstance(bias, torch.Tensor):
        module.bias = _meta_parameter(bias, (bias.shape[0] // tp,))
    for attr in _SIZE_ATTRIBUTES["out" if style in _COLUMN else "in"]:
        value = getattr(module, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            setattr(module, attr, value // tp)


def tp_local_model(module: nn.Module, plan: TPPlan) -> nn.Module:
    """A meta copy of ``module`` as one of ``plan.tp_size`` tensor-parallel ranks holds it (module
    docstring). ``module`` is left as it is."""
    local = copy.deepcopy(module).to("meta")
    styles = {layer.path: layer.style for layer in plan.split if layer.path in plan.styles}
    for path, style in styles.items():
        if style in (*_COLUMN, ROWWISE):
            _shrink(local.get_submodule(path), style, plan.tp_size)
    for path, attr, _, value in plan.head_attributes:
        setattr(local.get_submodule(path) if path else local, attr, value)
    return local


def tp_peaks(
    module: nn.Module,
    plan: TPPlan,
    *,
    precision: str,
    nodes: int,
    block_names: list[str],
    kw: dict,
    opt_elem: int,
    device_type: str,
) -> tuple[Peak, Peak]:
    """``tp_dp`` without and with activation checkpointing: FSDP2 over the ``nodes`` data-parallel ranks
    (:func:`~lit_parallel.planner.memory.peak.fsdp_moments`) of one tensor-parallel rank's model
    (:func:`tp_local_model`), its step simulated on meta (the activations split layers make are split, those
    they read whole), and each row-wise layer's forward all-reduce (:func:`row_outputs`): the block gathered,
    what the step holds at that point (activations and temporaries, counted as activations), and
    TP_ALL_REDUCE_COPIES of the layer's output (its partial sum, the reduced result, gloo's input and output
    buffers). A row-wise layer outside blocks counts the root gathered only."""
    local = tp_local_model(module, plan)
    shape = ModelShape.of(local, [local.get_submodule(n) for n in block_names])
    rows = {
        r.name: r
        for r in memory_rows(
            shape.params, devices=1, nodes=nodes, precision=precision, trainable_params=shape.trainable
        )
    }
    row = rows["FSDP/ZeRO-3"]
    p, g, o = row.param_bytes, row.grad_bytes, row.optimizer_bytes
    o += 4 * shape.param_tensors  # AdamW's step counters
    opt_bytes = (shape.trainable if device_type == "cuda" else 2 * shape.largest_param) * opt_elem
    c = precision_bytes(precision).compute
    args = {"c": c, "opt_bytes": opt_bytes, "shard": nodes, "gloo": device_type == "cpu"}
    root = padded(shape.root_shapes, nodes) * c
    out = []
    for ac in (False, True) if block_names else (False,):
        try:
            with row_outputs(local, plan, block_names) as at_rows:
                sim = simulate_step(
                    local,
                    dtype=compute_dtype(precision),
                    block_names=block_names,
                    activation_checkpointing=ac,
                    **kw,
                )
        except RuntimeError:  # a block not recomputable on meta: as peak._simulations, the row without
            if not ac:
                raise
            break
        moments = fsdp_moments("tp_dp", sim, shape, (p, g, o), **args)
        for path, (k, held, nbytes) in at_rows.items():
            gathered = padded(shape.block_shapes[k], nodes) * c if k is not None else 0.0
            moments.append(
                Peak(
                    "tp_dp",
                    p + root + gathered,
                    g,
                    o,
                    held,
                    TP_ALL_REDUCE_COPIES * nbytes,
                    "forward",
                    f"{path} all-reduced",
                )
            )
        out.append(max(moments, key=lambda m: m.total))
    return out[0], out[-1]


@contextlib.contextmanager
def row_outputs(local: nn.Module, plan: TPPlan, block_names: list[str]):
    """While active, record each row-wise layer of ``plan`` in ``local`` as it runs in the step simulation
    (forward hooks are copied with the module into the simulation's meta copy) in the dict it yields:
    ``path -> (the index of the block it is in or None, the bytes the step holds then beyond the model
    state, its output's bytes)``; the first call of each (a recomputation in backward is not forward)."""
    paths = [layer.path for layer in plan.split if layer.style == ROWWISE and layer.path in plan.styles]
    seen: dict[str, tuple[int | None, float, int]] = {}

    def hook(path: str, block: int | None):
        def record(module: nn.Module, args: Any, output: Any) -> None:
            tracker = LiveMemory.innermost()
            if path in seen or tracker is None or not isinstance(output, torch.Tensor):
                return
            seen[path] = (block, float(tracker.held_beyond_state()), output.numel() * output.element_size())

        return record

    def block_of(path: str) -> int | None:
        return next((i for i, n in enumerate(block_names) if path == n or path.startswith(n + ".")), None)

    handles = [local.get_submodule(p).register_forward_hook(hook(p, block_of(p))) for p in paths]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def all_reduces_per_step(module: nn.Module, plan: TPPlan, args: tuple) -> int:
    """The all-reduces one training step of ``module`` split by ``plan`` runs, counted in a forward of
    ``module`` (on meta) on ``args``: one for each row-wise layer (its partial output, in forward) and one
    for each column-wise layer whose input needs a gradient (that gradient is a partial sum, reduced in
    backward). A column-wise layer fed by the model's input or by integer positions (T5's relative attention
    bias) has no input gradient and no all-reduce; a layer the forward does not reach runs none."""
    styles = {layer.path: layer.style for layer in plan.split if layer.path in plan.styles}
    reduces: dict[str, bool] = {}

    def hook(path: str, style: str):
        def record(mod: nn.Module, inputs: tuple, output: Any) -> None:
            needs_grad = any(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs)
            reduces.setdefault(path, style == ROWWISE or (style in _COLUMN and needs_grad))

        return record

    handles = [module.get_submodule(p).register_forward_hook(hook(p, s)) for p, s in styles.items()]
    try:  # attention as the simulations run it (a mask made on the CPU meets meta queries there)
        with torch.enable_grad(), fused_attention_on_meta():
            module(*args)
    finally:
        for h in handles:
            h.remove()
    return sum(reduces.values())
