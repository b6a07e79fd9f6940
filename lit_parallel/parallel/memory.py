"""Per-rank memory and communication volume: ZeRO formulas and exact measurements.

Formulas (ZeRO, Rajbhandari et al. 2020) for ``P`` parameters on ``N`` data-parallel ranks with AdamW in
fp32: parameters 4P, gradients 4P, optimizer state 8P = 16P bytes per rank for DDP and 16P/N for
ZeRO-3 / FSDP. Communication per optimizer step, counted as bytes each rank sends with ring collectives
(all-gather and reduce-scatter of S bytes: (N-1)/N * S; all-reduce: 2(N-1)/N * S): DDP 2 units,
ZeRO-2 (FSDP with ``reshard_after_forward=False``) 2 units, ZeRO-3 (``True``) 3 units, where a unit is
(N-1)/N * P * bytes per gradient element.

Measurements: :func:`training_state_bytes` sums what this rank really holds (local shards of DTensors);
collectives are counted by :mod:`lit_parallel.measure.collectives`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lit_parallel.formatting import format_bytes
from lit_parallel.measure.live_memory import local_tensor

_OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1, "none": 0}
_STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp", "hsdp")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank for parameters, gradients and optimizer state (activations not included)."""

    num_params: int
    strategy: str
    world_size: int
    shard_size: int
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    def describe(self) -> str:
        return (
            f"{format_bytes(self.total_bytes)} per rank ({self.strategy}, {self.num_params:,} params sharded over"
            f" {self.shard_size} of {self.world_size} ranks): params {format_bytes(self.param_bytes)},"
            f" grads {format_bytes(self.grad_bytes)}, optimizer state {format_bytes(self.optimizer_bytes)}"
        )


def _dtype_bytes(dtype: torch.dtype | int) -> int:
    return dtype if isinstance(dtype, int) else torch.empty((), dtype=dtype).element_size()


def estimate_memory(
    num_params: int,
    *,
    strategy: str = "fsdp",
    world_size: int = 1,
    shard_size: int | None = None,
    param_dtype: torch.dtype | int = torch.float32,
    optimizer: str = "adamw",
    optimizer_state_dtype: torch.dtype | int | None = None,
) -> MemoryEstimate:
    """ZeRO estimate of per-rank bytes for parameters, gradients and optimizer state.

    Args:
        num_params: trainable parameters of the model.
        strategy: ``"ddp"`` (nothing sharded), ``"zero1"`` (optimizer state), ``"zero2"`` (+ gradients),
            ``"zero3"`` / ``"fsdp"`` (+ parameters), ``"hsdp"`` (like zero3 over ``shard_size`` ranks).
        shard_size: ranks the state is sharded over; defaults to ``world_size`` (``hsdp``: required).
        param_dtype: dtype (or bytes per element) of the stored parameters and gradients; with FSDP mixed
            precision this is the sharded (fp32) dtype, not the compute dtype.
        optimizer: ``"adamw"``/``"adam"`` (2 states), ``"sgd_momentum"`` (1), ``"sgd"``/``"none"`` (0).
        optimizer_state_dtype: dtype of optimizer states; defaults to ``param_dtype``.
    """
    if strategy not in _STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is not one of {', '.join(map(repr, _STRATEGIES))}")
    if optimizer not in _OPTIMIZER_STATES:
        raise ValueError(f"optimizer={optimizer!r} is not one of {', '.join(map(repr, _OPTIMIZER_STATES))}")
    if strategy == "hsdp" and shard_size is None:
        raise ValueError("strategy='hsdp' needs shard_size (ranks per replica)")
    shard = shard_size or world_size
    if world_size % shard != 0:
        raise ValueError(f"shard_size={shard} does not divide world_size={world_size}")
    p = _dtype_bytes(param_dtype) * num_params
    opt = _OPTIMIZER_STATES[optimizer] * _dtype_bytes(optimizer_state_dtype or param_dtype) * num_params
    level = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3, "hsdp": 3}[strategy]
    return MemoryEstimate(
        num_params=num_params,
        strategy=strategy,
        world_size=world_size,
        shard_size=shard if level else 1,
        param_bytes=p / shard if level >= 3 else p,
        grad_bytes=p / shard if level >= 2 else p,
        optimizer_bytes=opt / shard if level >= 1 else opt,
    )


def _nbytes(t: torch.Tensor) -> int:
    t = local_tensor(t)
    return t.numel() * t.element_size()


def training_state_bytes(module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes this rank holds for ``module``'s parameters, their gradients and ``optimizer``'s state.

    Sharded (DTensor) parameters count their local shard only. Returns ``params``, ``grads``,
    ``optimizer`` and ``total``.
    """
    params = list(dict.fromkeys(module.parameters()))
    out = {
        "params": sum(_nbytes(p) for p in params),
        "grads": sum(_nbytes(p.grad) for p in params if p.grad is not None),
        "optimizer": 0,
    }
    if optimizer is not None:
        for state in optimizer.state.values():
            out["optimizer"] += sum(_nbytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def estimate_comm_bytes(
    num_params: int,
    *,
    strategy: str,
    world_size: int,
    shard_size: int | None = None,
    grad_dtype: torch.dtype | int = torch.float32,
    param_dtype: torch.dtype | int | None = None,
    reshard_after_forward: bool = True,
    root_params: int = 0,
) -> float:
    """Bytes each rank sends per optimizer step (ring collectives, no gradient accumulation).

    ``ddp``: one all-reduce of the gradients. ``fsdp``: an all-gather of the parameters in forward, another
    in backward when ``reshard_after_forward`` (ZeRO-3; not with ZeRO-2) except of the ``root_params`` of
    the root group (the parameters outside blocks: they stay gathered from forward into backward), and a
    reduce-scatter of the gradients. ``hsdp``: the same over ``shard_size`` ranks plus an all-reduce of the
    gradient shards over the replicas. Padding of dimension 0 to a multiple of the shard size is not
    included.
    """
    g = _dtype_bytes(grad_dtype) * num_params
    param_bytes = _dtype_bytes(param_dtype or grad_dtype)
    p = param_bytes * num_params
    n = world_size
    if strategy == "ddp":
        return 2 * (n - 1) / n * g
    if strategy not in ("fsdp", "zero3", "zero2", "hsdp"):
        raise ValueError(f"strategy={strategy!r} is not one of 'ddp', 'fsdp', 'zero2', 'zero3', 'hsdp'")
    s = shard_size or n
    if not 0 <= root_params <= num_params:
        raise ValueError(f"root_params={root_params} must be between 0 and num_params={num_params}")
    gathered = p
    if reshard_after_forward and strategy != "zero2":  # gathered again in backward, all but the root
        gathered += param_bytes * (num_params - root_params)
    sent = (s - 1) / s * (gathered + g)
    replicas = n // s
    if replicas > 1:
        sent += 2 * (replicas - 1) / replicas * g / s
    return sent
