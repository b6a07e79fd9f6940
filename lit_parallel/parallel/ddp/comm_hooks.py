"""DDP building blocks: communication hooks and the gradient averaging of the probe step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

COMM_HOOKS = ("allreduce", "fp16", "bf16", "powersgd")


def validate_comm_hook(
    comm_hook: str | None,
    *,
    backend: str | None = None,
    powersgd_rank: int = 1,
    powersgd_warmup_steps: int = 2,
) -> None:
    """Refuse a hook name, its options, or a hook/backend pair that cannot work, with the fix.

    ``backend=None`` checks only what does not depend on the backend (call it again once known).
    """
    if comm_hook is None:
        return
    if comm_hook not in COMM_HOOKS:
        raise ValueError(
            f"comm_hook={comm_hook!r} is not a known DDP communication hook; choose one of"
            f" {', '.join(map(repr, COMM_HOOKS))} or None"
        )
    if comm_hook == "powersgd":
        if not isinstance(powersgd_rank, int) or powersgd_rank < 1:
            raise ValueError(f"powersgd_rank={powersgd_rank!r} must be an integer >= 1 (1 to 4 is typical)")
        if not isinstance(powersgd_warmup_steps, int) or powersgd_warmup_steps < 2:
            raise ValueError(
                f"powersgd_warmup_steps={powersgd_warmup_steps!r} must be an integer >= 2: PowerSGD's error"
                " feedback starts after DDP's first two iterations (plain all-reduce runs until then)"
            )
    if comm_hook == "bf16" and backend is not None and backend not in ("nccl", "xccl"):
        raise ValueError(
            f"comm_hook='bf16' needs the NCCL (CUDA) or XCCL backend, but the process group backend is"
            f" {backend!r}; use comm_hook='fp16' (works on gloo) or comm_hook=None"
        )


def build_comm_hook(
    comm_hook: str, process_group=None, *, powersgd_rank: int = 1, powersgd_warmup_steps: int = 2
) -> tuple[Any, Callable]:
    """The ``(state, hook)`` pair for ``DistributedDataParallel.register_comm_hook``."""
    validate_comm_hook(comm_hook, powersgd_rank=powersgd_rank, powersgd_warmup_steps=powersgd_warmup_steps)
    if comm_hook == "allreduce":
        return process_group, default_hooks.allreduce_hook
    if comm_hook == "fp16":
        return process_group, default_hooks.fp16_compress_hook
    if comm_hook == "bf16":
        return process_group, default_hooks.bf16_compress_hook
    state = powerSGD_hook.PowerSGDState(
        process_group=process_group,
        matrix_approximation_rank=powersgd_rank,
        start_powerSGD_iter=powersgd_warmup_steps,
    )
    return state, powerSGD_hook.powerSGD_hook


# most bytes average_gradients copies into one flat all-reduce (DDP's default bucket size)
AVERAGE_CHUNK_BYTES = 25 * 2**20


def average_gradients(
    params: Sequence[torch.Tensor], group=None, chunk_bytes: int = AVERAGE_CHUNK_BYTES
) -> list[bool]:
    """All-reduce ``.grad`` of ``params`` to their mean over ranks, exactly as DDP does; report use.

    A parameter counts as used when any rank produced a gradient for it; ranks without one contribute
    zeros. Parameters no rank used keep ``grad=None`` (as under DDP's ``find_unused_parameters``).
    Returns, per parameter, whether any rank used it. Like DDP, gradients are divided by the world
    size before they are summed. The gradients are averaged in place: small ones through one flat buffer
    of at most ``chunk_bytes`` at a time, larger ones each on its own, so the memory beyond the gradients
    is at most one chunk (plus the zeros a rank without a gradient receives into, which become its gradient).
    """
    params = list(params)
    device = params[0].device if params else torch.device("cpu")
    used = torch.tensor([float(p.grad is not None) for p in params], device=device)
    dist.all_reduce(used, op=dist.ReduceOp.MAX, group=group)
    used_any = [bool(u) for u in used.tolist()]
    world = dist.get_world_size(group)
    chunk: list[torch.Tensor] = []
    for p, u in zip(params, used_any):
        if not u:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grad = p.grad
        grad.div_(world)
        if grad.numel() * grad.element_size() >= chunk_bytes or not grad.is_contiguous():
            dist.all_reduce(grad, group=group)
            continue
        if chunk and (
            chunk[0].dtype != grad.dtype
            or chunk[0].device != grad.device
            or sum(g.numel() for g in chunk) * grad.element_size() + grad.numel() * grad.element_size()
            > chunk_bytes
        ):
            _all_reduce_flat(chunk, group)
            chunk = []
        chunk.append(grad)
    if chunk:
        _all_reduce_flat(chunk, group)
    return used_any


def _all_reduce_flat(grads: list[torch.Tensor], group: Any) -> None:
    """Sum ``grads`` over ``group`` through one flat buffer, written back into them."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
