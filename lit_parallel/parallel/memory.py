"""Per-rank memory and communication volume: ZeRO formulas and exact measurements.

Formulas (ZeRO, Rajbhandari et al. 2020) for ``P`` parameters on ``N`` data-parallel ranks with AdamW in
fp32: parameters 4P, gradients 4P, optimizer state 8P = 16P bytes per rank for DDP and 16P/N for
ZeRO-3 / FSDP. Communication per optimizer step, counted as bytes each rank sends with ring collectives
(all-gather and reduce-scatter of S bytes: (N-1)/N * S; all-reduce: 2(N-1)/N * S): DDP 2 units,
ZeRO-2 (FSDP with ``reshard_after_forward=False``) 2 units, ZeRO-3 (``True``) 3 units, where a unit is
(N-1)/N * P * bytes per gradient element.

Expert parallelism (``fsdp_blocks`` with ``expert_parallel_size=e``; derivation in
:func:`estimate_comm_bytes` and :func:`estimate_all_to_all_bytes`): the ``X`` expert parameters of ``P`` are
split over ``e`` ranks and each rank's ``X / e`` FSDP-sharded over the ``N / e`` ranks that hold the same
experts, the other ``P - X`` over all ``N``. Per rank that is ``(P - X) / N + (X / e) / (N / e) = P / N``:
the model state is ZeRO-3's, unchanged. What shrinks is what a rank gathers (a block's experts: ``X_k / e``
instead of ``X_k``) and so the experts' all-gathers and reduce-scatters; what is added is the tokens'
all-to-all.

Measurements: :func:`training_state_bytes` sums what this rank really holds (local shards of DTensors);
collectives are counted by :mod:`lit_parallel.measure.collectives`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lit_parallel.formatting import divisors, format_bytes, format_choices
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
    expert_params: int = 0
    expert_parallel: int = 1

    @property
    def total_bytes(self) -> float:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    def describe(self) -> str:
        experts = (
            f"; its {self.expert_params:,} expert params split over {self.expert_parallel} ranks, each part"
            f" sharded over {self.shard_size // self.expert_parallel}"
            if self.expert_parallel > 1
            else ""
        )
        return (
            f"{format_bytes(self.total_bytes)} per rank ({self.strategy}, {self.num_params:,} params sharded over"
            f" {self.shard_size} of {self.world_size} ranks{experts}): params {format_bytes(self.param_bytes)},"
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
    expert_params: int = 0,
    expert_parallel: int = 1,
) -> MemoryEstimate:
    """ZeRO estimate of per-rank bytes for parameters, gradients and optimizer state.

    With expert parallelism (``zero3``/``fsdp``, ``expert_parallel = e > 1``) the ``X = expert_params``
    are split over ``e`` ranks and each part sharded over the ``N / e`` ranks holding it, the rest over all
    ``N``: per rank ``(P - X) / N + (X / e) / (N / e)`` elements, which is ``P / N``. Expert parallelism
    leaves the model state per rank as it is; it divides what a rank *gathers* (see the module docstring).

    Args:
        num_params: trainable parameters of the model.
        strategy: ``"ddp"`` (nothing sharded), ``"zero1"`` (optimizer state), ``"zero2"`` (+ gradients),
            ``"zero3"`` / ``"fsdp"`` (+ parameters), ``"hsdp"`` (like zero3 over ``shard_size`` ranks).
        shard_size: ranks the state is sharded over; defaults to ``world_size`` (``hsdp``: required).
        param_dtype: dtype (or bytes per element) of the stored parameters and gradients; with FSDP mixed
            precision this is the sharded (fp32) dtype, not the compute dtype.
        optimizer: ``"adamw"``/``"adam"`` (2 states), ``"sgd_momentum"`` (1), ``"sgd"``/``"none"`` (0).
        optimizer_state_dtype: dtype of optimizer states; defaults to ``param_dtype``.
        expert_params: elements of every expert weight among ``num_params`` (with ``expert_parallel``).
        expert_parallel: ranks each MoE layer's experts are split over (``zero3``/``fsdp`` only; divides
            ``world_size``).
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
    level = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3, "hsdp": 3}[strategy]
    if expert_parallel != 1 and level < 3:
        raise ValueError(
            f"expert_parallel={expert_parallel} with strategy={strategy!r}: expert parallelism is estimated for"
            " FSDP ('zero3' / 'fsdp'), where the experts' shards are sharded further"
        )
    experts = _checked_experts(num_params, expert_params, expert_parallel, strategy, shard, world_size)

    def sharded(element_bytes: int) -> float:  # per rank: (P - X) / N + (X / e) / (N / e) elements
        out = element_bytes * (num_params - experts) / shard
        return out + (
            element_bytes * experts / expert_parallel / (shard // expert_parallel) if experts else 0
        )

    b = _dtype_bytes(param_dtype)
    opt = _OPTIMIZER_STATES[optimizer] * _dtype_bytes(optimizer_state_dtype or param_dtype)
    return MemoryEstimate(
        num_params=num_params,
        strategy=strategy,
        world_size=world_size,
        shard_size=shard if level else 1,
        param_bytes=sharded(b) if level >= 3 else b * num_params,
        grad_bytes=sharded(b) if level >= 2 else b * num_params,
        optimizer_bytes=sharded(opt) if level >= 1 else opt * num_params,
        expert_params=experts,
        expert_parallel=expert_parallel,
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
    expert_params: int = 0,
    expert_parallel: int = 1,
) -> float:
    """Bytes each rank sends per optimizer step (ring collectives, no gradient accumulation).

    ``ddp``: one all-reduce of the gradients. ``fsdp``: an all-gather of the parameters in forward, another
    in backward when ``reshard_after_forward`` (ZeRO-3; not with ZeRO-2) except of the ``root_params`` of
    the root group (the parameters outside blocks: they stay gathered from forward into backward), and a
    reduce-scatter of the gradients. ``hsdp``: the same over ``shard_size`` ranks plus an all-reduce of the
    gradient shards over the replicas. Padding of dimension 0 to a multiple of the shard size is not
    included.

    Expert parallelism (``fsdp``/``zero3``/``zero2`` with ``expert_parallel = e > 1``): of the ``N`` ranks,
    each group of ``e`` splits the ``expert_params = X`` experts, and each expert is an FSDP group of its own
    over the ``N / e`` ranks that hold it (gathered in forward and, with ZeRO-3, again in backward: it is
    never part of the root group). With ``u = (N - 1) / N``, ``v = (N / e - 1) / (N / e)``, ``p`` and ``g``
    the bytes of a gathered parameter and of a gradient element, ZeRO-3 sends::

        u * (p * (P - X) + p * (P - X - R) + g * (P - X))  +  v * (2 * p + g) * X / e

    (ZeRO-2: ``u * (p + g) * (P - X) + v * (p + g) * X / e``): the experts' share shrinks by more than ``e``.
    The tokens' all-to-all comes on top: :func:`estimate_all_to_all_bytes`.

    Args:
        root_params: parameters outside transformer blocks that are not experts (the root FSDP group).
        expert_params: elements of every expert weight (``expert_parameter_count``); counted only with
            ``expert_parallel > 1`` (without it experts are ordinary parameters of their blocks).
        expert_parallel: ranks each MoE layer's experts are split over; divides ``world_size``.
    """
    g = _dtype_bytes(grad_dtype)
    param_bytes = _dtype_bytes(param_dtype or grad_dtype)
    n = world_size
    if strategy == "ddp":
        if expert_parallel != 1:
            raise ValueError(
                f"expert_parallel={expert_parallel} with strategy='ddp': DDP replicates every expert; expert"
                " parallelism is estimated for FSDP: strategy='fsdp'"
            )
        return 2 * (n - 1) / n * g * num_params
    if strategy not in ("fsdp", "zero3", "zero2", "hsdp"):
        raise ValueError(f"strategy={strategy!r} is not one of 'ddp', 'fsdp', 'zero2', 'zero3', 'hsdp'")
    s = shard_size or n
    experts = _checked_experts(num_params, expert_params, expert_parallel, strategy, s, n)
    dense = num_params - experts
    if not 0 <= root_params <= dense:
        limit = "num_params - expert_params" if experts else "num_params"
        raise ValueError(f"root_params={root_params} must be between 0 and {limit}={dense}")
    again = reshard_after_forward and strategy != "zero2"  # ZeRO-3 gathers again in backward
    gathered = param_bytes * dense + (param_bytes * (dense - root_params) if again else 0)
    sent = (s - 1) / s * (gathered + g * dense)
    if experts:
        e_shard = s // expert_parallel
        per_rank = experts / expert_parallel
        sent += (e_shard - 1) / e_shard * ((2 if again else 1) * param_bytes + g) * per_rank
    replicas = n // s
    if replicas > 1:
        sent += 2 * (replicas - 1) / replicas * g * num_params / s
    return sent


def _checked_experts(
    num_params: int, expert_params: int, expert_parallel: int, strategy: str, shard: int, world: int
) -> int:
    """The expert parameters :func:`estimate_comm_bytes` counts apart (0 without expert parallelism)."""
    if isinstance(expert_parallel, bool) or not isinstance(expert_parallel, int) or expert_parallel < 1:
        raise ValueError(
            f"expert_parallel={expert_parallel!r} must be a positive integer (1: no expert parallelism)"
        )
    if not 0 <= expert_params <= num_params:
        raise ValueError(f"expert_params={expert_params} must be between 0 and num_params={num_params}")
    if expert_parallel == 1:
        return 0
    if strategy == "hsdp" or shard != world:
        raise ValueError(
            f"expert_parallel={expert_parallel} with strategy={strategy!r} over shards of {shard} of {world} ranks:"
            " expert parallelism borrows the ranks of one FSDP group and does not combine with replication;"
            " use strategy='fsdp' (one shard group of every rank)"
        )
    if world % expert_parallel:
        raise ValueError(
            f"expert_parallel={expert_parallel} does not divide world_size={world}: the expert-parallel ranks are"
            f" borrowed from the data-parallel ranks; choose {format_choices(divisors(world))}"
        )
    return expert_params


def estimate_all_to_all_bytes(
    tokens: int,
    *,
    hidden: int,
    top_k: int,
    moe_layers: int,
    num_experts: int,
    expert_parallel: int,
    element_bytes: torch.dtype | int = torch.float32,
    recompute: bool = False,
) -> float:
    """Bytes each rank sends per optimizer step in expert parallelism's all-to-alls, routing balanced.

    Derivation: a rank routes its ``tokens`` rows (``T``) to ``top_k = k`` experts each, so every MoE layer's
    forward sends ``T k`` rows of ``hidden = h`` elements in its dispatch all-to-all and receives as many back
    in its combine (the same split sizes reversed: a rank receives what it sent); backward runs both again
    with the gradients, same sizes. With the experts equally loaded, ``1 / e`` of the rows stay on the rank
    (its own experts) and ``(e - 1) / e`` leave it. Before the dispatch the ranks exchange the number of
    rows per expert (``num_experts`` int64 counts each, forward only). Per step, over ``L = moe_layers``::

        L * (4 * T * k * h * element_bytes + 8 * num_experts) * (e - 1) / e

    With activation checkpointing (``recompute``) the forward, and its two exchanges and count exchange,
    runs again in backward: ``6`` and ``16`` instead of ``4`` and ``8``. Exactly what the routing implies
    is ``4 T k h`` elements of all-to-all input per layer; how much of it stays local depends on where
    the tokens go (all of it leaves when no rank keeps a token).
    """
    for name, value in (
        ("tokens", tokens),
        ("hidden", hidden),
        ("top_k", top_k),
        ("moe_layers", moe_layers),
        ("num_experts", num_experts),
        ("expert_parallel", expert_parallel),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}={value!r} must be a non-negative integer")
    if expert_parallel < 1 or (num_experts and num_experts % expert_parallel):
        raise ValueError(
            f"expert_parallel={expert_parallel} must be at least 1 and divide num_experts={num_experts}: every"
            " expert-parallel rank holds the same number of experts"
        )
    passes = 3 if recompute else 2  # forward, backward, and the recomputed forward
    rows = 2 * passes * tokens * top_k  # dispatch and combine in each pass
    counts = (passes - 1) * 8 * num_experts  # int64 counts, exchanged by every forward
    leaving = (expert_parallel - 1) / expert_parallel
    return moe_layers * (rows * hidden * _dtype_bytes(element_bytes) + counts) * leaving
