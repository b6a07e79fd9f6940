"""Applying a tensor-parallel plan over a 1-D mesh (before activation checkpointing, compile and FSDP).

Fused layers (one Linear producing q, k and v) are split chunk by chunk: their rows are reordered so
that each rank's contiguous shard holds its heads of every chunk. State dicts (sharded and full) keep
the original layout; optimizer state keeps the reordered one (resume with the same
``tensor_parallel_size``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from lit_parallel.parallel.tensor_parallel.plan import TPPlan, TPPlanError
from lit_parallel.parallel.tensor_parallel.trace import first_tensor

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: TPPlan, *, src_data_rank: int | None = 0) -> TPPlan:
    """Split ``model`` over the 1-D ``tp_mesh`` as ``plan`` says (before AC, compile and FSDP).

    Args:
        src_data_rank: rank of ``tp_mesh`` whose weights are scattered to the others (torch's default);
            ``None`` slices each rank's own copy (no communication; the ranks must already agree, e.g.
            after a broadcast from rank 0, or on the meta device).

    Head-count attributes are divided by the tensor-parallel size; with sequence parallelism the first
    block's input is split over the sequence (dimension 1) and the last block's output gathered.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    tp = tp_mesh.size()
    if plan.tp_size != tp:
        raise TPPlanError(
            f"the plan was made for tensor_parallel_size={plan.tp_size} but the mesh has {tp} ranks;"
            f" infer it again with tp_size={tp}"
        )
    if plan.fn is not None:
        plan.fn(model, tp_mesh)
        return plan
    if plan.styles:
        parallelize_module(model, tp_mesh, plan.styles, src_data_rank=src_data_rank)
    named = dict(model.named_modules())
    for path, attr, _, new in plan.head_attributes:
        setattr(named[path], attr, new)
    if plan.sequence_parallel and plan.first_block is not None:
        _install_sequence_boundaries(named[plan.first_block], named[plan.last_block], tp_mesh)
    return plan


def _install_sequence_boundaries(first: nn.Module, last: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split the stream over the sequence before the first block; gather it after the last one."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    tp = tp_mesh.size()

    def shard(module, args, kwargs):
        where = first_tensor(args, kwargs)
        if where is None:
            return None
        kind, key = where
        x = args[key] if kind == "arg" else kwargs[key]
        if isinstance(x, DTensor):
            return None
        if x.dim() < 2 or x.shape[1] % tp:
            raise TPPlanError(
                f"sequence_parallel=True: the sequence length {x.shape[1] if x.dim() > 1 else '?'} of the"
                f" input to {type(module).__name__} (dimension 1 of shape {tuple(x.shape)}) is not divisible"
                f" by tensor_parallel_size={tp}; pad the sequences to a multiple of {tp}"
            )
        x = DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False).redistribute(placements=[Shard(1)])
        x = x.to_local()
        if kind == "arg":
            return args[:key] + (x,) + args[key + 1 :], kwargs
        return args, {**kwargs, key: x}

    def gather(module, args, out):
        if not isinstance(out, torch.Tensor) or isinstance(out, DTensor):
            return out
        y = DTensor.from_local(out, tp_mesh, [Shard(1)], run_check=False).redistribute(
            placements=[Replicate()]
        )
        return y.to_local()

    first.register_forward_pre_hook(shard, with_kwargs=True)
    last.register_forward_hook(gather)


@torch.no_grad()
def local_parameter_bytes(module: nn.Module) -> dict[str, int]:
    """Bytes of each parameter this rank holds (the local shard of a DTensor)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in module.named_parameters():
        t = p.to_local() if isinstance(p, DTensor) else p
        out[name] = t.numel() * t.element_size()
    return out
