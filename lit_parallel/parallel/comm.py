"""Count the collectives a piece of code issues, with their payload bytes.

Collectives issued from Python (DDP communication hooks, FSDP2, DTensor redistribution, Lightning's
``sync_dist``) go through the ``torch.distributed`` module functions; while :func:`count_collectives`
is active those functions are wrapped process-wide (callbacks of asynchronous work included) and
each call is tallied. DDP's built-in C++ all-reduce (no comm hook) bypasses Python and is not seen:
register ``comm_hook="allreduce"`` to count it.
"""

from __future__ import annotations

import inspect
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# collective -> the argument holding what this rank sends
_COUNTED = {
    "all_reduce": "tensor",
    "broadcast": "tensor",
    "reduce": "tensor",
    "all_gather": "tensor",
    "all_gather_into_tensor": "input_tensor",
    "all_gather_single": "input_tensor",  # FSDP2 (torch >= 2.13)
    "reduce_scatter": "input_list",
    "reduce_scatter_tensor": "input",
    "reduce_scatter_single": "input",  # FSDP2 (torch >= 2.13)
    "all_to_all_single": "input",
}


@dataclass
class CollectiveStats:
    """Calls and payload bytes per collective name (the input a rank contributes)."""

    calls: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    return 0


_lock = threading.Lock()
_active: list[CollectiveStats] = []
_originals: dict[str, object] = {}


def _wrap(name: str, fn, payload_arg: str):
    signature = inspect.signature(fn)

    def counted(*args, **kwargs):
        nbytes = _nbytes(signature.bind_partial(*args, **kwargs).arguments.get(payload_arg))
        with _lock:
            for stats in _active:
                stats.calls[name] += 1
                stats.bytes[name] += nbytes
        return fn(*args, **kwargs)

    counted.__wrapped__ = fn
    return counted


@contextmanager
def count_collectives(stats: CollectiveStats | None = None) -> Iterator[CollectiveStats]:
    """Tally ``torch.distributed`` collectives (calls and bytes) issued while the context is open."""
    stats = stats if stats is not None else CollectiveStats()
    with _lock:
        if not _active:
            for name, payload_arg in _COUNTED.items():
                if hasattr(dist, name):
                    _originals[name] = getattr(dist, name)
                    setattr(dist, name, _wrap(name, _originals[name], payload_arg))
        _active.append(stats)
    try:
        yield stats
    finally:
        with _lock:
            _active.remove(stats)
            if not _active:
                for name, fn in _originals.items():
                    setattr(dist, name, fn)
                _originals.clear()
