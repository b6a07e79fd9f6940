"""Scenarios that check the harness itself."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


def allreduce_rank(ctx) -> dict:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return {"sum": t.item(), "rank": dist.get_rank(), "world": dist.get_world_size()}


def rank1_raises(ctx) -> dict:
    dist.barrier()
    if dist.get_rank() == 1:
        time.sleep(0.2)
        raise ValueError("scenario failure injected on rank 1")
    # The other ranks wait in a collective that rank 1 never joins; only the launcher can end them.
    dist.all_reduce(torch.ones(1))
    return {}
