"""Per-sample fingerprints of a batch: equal samples give equal numbers, on any device, cheaply.

Each sample's bytes are read as integers and combined with fixed odd random weights in int64 arithmetic,
which wraps around: the result is exact and independent of reduction order, so the same sample gives
the same fingerprint on every rank and every device, while different samples collide with probability
about 2**-64.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

_WEIGHTS: dict[tuple[int, torch.device], torch.Tensor] = {}
_MIX = 1_000_003


def tensor_leaves(batch: Any) -> list[torch.Tensor]:
    """The tensors of a (nested) batch in a fixed order."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        return [t for v in batch.values() for t in tensor_leaves(v)]
    if isinstance(batch, (list, tuple)):
        return [t for v in batch for t in tensor_leaves(v)]
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return [t for f in dataclasses.fields(batch) for t in tensor_leaves(getattr(batch, f.name))]
    return []


def _weights(n: int, device: torch.device) -> torch.Tensor:
    key = (n, device)
    w = _WEIGHTS.get(key)
    if w is None:
        gen = torch.Generator().manual_seed(0x5EED + n)
        w = (torch.randint(-(2**62), 2**62, (n,), generator=gen, dtype=torch.int64) * 2 + 1).to(device)
        _WEIGHTS[key] = w
    return w


def _as_int64(x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.float64:
        return x.contiguous().view(torch.int64)
    if x.dtype == torch.float32:
        return x.contiguous().view(torch.int32).to(torch.int64)
    if x.dtype in (torch.float16, torch.bfloat16):
        return x.contiguous().view(torch.int16).to(torch.int64)
    if x.is_complex():
        return _as_int64(torch.view_as_real(x).reshape(x.shape[0], -1))
    return x.to(torch.int64)


def batch_fingerprints(batch: Any) -> torch.Tensor | None:
    """One int64 per sample of ``batch`` (samples along dim 0 of its tensors), on the batch's device."""
    leaves = [t for t in tensor_leaves(batch) if t.ndim >= 1]
    if not leaves:
        return None
    n = leaves[0].shape[0]
    fp = torch.zeros(n, dtype=torch.int64, device=leaves[0].device)
    for t in leaves:
        if t.shape[0] != n or t.device != fp.device:
            continue
        x = _as_int64(t.detach().reshape(n, -1))
        fp = fp * _MIX + (x * _weights(x.shape[1], x.device)).sum(1)
    return fp


def bottom_k(fingerprints: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` smallest distinct fingerprints (a MinHash sketch: equal sets give equal sketches)."""
    return torch.unique(fingerprints)[:k]
