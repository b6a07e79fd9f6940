"""Counting the bytes pipeline stages send each other (point-to-point), for tests and benchmarks.

torch's pipelining sends activations and their gradients with ``torch.distributed.isend`` (alone or
inside ``batch_isend_irecv``); :func:`count_p2p` wraps it while active and records every send.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

__all__ = ["P2PRecord", "count_p2p"]


@dataclass
class P2PRecord:
    """Point-to-point sends of this rank: ``(peer global rank, bytes, dtype)`` each."""

    sends: list[tuple[int, int, str]] = field(default_factory=list)


@contextmanager
def count_p2p() -> Iterator[P2PRecord]:
    """Record every ``isend`` this rank issues while the context is active (this thread or any)."""
    record = P2PRecord()
    original = distributed_c10d.isend

    def isend(tensor: torch.Tensor, dst: int | None = None, group=None, tag: int = 0, group_dst=None):
        peer = dst if dst is not None else dist.get_global_rank(group, group_dst)
        record.sends.append((peer, tensor.numel() * tensor.element_size(), str(tensor.dtype)))
        return original(tensor, dst=dst, group=group, tag=tag, group_dst=group_dst)

    # P2POp checks its op against the module's own isend: both names must point at the wrapper
    distributed_c10d.isend = dist.isend = isend
    try:
        yield record
    finally:
        distributed_c10d.isend = dist.isend = original
