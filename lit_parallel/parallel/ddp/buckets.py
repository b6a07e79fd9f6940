"""DDP bucket sizes chosen from a measurement of the cluster's all-reduce and the model's gradients.

A bucket's all-reduce costs about ``latency + bytes / bandwidth`` (the alpha-beta model). Buckets
must be large enough that the fixed latency is a small share of each call, and the first bucket
(DDP fills it with the gradients that are ready first, i.e. the last layers) small enough that
communication starts early in backward and overlaps the rest of it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

MiB = 1 << 20
_ALIGN = 4096  # bucket caps are multiples of 4 KiB, so `bytes / MiB` is exact in binary floating point


@dataclass(frozen=True)
class AllReduceMeasurement:
    """Fitted all-reduce cost ``latency_s + nbytes / bandwidth_bytes_per_s`` on this cluster."""

    latency_s: float
    bandwidth_bytes_per_s: float
    world_size: int
    backend: str
    small_bytes: int
    large_bytes: int
    small_s: float
    large_s: float

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class BucketPlan:
    """Per-bucket byte caps for DDP (``bucket_cap_mb_list``): the first bucket, then every other one."""

    first_bytes: int
    rest_bytes: int
    reason: str

    @property
    def cap_mb_list(self) -> list[float]:
        """The value for ``DistributedDataParallel(bucket_cap_mb_list=...)`` (MiB; the last repeats)."""
        return [self.first_bytes / MiB, self.rest_bytes / MiB]

    @property
    def cap_bytes_list(self) -> list[int]:
        return [self.first_bytes, self.rest_bytes]


def _align(nbytes: float) -> int:
    return max(_ALIGN, int(-(-nbytes // _ALIGN)) * _ALIGN)


def needs_single_bucket(comm_hook: str | None, backend: str) -> bool:
    """PowerSGD's hook crashes on gloo with more than one bucket (torch 2.13): all gradients in one."""
    return comm_hook == "powersgd" and backend == "gloo"


def single_bucket_plan(gradient_bytes: int, why: str) -> BucketPlan:
    """One bucket that holds every gradient (no overlap of communication with backward)."""
    cap = _align(gradient_bytes + 1)
    return BucketPlan(
        cap,
        cap,
        f"{why}: one bucket of {cap / MiB:.3f} MiB holds all {gradient_bytes / MiB:.3f} MiB of gradients"
        " (no overlap)",
    )


def choose_bucket_sizes(
    measurement: AllReduceMeasurement,
    grad_bytes: Sequence[int],
    *,
    latency_share: float = 0.1,
    min_bytes: int = 256 * 1024,
    max_bytes: int = 256 * MiB,
) -> BucketPlan:
    """Choose DDP bucket caps from a measurement and the gradient sizes (in the order they become ready).

    Rules (all sizes rounded up to 4 KiB):

    * every bucket after the first is the smallest size whose fixed latency is at most
      ``latency_share`` of its all-reduce time, ``latency * bandwidth * (1 - s) / s``, kept within
      ``[min_bytes, max_bytes]`` and at most half the gradients, so that at least two buckets exist and
      the first one's communication overlaps the rest of backward;
    * the first bucket is the size at which latency and transfer time are equal (``latency *
      bandwidth``): small, so communication starts early, but not dominated by latency; it is never
      larger than the other buckets, and never below ``min_bytes``.

    Args:
        measurement: all-reduce latency and bandwidth (from :func:`measure_allreduce`).
        grad_bytes: bytes of each gradient, in the order backward produces them.
        latency_share: the largest acceptable share of per-call latency in a bucket's all-reduce time.
    """
    if not 0.0 < latency_share < 1.0:
        raise ValueError(f"latency_share={latency_share} must lie strictly between 0 and 1, e.g. 0.1")
    if min_bytes <= 0 or max_bytes < min_bytes:
        raise ValueError(f"need 0 < min_bytes <= max_bytes, got min_bytes={min_bytes}, max_bytes={max_bytes}")
    alpha, beta = measurement.latency_s, measurement.bandwidth_bytes_per_s
    if alpha < 0 or beta <= 0:
        raise ValueError(f"invalid measurement: latency_s={alpha}, bandwidth_bytes_per_s={beta}")
    total = int(sum(grad_bytes))
    latency_bound = alpha * beta * (1.0 - latency_share) / latency_share
    if latency_bound < min_bytes:
        rest, limited_by = float(min_bytes), "min_bytes"
    elif latency_bound > max_bytes:
        rest, limited_by = float(max_bytes), "max_bytes"
    else:
        rest, limited_by = latency_bound, "latency"
    if rest > max(total / 2, min_bytes):
        if total / 2 >= min_bytes:
            rest, limited_by = total / 2, "two-bucket overlap"
        else:
            rest, limited_by = float(min_bytes), "min_bytes: the model is smaller than two minimum buckets"
    rest_b = _align(rest)
    first_b = _align(min(max(alpha * beta, min_bytes), rest_b))
    reason = (
        f"all-reduce latency {alpha * 1e6:.1f} us, bandwidth {beta / 1e9:.3f} GB/s over {measurement.world_size}"
        f" ranks ({measurement.backend}); gradients {total / MiB:.2f} MiB; buckets {rest_b / MiB:.3f} MiB"
        f" (bound by {limited_by}; latency <= {latency_share:.0%} of each call), first bucket"
        f" {first_b / MiB:.3f} MiB (latency = transfer time)"
    )
    return BucketPlan(first_bytes=first_b, rest_bytes=rest_b, reason=reason)


def _time_allreduce(tensor: torch.Tensor, repeats: int, group) -> float:
    times = []
    for _ in range(repeats):
        if tensor.is_cuda:
            torch.cuda.synchronize(tensor.device)
        dist.barrier(group=group)
        start = time.perf_counter()
        dist.all_reduce(tensor, group=group)
        if tensor.is_cuda:
            torch.cuda.synchronize(tensor.device)
        times.append(time.perf_counter() - start)
    # noise (other processes, page faults) only ever adds time: the fastest repeat is the best estimate
    return min(times)


def measure_allreduce(
    device: torch.device | str = "cpu",
    *,
    small_bytes: int = 4 * 1024,
    large_bytes: int = 4 * MiB,
    repeats: int = 5,
    group=None,
) -> AllReduceMeasurement:
    """Measure all-reduce latency and bandwidth on ``group`` (all ranks must call this together).

    Times a small and a large fp32 all-reduce (fastest of ``repeats`` after a warm-up) and fits
    ``t(n) = latency + n / bandwidth`` through the two points. Every rank returns its own timings;
    callers that need one decision broadcast rank 0's (see :func:`broadcast_measurement`).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("measure_allreduce needs an initialised process group (torch.distributed)")
    if not 0 < small_bytes < large_bytes:
        raise ValueError(f"need 0 < small_bytes < large_bytes, got {small_bytes} and {large_bytes}")
    device = torch.device(device)
    small = torch.zeros(small_bytes // 4, device=device)
    large = torch.zeros(large_bytes // 4, device=device)
    _time_allreduce(small, 2, group)  # warm-up: connection set-up and allocator
    _time_allreduce(large, 1, group)
    t_small = _time_allreduce(small, repeats, group)
    t_large = _time_allreduce(large, repeats, group)
    if t_large > t_small:
        slope = (t_large - t_small) / (large_bytes - small_bytes)
        latency = max(t_small - small_bytes * slope, 0.0)
    else:  # the large call was not measurably slower: bound the bandwidth by the large call alone
        slope = t_large / large_bytes
        latency = t_small
    return AllReduceMeasurement(
        latency_s=latency,
        bandwidth_bytes_per_s=1.0 / slope,
        world_size=dist.get_world_size(group),
        backend=str(dist.get_backend(group)),
        small_bytes=small_bytes,
        large_bytes=large_bytes,
        small_s=t_small,
        large_s=t_large,
    )


def broadcast_measurement(
    measurement: AllReduceMeasurement, src: int = 0, group=None
) -> AllReduceMeasurement:
    """Every rank gets rank ``src``'s measurement: ranks with different bucket sizes would crash DDP."""
    payload = [measurement.to_dict()]
    dist.broadcast_object_list(payload, src=src, group=group)
    return AllReduceMeasurement(**payload[0])


def gradient_bytes_in_ready_order(module: torch.nn.Module) -> list[int]:
    """Bytes of each trainable parameter's gradient, last registered first (DDP's bucket order)."""
    return [p.numel() * p.element_size() for p in reversed(list(module.parameters())) if p.requires_grad]
