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


def average_gradients(params: Sequence[torch.Tensor], group=None) -> list[bool]:
    """All-reduce ``.grad`` of ``params`` to their mean over ranks, exactly as DDP does; report use.

    A parameter counts as used when any rank produced a gradient for it; ranks without one contribute
    zeros. Parameters no rank used keep ``grad=None`` (as under DDP's ``find_unused_parameters``).
    Returns, per parameter, whether any rank used it. Like DDP, gradients are divided by the world
    size before they are summed.
    """
    params = list(params)
    device = params[0].device if params else torch.device("cpu")
    used = torch.tensor([float(p.grad is not None) for p in params], device=device)
    dist.all_reduce(used, op=dist.ReduceOp.MAX, group=group)
    used_any = [bool(u) for u in used.tolist()]
    live = [p for p, u in zip(params, used_any) if u]
    if live:
        world = dist.get_world_size(group)
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in live])
        flat.div_(world)
        dist.all_reduce(flat, group=group)
        offset = 0
        for p in live:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n
    return used_any
