"""One tensor-parallel rank's model, on the meta device: what ``tp_dp``'s memory is predicted from.

:func:`tp_local_model` copies a (meta) model and gives every layer a plan splits the shapes one rank holds
(a column-wise layer ``out / tp`` outputs, a row-wise layer ``in / tp`` inputs and the full output, a head
embedding ``dim / tp`` per row) and every head-count attribute its per-rank value, as
:func:`~lit_parallel.parallel.tp_apply.apply_tp` does to the real model. The step simulated on it
(:mod:`~lit_parallel.parallel.step_simulation`) holds what one rank holds: the activations a split layer
makes split, those it reads (its input, the residual stream, norms) whole.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from lit_parallel.parallel.tp_plan import (
    COLWISE,
    COLWISE_FUSED,
    LOSS_PARALLEL_HEAD,
    ROWWISE,
    TPPlan,
    projection_kind,
)

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
