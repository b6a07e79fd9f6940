"""The ``ParallelStyle`` each plan entry becomes, including those torch does not provide.

``FusedColwiseParallel`` splits a Linear whose output is several projections (fused q/k/v, gate/up)
chunk by chunk; ``TransposedColwiseParallel`` / ``TransposedRowwiseParallel`` split a projection whose
weight is stored ``(in, out)`` (HF ``Conv1D``: column-parallel shards weight dimension 1, row-parallel
dimension 0; fused chunks likewise); ``SequenceParallelNorm`` runs a norm on this rank's part of the
sequence and gathers its output once for the column-parallel layers it feeds. All subclass torch's
styles.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from lit_parallel.parallel.tensor_parallel.plan import (
    COLWISE,
    COLWISE_FUSED,
    LOSS_PARALLEL_HEAD,
    ROWWISE,
    SEQUENCE_PARALLEL,
    fused_permutation,
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
    if out_dim == 1 and kind in (COLWISE, COLWISE_FUSED, ROWWISE):
        if kind == ROWWISE:
            return (
                TransposedRowwiseParallel(output_layouts=Shard(1))
                if sequence_parallel
                else TransposedRowwiseParallel()
            )
        return TransposedColwiseParallel(sections if kind == COLWISE_FUSED else None)
    if kind == COLWISE:
        return ColwiseParallel()
    if kind == COLWISE_FUSED:
        return FusedColwiseParallel(sections or [])
    if kind == ROWWISE:
        return RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()
    if kind == SEQUENCE_PARALLEL:
        return SequenceParallelNorm()
    if kind == LOSS_PARALLEL_HEAD:
        return ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    raise ValueError(kind)


def distribute_params(module: nn.Module, mesh, placements: Mapping[str, Any], src_data_rank) -> None:

    for name, param in list(module.named_parameters(recurse=False)):
        dist = distribute_tensor(param, mesh, [placements[name]], src_data_rank=src_data_rank)
        module.register_parameter(name, nn.Parameter(dist, requires_grad=param.requires_grad))


def permute_output(module: nn.Module, perm: torch.Tensor, dims: Mapping[str, int]) -> None:
    """Reorder each parameter's output features (dimension ``dims[name]``) in ``perm`` order."""
    with torch.no_grad():
        for name, param in list(module.named_parameters(recurse=False)):
            param.data = param.data.index_select(dims.get(name, 0), perm.to(param.device))


def gather_output(module, outputs, device_mesh):

    return outputs.redistribute(placements=[Replicate()] * device_mesh.ndim)


def _reorder(value: torch.Tensor, index: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """``value`` with dimension ``dim`` taken in ``index`` order, a DTensor without gathering it whole."""

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
        perm = fused_permutation(self.sections, device_mesh.size())
        permute_output(module, perm, {})
        super()._partition_linear_fn(name, module, device_mesh)
        register_layout_hooks(module, perm, {})

    def __repr__(self) -> str:
        return f"FusedColwiseParallel(sections={self.sections})"


class _OwnPartition:
    """``_apply`` with the style's own ``_partition_fn`` (torch's styles choose theirs by module type, and
    know only ``nn.Linear`` / ``nn.Embedding``)."""

    def _apply(self, module, device_mesh):
        return distribute_module(
            module,
            device_mesh,
            self._partition_fn,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class TransposedColwiseParallel(_OwnPartition, ColwiseParallel):
    """Column-parallel for a projection whose weight is stored ``(in, out)`` (HF ``Conv1D``): weight
    sharded on dimension 1, bias on 0. With ``sections`` (packed q/k/v) each chunk is sharded
    separately, as :class:`FusedColwiseParallel` does; state dicts keep the original layout."""

    def __init__(self, sections: Sequence[int] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sections = list(sections or [])

    def _partition_fn(self, name, module, device_mesh):
        dims = {"weight": 1, "bias": 0}
        perm = fused_permutation(self.sections, device_mesh.size()) if self.sections else None
        if perm is not None:
            permute_output(module, perm, dims)
        placements = {"weight": Shard(1), "bias": Shard(0)}
        distribute_params(module, device_mesh, placements, self.src_data_rank)
        if perm is not None:
            register_layout_hooks(module, perm, dims)

    def __repr__(self) -> str:
        return f"TransposedColwiseParallel(sections={self.sections})"


class TransposedRowwiseParallel(_OwnPartition, RowwiseParallel):
    """Row-parallel for a projection whose weight is stored ``(in, out)`` (HF ``Conv1D``): weight
    sharded on dimension 0, bias replicated."""

    def _partition_fn(self, name, module, device_mesh):
        placements = {"weight": Shard(0), "bias": Replicate()}
        distribute_params(module, device_mesh, placements, self.src_data_rank)

    def _apply(self, module, device_mesh):
        self.desired_input_layouts = (Shard(-1),)  # the input arrives split over the features
        return super()._apply(module, device_mesh)

    def __repr__(self) -> str:
        return "TransposedRowwiseParallel()"


class SequenceParallelNorm(SequenceParallel):
    """A norm on this rank's part of the sequence whose output feeds column-parallel layers only: the
    output is gathered once (all-gather) and handed on as a replicated DTensor, so in backward those
    layers' input gradients are reduce-scattered back to the sequence shards."""

    def _apply(self, module, device_mesh):
        return distribute_module(
            module,
            device_mesh,
            self._replicate_module_fn,
            partial(self._prepare_input_fn, self.sequence_sharding),
            gather_output,
        )

    def __repr__(self) -> str:
        return "SequenceParallelNorm()"
