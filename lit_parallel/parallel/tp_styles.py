"""The ``ParallelStyle`` each plan entry becomes, including those torch does not provide.

``FusedColwiseParallel`` splits a Linear whose output is several projections (fused q/k/v, gate/up)
chunk by chunk; ``TransposedColwiseParallel`` / ``TransposedRowwiseParallel`` split a projection whose
weight is stored ``(in, out)`` (HF ``Conv1D``: column-parallel shards weight dimension 1, row-parallel
dimension 0; fused chunks likewise); ``SequenceParallelNorm`` runs a norm on this rank's part of the
sequence and gathers its output once for the column-parallel layers it feeds. All subclass torch's
styles, which are only imported when a style is built (``torch.distributed.tensor`` is not needed to
infer or print a plan).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lit_parallel.parallel.tp_plan import (
    COLWISE,
    COLWISE_FUSED,
    LOSS_PARALLEL_HEAD,
    ROWWISE,
    SEQUENCE_PARALLEL,
)


def parallel_style(
    kind: str,
    *,
    sections: Sequence[int] | None = None,
    sequence_parallel: bool = False,
    out_dim: int = 0,
):
    """The ``ParallelStyle`` for a plan entry of style ``kind``.

    Args:
        sections: a fused layer's chunk widths.
        sequence_parallel: a row-parallel layer's output is sharded over the sequence.
        out_dim: the weight dimension holding the output features (1: weight stored ``(in, out)``).
    """
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = _custom_styles()
    if out_dim == 1 and kind in (COLWISE, COLWISE_FUSED, ROWWISE):
        if kind == ROWWISE:
            return styles.rowwise_t(output_layouts=Shard(1)) if sequence_parallel else styles.rowwise_t()
        return styles.colwise_t(sections if kind == COLWISE_FUSED else None)
    if kind == COLWISE:
        return ColwiseParallel()
    if kind == COLWISE_FUSED:
        return styles.fused(sections or [])
    if kind == ROWWISE:
        return RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()
    if kind == SEQUENCE_PARALLEL:
        return styles.sp_norm()
    if kind == LOSS_PARALLEL_HEAD:
        return ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    raise ValueError(kind)


def distribute_params(module: nn.Module, mesh, placements: Mapping[str, Any], src_data_rank) -> None:
    from torch.distributed.tensor import distribute_tensor

    for name, param in list(module.named_parameters(recurse=False)):
        dist = distribute_tensor(param, mesh, [placements[name]], src_data_rank=src_data_rank)
        module.register_parameter(name, nn.Parameter(dist, requires_grad=param.requires_grad))


def permute_output(module: nn.Module, perm: torch.Tensor, dims: Mapping[str, int]) -> None:
    """Reorder each parameter's output features (dimension ``dims[name]``) in ``perm`` order."""
    with torch.no_grad():
        for name, param in list(module.named_parameters(recurse=False)):
            param.data = param.data.index_select(dims.get(name, 0), perm.to(param.device))


@functools.cache
def _custom_styles():
    from lit_parallel.parallel import tp_style_classes as c

    return _Styles(
        c.FusedColwiseParallel,
        c.TransposedColwiseParallel,
        c.TransposedRowwiseParallel,
        c.SequenceParallelNorm,
    )


class _Styles:
    def __init__(self, fused, colwise_t, rowwise_t, sp_norm):
        self.fused, self.colwise_t, self.rowwise_t, self.sp_norm = fused, colwise_t, rowwise_t, sp_norm


def gather_output(module, outputs, device_mesh):
    from torch.distributed.tensor import Replicate

    return outputs.redistribute(placements=[Replicate()] * device_mesh.ndim)


def _reorder(value: torch.Tensor, index: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """``value`` with dimension ``dim`` taken in ``index`` order, a DTensor without gathering it whole."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(value, DTensor):
        return value.index_select(dim, index.to(value.device))
    mesh = value.device_mesh
    # ``dim`` must be whole on each rank to reorder it locally: shard the other dimension (2-D weight)
    target = [Shard(1 - dim) if value.dim() >= 2 else Replicate()] * mesh.ndim
    v = value.redistribute(mesh, target)
    local = v.to_local().index_select(dim, index.to(v.to_local().device))
    return DTensor.from_local(local, mesh, target, shape=v.shape, stride=v.stride(), run_check=False)


def register_layout_hooks(module: nn.Module, perm: torch.Tensor, dims: Mapping[str, int]) -> None:
    """State dicts of a fused layer keep the original order of output features (parameter ``n``'s
    dimension ``dims.get(n, 0)``); the module holds the permuted one."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    inverse = torch.argsort(perm)

    def to_original(mod, state_dict, prefix, local_metadata):
        for n, _ in mod.named_parameters(recurse=False):
            key = prefix + n
            if key in state_dict and isinstance(state_dict[key], torch.Tensor):
                state_dict[key] = _reorder(state_dict[key].detach(), inverse, dims.get(n, 0))

    def from_original(mod, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        for n, param in mod.named_parameters(recurse=False):
            key = prefix + n
            value = state_dict.get(key)
            if not isinstance(value, torch.Tensor) or value is param:
                continue
            dim = dims.get(n, 0)
            if isinstance(value, DTensor):
                value = _reorder(value, perm, dim).redistribute(param.device_mesh, param.placements)
            elif isinstance(param, DTensor):
                value = distribute_tensor(
                    value.index_select(dim, perm.to(value.device)).to(param.device),
                    param.device_mesh,
                    param.placements,
                    src_data_rank=None,
                )
            state_dict[key] = value

    module.register_state_dict_post_hook(to_original)
    module.register_load_state_dict_pre_hook(from_original)
