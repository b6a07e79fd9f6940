"""FSDP2 (``torch.distributed.fsdp.fully_shard``) per transformer block, without a Trainer: sharding, the
precision and offload policies, gradient sync control, clipping of sharded gradients, full state dicts and
the plan the strategies log.

:func:`apply_fsdp` only shards; the order of the steps around it (tensor parallel, activation
checkpointing, compile, materialisation) is :func:`lit_parallel.parallel.parallelize`'s.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lit_parallel._compat import foreach_mul_
from lit_parallel.formatting import format_bytes
from lit_parallel.parallel.blocks import BlockPlan, BlockTypes, find_transformer_blocks
from lit_parallel.parallel.expert_parallel.apply import RemoteExpert, expert_norm_group
from lit_parallel.parallel.materialize import mesh_device
from lit_parallel.parallel.memory import MemoryEstimate, estimate_memory
from lit_parallel.parallel.mesh import ParallelDims, mesh_group_ranks

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

# Trainer precision flag -> what FSDP2 casts. "bf16-mixed": FSDP's policy does the casting (bf16 compute and
# all-gathers, fp32 sharded parameters and gradient reduction), so autocast must stay off.
SUPPORTED_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-true")


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy | None:
    """FSDP2's policy for a Lightning precision flag (``None``: nothing to cast)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision not in SUPPORTED_PRECISIONS:
        raise ValueError(
            f"precision={precision!r} is not supported with FSDP2; choose one of {SUPPORTED_PRECISIONS}"
        )
    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


def offload_policy(cpu_offload: bool, device: torch.device, *, warn: bool = True) -> OffloadPolicy | None:
    """``CPUOffloadPolicy`` on accelerators; on a CPU-only run parameters already live on the CPU, so it is
    a no-op (FSDP2's policy itself requires an accelerator) and a warning says so."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    if not cpu_offload:
        return None
    if device.type == "cpu":
        if not warn:
            return None
        warnings.warn(
            "cpu_offload=True has no effect on a CPU-only run: parameters, gradients and optimizer state are"
            " already in CPU memory (FSDP2's CPUOffloadPolicy needs an accelerator). Continuing without it.",
            stacklevel=2,
        )
        return None
    return CPUOffloadPolicy()


def apply_fsdp(
    module: nn.Module,
    mesh: DeviceMesh,
    blocks: BlockTypes | BlockPlan | Iterable[nn.Module] = "auto",
    *,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload: OffloadPolicy | None = None,
    forward_methods: Iterable[str] = (),
) -> None:
    """Shard ``module`` with FSDP2 over ``mesh`` (1-D: FSDP; 2-D (replicate, shard): HSDP): each block, then
    the root (bottom-up), so that each block is one all-gather / reduce-scatter group and the parameters
    outside blocks (embeddings, final norm, heads) are sharded too.

    Args:
        blocks: the blocks (modules, in module order; may be a generator that readies each block just
            before it is sharded, as :func:`~lit_parallel.parallel.parallelize` does), a block plan, or
            ``block_types`` for :func:`find_transformer_blocks`.
        reshard_after_forward: ``True`` frees each block's gathered parameters after forward and gathers them
            again in backward (ZeRO-3); ``False`` keeps them until after backward (ZeRO-2). The root group
            (``module``'s own parameters) is never resharded after forward: its forward encloses every
            block's, so its parameters are gathered all through forward either way, and backward needs
            them first (torch's own choice for the root, ``fully_shard``'s ``reshard_after_forward=None``):
            one all-gather less per step, the same peak.
        mp_policy: FSDP2 mixed-precision policy (``None``: compute in the parameters' dtype).
        offload: FSDP2 offload policy (``None``: keep everything on the device).
        forward_methods: methods of ``module`` besides ``forward`` that run the model
            (``"training_step"``, ...): FSDP gathers the root group's parameters around them even when the
            module's own ``forward`` is never called.
    """
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    if isinstance(blocks, (str, BlockPlan)) or callable(blocks) or _is_type_set(blocks):
        plan = blocks if isinstance(blocks, BlockPlan) else find_transformer_blocks(module, blocks)
        blocks = [block for _, block in plan.blocks]
    kwargs = {"mesh": mesh, **fsdp_kwargs(reshard_after_forward, mp_policy, offload)}
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(module, **{**kwargs, "reshard_after_forward": False})
    for name in forward_methods:
        if callable(getattr(module, name, None)):
            register_fsdp_forward_method(module, name)


def fsdp_kwargs(
    reshard_after_forward: bool,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload: OffloadPolicy | None = None,
) -> dict[str, Any]:
    """``fully_shard``'s keyword arguments besides the mesh (the policies only when given)."""
    kwargs: dict[str, Any] = {"reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if offload is not None:
        kwargs["offload_policy"] = offload
    return kwargs


def _is_type_set(blocks: Any) -> bool:
    """``block_types`` given as classes or class names (rather than the block modules themselves)."""
    if isinstance(blocks, (list, tuple, set, frozenset)):
        return all(isinstance(b, (type, str)) for b in blocks) and len(blocks) > 0
    return False


# --- training-time helpers ------------------------------------------------------------------------------


def set_gradient_sync(module: nn.Module, enabled: bool) -> None:
    """Turn FSDP's gradient reduction on or off for every FSDP group in ``module``.

    Off: gradients accumulate unsharded and nothing is communicated in backward (non-final micro-batches
    of gradient accumulation); the next backward with it on reduce-scatters the accumulated gradients.
    """
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_requires_gradient_sync(enabled, recurse=False)


@contextmanager
def no_gradient_sync(module: nn.Module) -> Iterator[None]:
    """Context manager: no gradient reduction inside (see :func:`set_gradient_sync`)."""
    set_gradient_sync(module, False)
    try:
        yield
    finally:
        set_gradient_sync(module, True)


def _grad_group_key(g: torch.Tensor) -> tuple:
    """Gradients that reduce alike: the same mesh (its dimension names and, per dimension, the ranks of this
    rank's group: the same on every rank of the group, so every rank sorts the groups alike) and placements.

    Read from the process groups, not from ``DeviceMesh.mesh``: a sub-mesh builds that tensor from the full
    mesh with ``.item()`` calls, several host reads per gradient group and step."""
    from torch.distributed.tensor import DTensor

    if isinstance(g, DTensor):
        mesh = g.device_mesh
        return (1, str(mesh.mesh_dim_names), str(mesh_group_ranks(mesh)), str(g.placements))
    return (0, str(g.device), "", "")


def _moved(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``. From the CPU without waiting (a scalar in pageable memory is staged at once);
    to the CPU it waits for the device (only CPU-offloaded gradients need that)."""
    if t.device == device:
        return t
    return t.to(device, non_blocking=t.device.type == "cpu")


def _local_norm(
    tensors: list[torch.Tensor], norm_type: float, foreach: bool | None, device: torch.device
) -> torch.Tensor:
    """Norm of local tensors that may sit on different devices (CPU-offloaded shards), in fp32 on ``device``."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    norms = [
        _moved(torch.nn.utils.get_total_norm(ts, norm_type, False, foreach).float(), device)
        for ts in by_device.values()
    ]
    return torch.nn.utils.get_total_norm(norms, norm_type, False, foreach)


def _reduce_device(mesh: DeviceMesh, local: torch.device) -> torch.device:
    """Where a DTensor group's norm is reduced: its process groups' device. The gradients' own device when
    it is of the mesh's type (no copy); CPU-offloaded shards' norm goes to the mesh's device."""
    return local if local.type == mesh.device_type else mesh_device(mesh)


def _norm_device(grads: list[torch.Tensor]) -> torch.device:
    """Where the total norm is computed and returned: the device the first DTensor gradient group reduces on
    (the mesh's), else the first gradient's device. Never the CPU for gradients on an accelerator, so the
    norm can go straight into another collective (``pp_dp`` combines it over the pipeline ranks) and the
    scaling reads it without a device->host copy."""
    from torch.distributed.tensor import DTensor

    for g in grads:
        if isinstance(g, DTensor):
            return _reduce_device(g.device_mesh, g.to_local().device)
    return grads[0].device


@torch.no_grad()
def grad_norm(
    parameters: Iterable[torch.Tensor] | torch.Tensor, norm_type: float = 2.0, foreach: bool | None = None
) -> torch.Tensor:
    """The total norm of the gradients of ``parameters`` (any mix of plain and DTensor gradients), an fp32
    scalar on the gradients' device (see :func:`clip_grad_norm_`); nothing is scaled, nothing waits on the
    host. Every rank of the gradients' meshes must call it with the same parameters."""
    from torch.distributed.tensor import DTensor

    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        device = params[0].device if params else torch.device("cpu")
        return torch.zeros((), dtype=torch.float32, device=device)
    device = _norm_device(grads)
    groups: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(_grad_group_key(g), []).append(g)
    inf = norm_type == float("inf")
    norms = []
    for key in sorted(groups):
        members = groups[key]
        if not isinstance(members[0], DTensor):
            norms.append(_local_norm(members, norm_type, foreach, device))
            continue
        mesh, placements = members[0].device_mesh, members[0].placements
        local = [g.to_local() for g in members]
        on = _reduce_device(mesh, local[0].device)
        norm = _local_norm(local, norm_type, foreach, on)
        value = norm if inf else norm**norm_type
        for dim, placement in enumerate(placements):
            # every split dimension is summed: Shard, and FSDP's _StridedShard for TP-split weights
            if not placement.is_replicate():
                op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
                dist.all_reduce(value, op=op, group=mesh.get_group(dim))
        # module-list experts: the other expert-parallel ranks hold other experts under a mesh alike
        other = expert_norm_group(mesh)
        if other is not None:
            dist.all_reduce(value, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=other)
        norms.append(_moved(value if inf else value ** (1.0 / norm_type), device))
    return torch.nn.utils.get_total_norm(norms, norm_type, False, foreach)


@torch.no_grad()
def scale_grads_(parameters: Iterable[torch.Tensor], coef: torch.Tensor) -> None:
    """Multiply every gradient (a DTensor's local shard) by ``coef`` in place, one kernel per device; ``coef``
    is copied once per other device (to the CPU for CPU-offloaded gradients: the only wait on the device)."""
    from torch.distributed.tensor import DTensor

    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            t = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            by_device.setdefault(t.device, []).append(t)
    for dev, ts in by_device.items():
        foreach_mul_(ts, _moved(coef, dev))


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for any mix of plain and sharded (DTensor) gradients.

    Gradients are grouped by mesh and placement. A group's local norm is reduced over the mesh dimensions
    its gradients are split on (``Shard`` or ``_StridedShard``; replicated dimensions hold copies and are
    not summed), so gradients on different meshes (TP + FSDP) combine correctly; the group norms
    combine into the global norm, and every gradient (its local shard) is scaled in place. Works with
    CPU-offloaded shards. Every rank must call it with the same parameters: it communicates once per
    sharded mesh dimension of each DTensor group.

    Returns the total norm, an fp32 scalar on the gradients' device (the mesh's device for DTensor
    gradients, also when they are offloaded to the CPU), as torch's does: it can be handed to a collective
    of the mesh's process groups, and neither computing nor applying it waits on the host (unless
    ``error_if_nonfinite``, which must read it, or CPU-offloaded gradients, which are scaled on the CPU).
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    total = grad_norm(params, norm_type, foreach)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients is non-finite ({total.item()}); set"
            " error_if_nonfinite=False to scale them anyway"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    scale_grads_(params, coef)
    return total


# --- full state dicts -----------------------------------------------------------------------------------


def load_full_state_dict(
    module: nn.Module, state_dict: Mapping[str, torch.Tensor] | str | Path | None, *, strict: bool = True
) -> None:
    """Load a full (unsharded) state dict into a sharded ``module``: rank 0 reads it, the others receive it.

    ``state_dict`` is a path (``torch.load(..., mmap=True, weights_only=True)`` on rank 0 only) or a dict;
    other ranks may pass ``None``. Tensors go out one at a time, and each rank keeps only its shard.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    rank = dist.get_rank() if dist.is_initialized() else 0
    full: dict[str, torch.Tensor] = {}
    if rank == 0:
        if state_dict is None:
            raise ValueError("rank 0 needs the full state dict (a path or a dict); got None")
        if isinstance(state_dict, (str, Path)):
            full = torch.load(state_dict, mmap=True, weights_only=True, map_location="cpu")
        else:
            full = dict(state_dict)
    # module-list experts under expert parallelism: each rank holds some experts, the file has them all
    partial = any(isinstance(m, RemoteExpert) for m in module.modules())
    if partial and strict:
        _check_every_local_key_is_in(module, full)
    set_model_state_dict(
        module,
        full,
        options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True, strict=strict and not partial
        ),
    )


def _check_every_local_key_is_in(module: nn.Module, full: Mapping[str, torch.Tensor]) -> None:
    """Rank 0's keys reach every rank; each checks that the file holds all of its own (strict loading where
    ranks hold different parts of the model)."""
    keys = [sorted(full)]
    if dist.is_initialized():
        dist.broadcast_object_list(keys, src=0)
    missing = sorted(set(module.state_dict()) - set(keys[0]))
    if missing:
        raise KeyError(
            f"the full state dict lacks {len(missing)} key(s) this rank holds, e.g. {missing[:3]}; pass the"
            " whole model's state dict (every expert), or strict=False"
        )


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict on CPU, on rank 0 only (other ranks get ``{}``); every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


# --- plans ----------------------------------------------------------------------------------------------


@dataclass
class FSDPPlan:
    """What :func:`apply_fsdp` will do to a model and what it costs per rank."""

    blocks: BlockPlan
    dims: ParallelDims
    memory: MemoryEstimate
    reshard_after_forward: bool = True
    precision: str = "32-true"
    activation_checkpointing: bool = False
    compile: bool = False
    cpu_offload: bool = False

    def describe(self) -> str:
        mode = "ZeRO-3 (reshard_after_forward=True)" if self.reshard_after_forward else "ZeRO-2 (False)"
        flags = [
            f"precision {self.precision}",
            f"activation checkpointing {'on' if self.activation_checkpointing else 'off'}",
            f"compile {'on' if self.compile else 'off'}",
        ]
        if self.cpu_offload:
            flags.append("cpu offload")
        classes = ", ".join(c.__name__ for c in self.blocks.block_types)
        return "\n".join(
            [
                f"FSDP2 plan ({self.blocks.how} block discovery): block classes {classes}",
                f"  {self.blocks.describe()}",
                f"  mesh {self.dims.describe()}; {mode}; {', '.join(flags)}",
                f"  estimated parameters + gradients + optimizer state: {self.memory.describe()}",
            ]
        )

    def summary(self) -> str:
        """The decision in one line (what the strategies log at INFO; :meth:`describe` has the details)."""
        mode = "ZeRO-3" if self.reshard_after_forward else "ZeRO-2"
        extras = [f"precision {self.precision}"]
        extras += ["activation checkpointing"] if self.activation_checkpointing else []
        extras += ["compile"] if self.compile else []
        extras += ["cpu offload"] if self.cpu_offload else []
        classes = ", ".join(c.__name__ for c in self.blocks.block_types)
        per_class = "; ".join(self.blocks.counts())
        return (
            f"FSDP2 plan ({self.blocks.how} block discovery): block classes {classes}: {per_class} + root;"
            f" {mode}, {', '.join(extras)}; {format_bytes(self.memory.total_bytes)} per rank"
            f" ({self.memory.strategy} over {self.dims.data_parallel_shard} of {self.dims.world_size} ranks)"
        )

    def __str__(self) -> str:
        return self.describe()


def plan_fsdp(
    module: nn.Module,
    *,
    world_size: int,
    shard_size: int | None = None,
    block_types: BlockTypes | BlockPlan = "auto",
    optimizer: str = "adamw",
    precision: str = "32-true",
    reshard_after_forward: bool = True,
    activation_checkpointing: bool = False,
    compile: bool = False,
    cpu_offload: bool = False,
) -> FSDPPlan:
    """The plan the ``fsdp_blocks`` / ``hsdp`` strategies log, computed without a Trainer or process group.

    Works on a model built on the meta device. ``shard_size`` < ``world_size`` means HSDP. ``optimizer``
    (``"adamw"``, ``"sgd"``, ...) sets the optimizer state in the memory estimate.
    """
    blocks = (
        block_types if isinstance(block_types, BlockPlan) else find_transformer_blocks(module, block_types)
    )
    if shard_size is None or shard_size == world_size:
        dims = ParallelDims.for_fsdp(world_size)
    else:
        dims = ParallelDims.for_hybrid_shard(world_size, shard_size)
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    if precision in ("bf16-true", "16-true"):
        param_dtype: torch.dtype = torch.bfloat16 if precision == "bf16-true" else torch.float16
    else:
        param_dtype = next((p.dtype for p in module.parameters()), torch.float32)
    memory = estimate_memory(
        trainable,
        strategy="hsdp" if dims.replicate_enabled else "fsdp",
        world_size=world_size,
        shard_size=dims.data_parallel_shard,
        param_dtype=param_dtype,
        optimizer=optimizer,
    )
    return FSDPPlan(
        blocks=blocks,
        dims=dims,
        memory=memory,
        reshard_after_forward=reshard_after_forward,
        precision=precision,
        activation_checkpointing=activation_checkpointing,
        compile=bool(compile),
        cpu_offload=cpu_offload,
    )
