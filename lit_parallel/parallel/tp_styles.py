"""The ``ParallelStyle`` each plan entry becomes, including the two torch does not provide.

``FusedColwiseParallel`` splits a Linear whose output is several projections (fused q/k/v, gate/up)
chunk by chunk; ``SequenceParallelNorm`` runs a norm on this rank's part of the sequence and gathers its
output once for the column-parallel layers it feeds. Both subclass torch's styles, which are only
imported when a style is built (``torch.distributed.tensor`` is not needed to infer or print a plan).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from lit_parallel.parallel.tp_plan import (
    COLWISE,
    COLWISE_FUSED,
    LOSS_PARALLEL_HEAD,
    ROWWISE,
    SEQUENCE_PARALLEL,
    fused_permutation,
)


def parallel_style(kind: str, *, sections: Sequence[int] | None = None, sequence_parallel: bool = False):
    """The ``ParallelStyle`` for a plan entry of style ``kind`` (``sections``: a fused layer's chunks)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    fused_cls, sp_norm_cls = _custom_styles()
    if kind == COLWISE:
        return ColwiseParallel()
    if kind == COLWISE_FUSED:
        return fused_cls(sections or [])
    if kind == ROWWISE:
        return RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()
    if kind == SEQUENCE_PARALLEL:
        return sp_norm_cls()
    if kind == LOSS_PARALLEL_HEAD:
        return ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    raise ValueError(kind)


@functools.cache
def _custom_styles():
    from torch.distributed.tensor import distribute_module
    from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel

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
            tp = device_mesh.size()
            perm = fused_permutation(self.sections, tp)
            with torch.no_grad():
                for param in list(module.parameters(recurse=False)):
                    param.data = param.data[perm.to(param.device)]
            super()._partition_linear_fn(name, module, device_mesh)
            _register_layout_hooks(module, perm)

        def __repr__(self) -> str:
            return f"FusedColwiseParallel(sections={self.sections})"

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
                _gather_output,
            )

        def __repr__(self) -> str:
            return "SequenceParallelNorm()"

    return FusedColwiseParallel, SequenceParallelNorm


def _gather_output(module, outputs, device_mesh):
    from torch.distributed.tensor import Replicate

    return outputs.redistribute(placements=[Replicate()] * device_mesh.ndim)


def _reorder(value: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``value`` with its rows (dim 0) taken in ``index`` order, a DTensor without gathering it whole."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(value, DTensor):
        return value[index.to(value.device)]
    mesh = value.device_mesh
    # dim 0 must be whole on each rank to reorder it locally: shard dim 1 instead (2-D weight)
    target = [Shard(1) if value.dim() >= 2 else Replicate()] * mesh.ndim
    v = value.redistribute(mesh, target)
    local = v.to_local()[index.to(v.to_local().device)]
    return DTensor.from_local(local, mesh, target, shape=v.shape, stride=v.stride(), run_check=False)


def _register_layout_hooks(module: nn.Module, perm: torch.Tensor) -> None:
    """State dicts of a fused layer keep the original row order; the module holds the permuted one."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    inverse = torch.argsort(perm)

    def to_original(mod, state_dict, prefix, local_metadata):
        for n, _ in mod.named_parameters(recurse=False):
            key = prefix + n
            if key in state_dict and isinstance(state_dict[key], torch.Tensor):
                state_dict[key] = _reorder(state_dict[key].detach(), inverse)

    def from_original(mod, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        for n, param in mod.named_parameters(recurse=False):
            key = prefix + n
            value = state_dict.get(key)
            if not isinstance(value, torch.Tensor) or value is param:
                continue
            if isinstance(value, DTensor):
                value = _reorder(value, perm).redistribute(param.device_mesh, param.placements)
            elif isinstance(param, DTensor):
                value = distribute_tensor(
                    value[perm.to(value.device)].to(param.device),
                    param.device_mesh,
                    param.placements,
                    src_data_rank=None,
                )
            state_dict[key] = value

    module.register_state_dict_post_hook(to_original)
    module.register_load_state_dict_pre_hook(from_original)
