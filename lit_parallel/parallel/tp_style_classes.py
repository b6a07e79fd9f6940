"""The custom tensor-parallel styles (classes deriving from torch's ParallelStyles), in a module of their own
so that torch.distributed.tensor.parallel is imported only when a plan is applied (see tp_styles)."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

from torch.distributed.tensor import Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from lit_parallel.parallel.tp_plan import fused_permutation
from lit_parallel.parallel.tp_styles import (
    distribute_params,
    gather_output,
    permute_output,
    register_layout_hooks,
)


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
