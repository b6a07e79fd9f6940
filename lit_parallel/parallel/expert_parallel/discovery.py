"""Finding a model's MoE layers (like block discovery): stacked-expert modules and module lists of experts.

:func:`find_moe_layers` walks the module tree once and returns every MoE layer with what expert parallelism
needs to split it: which tensors hold experts, how many experts, the router, the top-k. What the layouts look
like is data in :mod:`~lit_parallel.parallel.expert_parallel.families`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Literal

from torch import nn

from lit_parallel.parallel.expert_parallel.families import (
    ALREADY_PARALLEL_ATTRIBUTES,
    NUM_EXPERTS_ATTRIBUTES,
    ROUTER_NAMES,
    STACKED_FORWARD_ARGUMENTS,
    TOP_K_ATTRIBUTES,
)

__all__ = ["MoELayer", "expert_parameter_count", "find_moe_layers"]


@dataclass(frozen=True)
class MoELayer:
    """One MoE layer.

    Attributes:
        path: qualified name of ``module`` in the model.
        kind: ``"stacked"`` (one module, expert weights ``[E, ...]``) or ``"module_list"`` (a layer holding an
            ``nn.ModuleList`` of expert modules and a router).
        module: the stacked-experts module, or the MoE layer holding the list.
        num_experts: experts in the layer.
        experts_name: the ``ModuleList``'s attribute name (module list only).
        router_name: the router's attribute name (module list only).
        top_k: experts per token where the layer states it, else ``None``.
        expert_numel: elements of all experts' weights together (every expert, unsplit).
    """

    path: str
    kind: Literal["stacked", "module_list"]
    module: nn.Module
    num_experts: int
    experts_name: str | None = None
    router_name: str | None = None
    top_k: int | None = None
    expert_numel: int = 0

    def expert_parameter_names(self) -> list[str]:
        """Qualified names (relative to the model) of the parameters that belong to experts."""
        prefix = f"{self.path}." if self.path else ""
        if self.kind == "stacked":
            return [prefix + n for n, _ in self.module.named_parameters(recurse=False)]
        experts = getattr(self.module, self.experts_name or "")
        return [f"{prefix}{self.experts_name}.{n}" for n, _ in experts.named_parameters()]

    def describe(self) -> str:
        k = f", top-{self.top_k}" if self.top_k else ""
        how = "stacked expert weights" if self.kind == "stacked" else f"ModuleList '{self.experts_name}'"
        return (
            f"{self.path or '<root>'}: {self.num_experts} experts ({how}{k}), {self.expert_numel:,} elements"
        )


def _num_experts_attribute(module: nn.Module) -> int | None:
    for name in NUM_EXPERTS_ATTRIBUTES:
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 2:
            return value
    return None


def _forward_arguments(module: nn.Module) -> list[str]:
    forward = inspect.unwrap(type(module).forward)
    try:
        params = list(inspect.signature(forward).parameters)
    except (TypeError, ValueError):
        return []
    return params[1:]  # without self


def _as_stacked(path: str, module: nn.Module) -> MoELayer | None:
    """A module whose own weights all have the experts as their first dimension and whose forward takes the
    routing decisions (``hidden_states, top_k_index, top_k_weights``)."""
    n = _num_experts_attribute(module)
    own = list(module.parameters(recurse=False))
    if n is None or not own or any(p.ndim < 2 or p.shape[0] != n for p in own):
        return None
    if any(True for child in module.children() for _ in child.parameters()):
        return None
    if tuple(_forward_arguments(module)[:3]) != STACKED_FORWARD_ARGUMENTS:
        return None
    if any(getattr(module, a, False) is True for a in ALREADY_PARALLEL_ATTRIBUTES):
        raise ValueError(
            f"the experts module {path!r} ({type(module).__name__}) already runs expert parallelism itself"
            " (transformers' own EP, set by a tp_plan/distributed_config at load time); load the model without"
            " it and let the strategy's expert_parallel_size split the experts"
        )
    return MoELayer(path, "stacked", module, n, expert_numel=sum(p.numel() for p in own))


def _shapes(module: nn.Module) -> tuple:
    return tuple((name, tuple(p.shape)) for name, p in module.named_parameters())


def _top_k(module: nn.Module) -> int | None:
    for name in TOP_K_ATTRIBUTES:
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
    return None


def _as_module_list(path: str, module: nn.Module) -> MoELayer | None:
    """A layer with an ``nn.ModuleList`` of two or more identical modules (same class, same parameter shapes)
    and a router child with one output per expert."""
    for name, child in module.named_children():
        members = list(child) if isinstance(child, nn.ModuleList) else []
        if len(members) < 2 or list(child._modules) != [str(i) for i in range(len(members))]:
            continue  # not a list of experts (a pipeline stage's pruned list of blocks has gaps)
        first = members[0]
        shapes = _shapes(first)
        if not shapes or any(type(e) is not type(first) or _shapes(e) != shapes for e in members):
            continue
        for router_name in ROUTER_NAMES:
            router = getattr(module, router_name, None)
            weight = getattr(router, "weight", None)
            if isinstance(router, nn.Module) and weight is not None and weight.shape[0] == len(child):
                numel = sum(p.numel() for p in child.parameters())
                return MoELayer(
                    path, "module_list", module, len(child), name, router_name, _top_k(module), numel
                )
    return None


def find_moe_layers(module: nn.Module) -> list[MoELayer]:
    """Every MoE layer in ``module``, in module order (an MoE layer's own submodules are not searched again)."""
    found: list[MoELayer] = []
    for path, m in module.named_modules():
        if any(path == f.path or path.startswith(f"{f.path}.") for f in found if f.path):
            continue
        layer = _as_stacked(path, m) or _as_module_list(path, m)
        if layer is not None:
            found.append(layer)
    return found


def expert_parameter_count(module: nn.Module) -> int:
    """Elements of every expert weight in ``module`` (0 without MoE layers)."""
    return sum(layer.expert_numel for layer in find_moe_layers(module))
