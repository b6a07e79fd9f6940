"""Per-rank memory of every strategy the advisor compares: one row per strategy, ZeRO's accounting.

Each strategy divides what it shards by the number of ranks it shards over
(:func:`~lit_parallel.parallel.estimate_memory` does the dividing):

============  ================================  ================================================
row           shards                            over
============  ================================  ================================================
DDP           nothing                           -
ZeRO-1        optimizer state                   all ranks
ZeRO-2        optimizer state + gradients       all ranks; parameters too, but gathered in full from
              (+ parameters, gathered in full     forward to backward: what ``fsdp_blocks`` with
              from forward to backward)           ``reshard_after_forward=False`` holds (not DeepSpeed's
                                                  ZeRO-2, which keeps full parameters only)
FSDP/ZeRO-3   + parameters                      all ranks
FSDP+EP       everything; experts split first   experts: ``e`` expert-parallel ranks, each part sharded
                                                  over the ``N / e`` ranks holding it; the rest: all ranks
                                                  (only for a model with experts, at the advisor's ``e``)
HSDP          everything                        the devices of one node (replicated across nodes)
TP+DP         everything                        tensor parallel inside a node x FSDP across nodes
============  ================================  ================================================

The FSDP+EP row holds what the FSDP/ZeRO-3 row holds, ``(P - X) / N + (X / e) / (N / e) = P / N`` elements
per rank (:func:`~lit_parallel.parallel.estimate_memory`); expert parallelism divides what a block
gathers, which the peak prediction counts (:mod:`~lit_parallel.planner.memory.peak`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from lit_parallel.parallel.memory import estimate_memory
from lit_parallel.planner.memory.host_copy import host_copy_from_counts
from lit_parallel.planner.precision import PrecisionBytes, precision_bytes

if TYPE_CHECKING:
    from lit_parallel.planner.activations import ActivationEstimate


ZERO2 = "fsdp_blocks(reshard_after_forward=False)"  # what runs the ZeRO-2 row


@dataclass(frozen=True)
class StateRow:
    """Per-rank bytes of one strategy's model state (ZeRO's accounting).

    Attributes:
        name: the row's label (``"DDP"``, ``"ZeRO-1"``, ...).
        strategy: the lit_parallel strategy that runs it: its registry name, with the argument that
            selects it where one is needed (ZeRO-2); ``None`` for ZeRO-1, which no strategy here implements.
        sharding: what is divided and over how many ranks, in words.
        host_copy_bytes: the host memory ``async_checkpoint=True`` keeps on rank 0 (one copy of what the
            rank saves: :func:`~lit_parallel.planner.memory.host_copy.host_copy_from_counts`); ``None`` for
            ZeRO-1, which no strategy here runs.
    """

    name: str
    strategy: str | None
    sharding: str
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    host_copy_bytes: float | None = field(default=None, kw_only=True)

    @property
    def state_bytes(self) -> float:
        """Parameters + gradients + optimizer state."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


@dataclass(frozen=True)
class MemoryRow(StateRow):
    """Per-rank bytes of one strategy: its :class:`StateRow` with the activations, and whether it fits.

    Attributes:
        name: the row's label (``"DDP"``, ``"ZeRO-1"``, ...).
        strategy: the lit_parallel strategy that runs it: its registry name, with the argument that
            selects it where one is needed (ZeRO-2); ``None`` for ZeRO-1, which no strategy here implements.
        sharding: what is divided and over how many ranks, in words.
        activation_bytes: per-rank activations for the given micro-batch; ``None`` without a model.
        fits: model state (+ activations when known) <= the usable device memory (the advisor's headroom
            taken off: :func:`lit_parallel.planner.rules.usable_memory`).
        host_copy_bytes: the host memory ``async_checkpoint=True`` keeps on rank 0 (:class:`StateRow`); host
            memory, not counted in ``fits``.
    """

    activation_bytes: float | None
    fits: bool

    @property
    def total_bytes(self) -> float:
        """Model state plus activations (when known)."""
        return self.state_bytes + (self.activation_bytes or 0.0)


def memory_rows(
    params: int,
    *,
    devices: int,
    nodes: int = 1,
    precision: str = "bf16-mixed",
    trainable_params: int | None = None,
    tp_split_params: int | None = None,
    expert_params: int = 0,
    expert_parallel: int = 1,
    param_tensors: int = 0,
    buffer_bytes: int = 0,
    device_type: str = "cuda",
) -> list[StateRow]:
    """Every row's per-rank model state, and its host copy under ``async_checkpoint=True``.

    Args:
        tp_split_params: parameters tensor parallelism splits (those inside transformer blocks); the
            rest is sharded over the data-parallel ranks only. ``None``: every parameter is split.
        expert_params, expert_parallel: the model's expert parameters and the expert-parallel size of the
            FSDP+EP row (``fsdp_blocks`` with ``expert_parallel_size``); no such row with
            ``expert_parallel=1``.
        param_tensors, buffer_bytes, device_type: the trainable parameter tensors (one AdamW step counter
            each), the bytes of persistent buffers and the devices' type (a CUDA generator's state in the
            RNG states), for the host copy; 0 where unknown.
    """
    b = precision_bytes(precision)
    world = devices * nodes
    trainable = params if trainable_params is None else trainable_params

    split = functools.partial(_split, params, trainable, b)
    tp, dp = devices, nodes
    # tensor parallelism leaves experts whole (expert parallelism splits them): they are sharded like the rest
    inside = (params if tp_split_params is None else tp_split_params) - expert_params
    frac = inside / params if params else 1.0
    # TP+DP: block parameters are split over tp and sharded over dp (1/world); the rest only over dp.
    zero3 = split("zero3", world, world)
    rest = split("zero3", dp, dp)
    tp_row = tuple(frac * x + (1 - frac) * y for x, y in zip(zero3, rest))
    # ZeRO-2 as lit_parallel runs it (FSDP2 without resharding after forward): ZeRO-3's shards, and every
    # parameter gathered (full, in the stored dtype) from forward until its gradient is reduce-scattered
    zero2 = (zero3[0] + params * b.params, zero3[1], zero3[2])
    host = functools.partial(
        host_copy_from_counts,
        params,
        precision=precision,
        world=world,
        trainable_params=trainable,
        param_tensors=param_tensors,
        buffer_bytes=buffer_bytes,
        device_type=device_type,
    )
    tp_host = frac * host(strategy="zero3") + (1 - frac) * host(strategy="hsdp", shard=dp)
    ep_host = host(expert_params=expert_params, expert_parallel=expert_parallel)
    rows = [
        StateRow("DDP", "ddp_tuned", "nothing sharded", *split("ddp", None, world)),
        StateRow("ZeRO-1", None, f"optimizer state / {world}", *split("zero1", world, world)),
        StateRow(
            "ZeRO-2",
            ZERO2,
            f"everything / {world}; parameters also gathered in full from forward to backward",
            *zero2,
        ),
        StateRow("FSDP/ZeRO-3", "fsdp_blocks", f"everything / {world}", *zero3),
        *(
            [_expert_parallel_row(params, trainable, b, world, expert_params, expert_parallel)]
            if expert_parallel > 1
            else []
        ),
        StateRow(
            "HSDP",
            "hsdp",
            f"everything / {devices} (one node), x{nodes} replicas",
            *split("hsdp", devices, world),
        ),
        StateRow(
            "TP+DP",
            "tp_dp",
            f"tensor parallel {tp} x FSDP over {dp}"
            + (f" (blocks / {world}, the rest / {dp})" if tp_split_params is not None and frac < 1 else ""),
            *tp_row,
        ),
    ]
    hosts = {"DDP": host(strategy="ddp"), "ZeRO-2": host(), "FSDP/ZeRO-3": host(), "FSDP+EP": ep_host}
    hosts.update({"HSDP": host(strategy="hsdp", shard=devices), "TP+DP": tp_host})
    return [replace(r, host_copy_bytes=hosts.get(r.name)) for r in rows]


def expert_parallel_label(expert_parallel: int) -> str:
    """The strategy that runs the FSDP+EP row: ``fsdp_blocks(expert_parallel_size=e)``."""
    return f"fsdp_blocks(expert_parallel_size={expert_parallel})"


def _expert_parallel_row(
    params: int, trainable: int, b: PrecisionBytes, world: int, experts: int, ep: int
) -> StateRow:
    """The FSDP+EP row: experts split over ``ep`` ranks and sharded over ``world / ep``, the rest over
    ``world`` (frozen parameters are counted as experts first: the sizes per rank are the same)."""
    kw = {"world_size": world, "shard_size": world, "optimizer": "adam", "expert_parallel": ep}
    p = estimate_memory(params, strategy="zero3", param_dtype=b.params, expert_params=experts, **kw)
    t = estimate_memory(
        trainable,
        strategy="zero3",
        param_dtype=b.grads,
        optimizer_state_dtype=b.optimizer // 2,
        expert_params=min(experts, trainable),
        **kw,
    )
    state = (p.param_bytes, t.grad_bytes, t.optimizer_bytes)
    sharding = f"experts / {ep} (expert parallel) / {world // ep} (FSDP); the rest / {world}"
    return StateRow("FSDP+EP", expert_parallel_label(ep), sharding, *state)


def _split(
    params: int, trainable: int, b: PrecisionBytes, strategy: str, shard: int | None, world_size: int
) -> tuple[float, float, float]:
    """``(param_bytes, grad_bytes, optimizer_bytes)`` per rank of ``strategy`` (:func:`memory_rows`)."""
    # estimate_memory divides what each ZeRO stage shards. Adam's optimizer bytes per parameter
    # (12 or 8 or 4) are given as its two states of half that size each.
    kw = {"world_size": world_size, "shard_size": shard, "optimizer": "adam"}
    p = estimate_memory(params, strategy=strategy, param_dtype=b.params, **kw)
    t = estimate_memory(
        trainable, strategy=strategy, param_dtype=b.grads, optimizer_state_dtype=b.optimizer // 2, **kw
    )
    return p.param_bytes, t.grad_bytes, t.optimizer_bytes


def memory_table(
    params: int,
    *,
    devices: int,
    nodes: int,
    precision: str,
    memory_bytes: float,
    trainable_params: int | None = None,
    tp_split_params: int | None = None,
    activations: ActivationEstimate | None = None,
    expert_params: int = 0,
    expert_parallel: int = 1,
    param_tensors: int = 0,
    buffer_bytes: int = 0,
    device_type: str = "cuda",
) -> list[MemoryRow]:
    """:func:`memory_rows` with each row's activations (when estimated) and whether it fits ``memory_bytes``
    (the usable bytes of one device: the advisor passes them with its headroom taken off)."""
    rows = []
    for r in memory_rows(
        params,
        devices=devices,
        nodes=nodes,
        precision=precision,
        trainable_params=trainable_params,
        tp_split_params=tp_split_params,
        expert_params=expert_params,
        expert_parallel=expert_parallel,
        param_tensors=param_tensors,
        buffer_bytes=buffer_bytes,
        device_type=device_type,
    ):
        a = None
        if activations is not None:
            # tensor parallelism splits what happens inside blocks; data parallelism splits nothing
            outside = activations.total_bytes - activations.block_bytes
            a = activations.block_bytes / devices + outside if r.name == "TP+DP" else activations.total_bytes
        fits = r.state_bytes + (a or 0.0) <= memory_bytes
        rows.append(
            MemoryRow(
                r.name,
                r.strategy,
                r.sharding,
                r.param_bytes,
                r.grad_bytes,
                r.optimizer_bytes,
                a,
                fits,
                host_copy_bytes=r.host_copy_bytes,
            )
        )
    return rows
