"""What one rank holds of a split model: parameter bytes by kind, for the strategies' decision summaries."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from lit_parallel.parallel.mesh import ParallelDims

if TYPE_CHECKING:
    from lit_parallel.parallel.tensor_parallel import TPPlan


def describe_parameter_bytes(module: nn.Module, plan: TPPlan, dims: ParallelDims) -> str:
    """Parameter bytes this rank holds: split block layers (1/(dp x tp) of their size) and the rest (1/dp)."""
    from torch.distributed.tensor import DTensor

    from lit_parallel.parallel.tensor_parallel import local_parameter_bytes

    local = local_parameter_bytes(module)
    split_paths = tuple(f"{layer.path}." for layer in plan.split)
    groups = {"split": [0, 0], "other": [0, 0]}
    for name, p in module.named_parameters():
        full = p.numel() * p.element_size() if isinstance(p, DTensor) else local[name]
        key = "split" if name.startswith(split_paths) else "other"
        groups[key][0] += local[name]
        groups[key][1] += full
    (s_local, s_full), (o_local, o_full) = groups["split"], groups["other"]
    return (
        f"parameter bytes on this rank: {s_local + o_local:,} of {s_full + o_full:,};"
        f" tensor-parallel layers {s_local:,} of {s_full:,}"
        f" (1/{s_full // s_local if s_local else 0}; data_parallel {dims.data_parallel} x tensor_parallel"
        f" {dims.tensor_parallel}), other parameters {o_local:,} of {o_full:,}"
    )
