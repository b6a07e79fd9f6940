"""Count the collectives a piece of code issues, with their payload bytes.

Two views, because no single hook sees everything:

* :class:`CommCounter` is a ``TorchDispatchMode``: it sees every ``c10d`` op issued on the current
  thread, whoever issues it (DDP's C++ reducer, FSDP2, DTensor redistribution, user code), with the
  group size, so ring-algorithm bytes sent can be derived. It does not see collectives issued from
  other threads, e.g. those PowerSGD launches from its futures' callbacks.
* :func:`count_collectives` wraps the ``torch.distributed`` Python functions process-wide while it is
  active, so it also sees collectives issued from other threads; it misses C++ callers (DDP's built-in
  all-reduce: register ``comm_hook="allreduce"`` to route it through Python).
"""

from __future__ import annotations

import inspect
import math
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lit_parallel._compat import TorchDispatchMode, resolve_process_group

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


# --- communication --------------------------------------------------------------------------------------

_KINDS = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "broadcast_": "broadcast",
    "alltoall_base_": "all_to_all",
    "barrier": "barrier",
}


@dataclass(frozen=True)
class Collective:
    """One collective call: its kind, payload bytes (the full tensor it reduces/gathers), group size."""

    kind: str
    payload_bytes: int
    group_size: int

    @property
    def sent_bytes(self) -> float:
        """Bytes each rank sends with the ring algorithm."""
        n = self.group_size
        if n <= 1:
            return 0.0
        if self.kind == "all_reduce":
            return 2 * (n - 1) / n * self.payload_bytes
        if self.kind in ("all_gather", "reduce_scatter", "all_to_all"):
            return (n - 1) / n * self.payload_bytes
        if self.kind == "broadcast":
            return float(self.payload_bytes)
        return 0.0


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


def _group_size(args: tuple) -> int:
    import torch.distributed as dist

    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(a).size()
            except Exception:  # noqa: S112 - a ReduceOp or Work object, not the group
                continue
    return 1


class CommCounter(TorchDispatchMode):
    """Records every ``c10d`` collective issued while active (use as a context manager).

    ``records`` holds one :class:`Collective` per call; ``counts()`` and ``sent_bytes()`` summarise.
    Payload: all-gather = gathered output, reduce-scatter = unreduced input, all-reduce / broadcast = the
    tensor. DTensor operations are seen as the collectives they issue. Collectives issued from other
    threads are not seen.
    """

    def __init__(self) -> None:
        super().__init__()
        self.records: list[Collective] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            # Let DTensor run first and desugar into the collectives it needs; they come back here
            # (as in torch's CommDebugMode).
            return NotImplemented
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            kind = _KINDS.get(_op_name(func))
            if kind is not None:
                self.records.append(Collective(kind, self._payload(kind, args), _group_size(args)))
        elif func.namespace == "_c10d_functional":  # DTensor redistribution, functional collectives
            record = _functional_record(_op_name(func), args)
            if record is not None:
                self.records.append(record)
        return func(*args, **kwargs)

    @staticmethod
    def _payload(kind: str, args: tuple) -> int:
        if kind == "all_gather":
            out = _tensors(args[0])
        elif kind == "reduce_scatter":
            out = _tensors(args[1])
        else:
            out = _tensors(args[0])
        return sum(t.numel() * t.element_size() for t in out)

    def counts(self) -> dict[str, int]:
        return dict(Counter(r.kind for r in self.records))

    def payload_bytes(self, kind: str | None = None) -> int:
        return sum(r.payload_bytes for r in self.records if kind is None or r.kind == kind)

    def sent_bytes(self, kinds: tuple[str, ...] = ("all_gather", "reduce_scatter", "all_reduce")) -> float:
        """Bytes this rank sent in ``kinds`` collectives (ring algorithm)."""
        return sum(r.sent_bytes for r in self.records if r.kind in kinds)

    def clear(self) -> None:
        self.records.clear()


def _op_name(func: Any) -> str:
    # "c10d::allreduce_" (name() adds ".overload" for overloads other than the default)
    return func.name().split("::", 1)[1].split(".", 1)[0]


def _functional_group_size(group: Any) -> int:
    if isinstance(group, dist.ProcessGroup):
        return group.size()
    if isinstance(group, torch.ScriptObject):
        return dist.ProcessGroup.unbox(group).size()
    return resolve_process_group(group).size()


def _functional_record(name: str, args: tuple) -> Collective | None:
    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    if name == "all_reduce":  # (input, reduce_op, group_name)
        return Collective("all_reduce", nbytes(args[0]), _functional_group_size(args[2]))
    if name == "all_gather_into_tensor":  # (input, group_size, group_name)
        return Collective("all_gather", nbytes(args[0]) * args[1], args[1])
    if name == "reduce_scatter_tensor":  # (input, reduce_op, group_size, group_name)
        return Collective("reduce_scatter", nbytes(args[0]), args[2])
    if name == "all_to_all_single":  # (input, output_split_sizes, input_split_sizes, group_name)
        # payload: what arrives, as for c10d's alltoall_base_ (its output)
        rows = sum(args[1]) if args[1] else args[0].shape[0]
        row_bytes = args[0].element_size() * math.prod(args[0].shape[1:])
        return Collective("all_to_all", rows * row_bytes, _functional_group_size(args[3]))
    if name == "broadcast":  # (input, src, group_name)
        return Collective("broadcast", nbytes(args[0]), _functional_group_size(args[2]))
    return None


def bus_bandwidth(nbytes: int, seconds: float, world_size: int) -> tuple[float, float]:
    """(algorithm bandwidth, bus bandwidth) in GB/s for an all-reduce of ``nbytes`` (nccl-tests' definitions)."""
    algbw = nbytes / seconds / 1e9
    return algbw, algbw * 2 * (world_size - 1) / world_size if world_size > 1 else algbw
