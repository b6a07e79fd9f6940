"""The planner's per-rank model state from shapes alone: what a dry run's placements are checked against.

For the rank holding the most (rank 0: a shard of uneven rows is largest there), in elements per parameter:

- ``ddp_tuned``: every element;
- ``fsdp_blocks`` (also ZeRO-2: the same state) over ``N`` ranks: ``ceil(rows / N) x elements per row``, rows
  being dim 0 (FSDP2 pads dim 0 to a multiple of ``N``:
  :func:`~lit_parallel.planner.memory.peak.padded`); with ``expert_parallel_size = e`` the ``E / e`` experts a
  rank keeps are padded over the ``N / e`` ranks holding them
  (:func:`~lit_parallel.planner.memory.peak.shard_elements`);
- ``hsdp``: as ``fsdp_blocks`` over the devices of one node (the shard group);
- ``tp_dp``: one tensor-parallel rank's shapes (:func:`~lit_parallel.planner.memory.tensor_parallel.tp_local_model`:
  a column-wise layer keeps ``out / tp`` rows, a row-wise one ``in / tp`` columns, norms and other layers the
  plan leaves whole are replicated), then padded over the data-parallel shard ranks;
- ``pp_dp``: the parameters of the pieces of one pipeline rank's stages (the pipeline plan), split as
  ``tp_dp``'s when ``tensor_parallel_size > 1``, padded over the stage's data-parallel shard ranks; the
  pipeline rank holding the most is the one counted.

Bytes follow ZeRO's accounting of the precision (:mod:`lit_parallel.planner.precision`): per element
``params`` + ``grads`` + ``optimizer`` bytes; frozen parameters count their parameter bytes only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from lit_parallel.parallel.expert_parallel import (
    find_moe_layers,
    plan_expert_parallel,
    without_expert_modules,
)
from lit_parallel.parallel.tensor_parallel import TPPlan
from lit_parallel.planner.memory.table import MemoryRow
from lit_parallel.planner.memory.tensor_parallel import tp_local_model
from lit_parallel.planner.precision import precision_bytes


@dataclass(frozen=True)
class StateFormula:
    """Per-rank bytes of model state by the planner's accounting, and the elements they come from."""

    elements: float
    trainable_elements: float
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float

    @property
    def state_bytes(self) -> float:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


def _rows(p: nn.Parameter) -> tuple[int, int]:
    return (p.shape[0], math.prod(p.shape[1:])) if p.dim() else (1, 1)


def _padded(p: nn.Parameter, shard: int, rows: int | None = None) -> int:
    """Rank 0's elements of ``p`` (``rows`` of it: all by default) sharded along dim 0 over ``shard`` ranks:
    ``ceil(rows / shard)`` rows (every rank stores the padded shard)."""
    total, per_row = _rows(p)
    return -(-(total if rows is None else rows) // shard) * per_row


def _unique(module: nn.Module) -> list[nn.Parameter]:
    return list(dict.fromkeys(module.parameters()))


def _state(elements: float, trainable: float, precision: str) -> StateFormula:
    b = precision_bytes(precision)
    return StateFormula(
        elements, trainable, elements * b.params, trainable * b.grads, trainable * b.optimizer
    )


def _experts(module: nn.Module, expert_parallel: int) -> dict[int, int | None]:
    """With ``expert_parallel = e > 1``, ``{id: rows rank 0 keeps}`` of every expert parameter: ``E / e`` of a
    stacked weight's ``E`` rows; of a list's experts, every row (``None``) of the first ``E / e``, which rank 0
    keeps, and none (``0``) of the others'."""
    held: dict[int, int | None] = {}
    if expert_parallel == 1:
        return held
    for layer in find_moe_layers(module):
        per_rank = layer.num_experts // expert_parallel
        if layer.kind == "stacked":
            held.update({id(p): per_rank for p in layer.module.parameters(recurse=False)})
            continue
        for i, expert in enumerate(getattr(layer.module, layer.experts_name or "")):
            held.update({id(p): None if i < per_rank else 0 for p in expert.parameters()})
    return held


def _share(params: list[nn.Parameter], module: nn.Module, shard: int, expert_parallel: int) -> StateFormula:
    """Elements rank 0 stores of ``params`` (parameters of ``module``) sharded over ``shard`` ranks, and of them
    the trainable ones, as ``(elements, trainable)`` in a :class:`StateFormula` without bytes. With expert
    parallelism ``e``, experts are split first: rank 0 keeps ``E / e`` of each MoE layer's, sharded over the
    ``shard / e`` ranks holding the same ones."""
    held = _experts(module, expert_parallel)
    inner = shard // expert_parallel
    elements = trainable = 0
    for p in params:
        if id(p) not in held:
            n = _padded(p, shard)
        elif held[id(p)] == 0:
            continue  # another expert-parallel rank's expert
        else:
            n = _padded(p, inner, rows=held[id(p)])
        elements += n
        trainable += n if p.requires_grad else 0
    return StateFormula(elements, trainable, 0.0, 0.0, 0.0)


def _priced(share: StateFormula, precision: str) -> StateFormula:
    return _state(share.elements, share.trainable_elements, precision)


def fsdp_state(
    module: nn.Module, blocks: list[nn.Module], *, shard: int, precision: str, expert_parallel: int = 1
) -> StateFormula:
    """``fsdp_blocks`` / ZeRO-2 over ``shard`` ranks (``hsdp``: the shard group), with
    ``expert_parallel_size`` (module docstring). ``blocks`` do not change the state (each group is padded
    parameter by parameter), only what is gathered together."""
    return _priced(_share(_unique(module), module, shard, expert_parallel), precision)


def ddp_state(module: nn.Module, *, precision: str) -> StateFormula:
    """``ddp_tuned``: the whole model on every rank."""
    params = _unique(module)
    return _state(
        sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad), precision
    )


def tensor_parallel_state(
    module: nn.Module,
    plan: TPPlan,
    *,
    data_parallel_shard: int,
    precision: str,
    pieces: list[str] | None = None,
    expert_parallel: int = 1,
) -> StateFormula:
    """``tp_dp`` (and a ``pp_dp`` stage with ``pieces``, the module paths it keeps): one tensor-parallel rank's
    shapes padded over ``data_parallel_shard`` ranks, experts split first (module docstring)."""
    if (
        expert_parallel > 1
    ):  # expert parallelism splits the experts, tensor parallelism leaves them (parallelize)
        plan = without_expert_modules(
            plan, plan_expert_parallel(module, expert_parallel, require_layers=False)
        )
    local = tp_local_model(module, plan) if plan.tp_size > 1 else module
    params = _unique(local) if pieces is None else _piece_params(local, pieces)
    return _priced(_share(params, local, data_parallel_shard, expert_parallel), precision)


def _piece_params(module: nn.Module, pieces: list[str]) -> list[nn.Parameter]:
    out: dict[int, nn.Parameter] = {}
    for path in pieces:
        for p in module.get_submodule(path).parameters():
            out.setdefault(id(p), p)
    return list(out.values())


def pipeline_state(
    module: nn.Module,
    pieces: list[str],
    *,
    data_parallel_shard: int,
    precision: str,
    plan: TPPlan | None = None,
    expert_parallel: int = 1,
) -> StateFormula:
    """A ``pp_dp`` rank holding the stage(s) made of ``pieces`` (module paths), split by ``plan`` when tensor
    parallelism is on, experts split first, padded over the stage's ``data_parallel_shard`` ranks."""
    if plan is not None and plan.tp_size > 1:
        return tensor_parallel_state(
            module,
            plan,
            data_parallel_shard=data_parallel_shard,
            precision=precision,
            pieces=pieces,
            expert_parallel=expert_parallel,
        )
    params = _piece_params(module, pieces)
    return _priced(_share(params, module, data_parallel_shard, expert_parallel), precision)


def predicted_state(
    strategy: str,
    module: nn.Module,
    sizes: dict[str, int],
    *,
    precision: str,
    block_types: Any = "auto",
    pipeline: dict[str, Any] | None = None,
) -> StateFormula:
    """The planner's state of the rank holding the most under ``strategy`` (a registry name) for a layout given
    by its mesh ``sizes`` (``world``, ``data_parallel_shard``, ``tensor_parallel``, ``expert_parallel``):
    the formulas above, with the blocks, the tensor-parallel plan and the pipeline split (``pipeline``: the
    ``pp_dp`` arguments ``pipeline_parallel_size``, ``schedule``, ``microbatches``, ``split``; the pipeline rank
    holding the most is counted) found by the same functions the strategies call."""
    from lit_parallel.parallel.blocks import find_transformer_blocks
    from lit_parallel.parallel.pipeline.plan import plan_pipeline
    from lit_parallel.parallel.tensor_parallel import plan_from_spec

    if strategy == "ddp_tuned":
        return ddp_state(module, precision=precision)
    blocks = find_transformer_blocks(module, block_types)
    shard, tp = sizes["data_parallel_shard"], sizes.get("tensor_parallel", 1)
    ep = sizes.get("expert_parallel", 1)
    if strategy in ("fsdp_blocks", "hsdp"):
        return fsdp_state(
            module, [b for _, b in blocks.blocks], shard=shard, precision=precision, expert_parallel=ep
        )
    plan = plan_from_spec(module, "auto", tp, block_types=blocks) if tp > 1 else None
    if strategy == "tp_dp":
        assert plan is not None, "tp_dp splits over tensor_parallel > 1"
        return tensor_parallel_state(
            module, plan, data_parallel_shard=shard, precision=precision, expert_parallel=ep
        )
    if strategy == "pp_dp":
        args = dict(pipeline or {})
        layout = plan_pipeline(
            module,
            blocks,
            pp_size=args.get("pipeline_parallel_size", 2),
            schedule=args.get("schedule", "1F1B"),
            microbatches=args.get("microbatches", 4),
            split=args.get("split", "auto"),
        )
        per_rank = [
            pipeline_state(
                module,
                [p for s in layout.stages_of(rank) for p in s.pieces],
                data_parallel_shard=shard,
                precision=precision,
                plan=plan,
                expert_parallel=ep,
            )
            for rank in range(layout.pp_size)
        ]
        return max(per_rank, key=lambda f: f.state_bytes)
    raise ValueError(
        f"strategy={strategy!r}: no state formula; one of ddp_tuned, fsdp_blocks, hsdp, tp_dp, pp_dp"
    )


def exact_rows(
    rows: list[MemoryRow],
    module: nn.Module,
    *,
    devices: int,
    nodes: int,
    precision: str,
    memory_bytes: float,
    block_types: Any = "auto",
    expert_parallel: int = 1,
) -> tuple[list[MemoryRow], list[str]]:
    """``advise``'s memory table for a model whose shapes are known: each strategy's row with the state of the
    rank holding the most, by the formulas above (padded shards, the tensor-parallel plan's replicated
    parameters), instead of ZeRO's even division; ``fits`` judged again. Returns the rows and notes (a row
    kept as divided, and why)."""
    from lit_parallel.parallel.blocks import NoBlocksFoundError
    from lit_parallel.parallel.tensor_parallel import TPPlanError

    world = devices * nodes
    b = precision_bytes(precision)
    gathered = sum(p.numel() for p in _unique(module)) * b.params  # ZeRO-2 keeps every parameter gathered
    notes: list[str] = []
    layouts = {
        "DDP": ("ddp_tuned", {}),
        "ZeRO-2": ("fsdp_blocks", {"data_parallel_shard": world}),
        "FSDP/ZeRO-3": ("fsdp_blocks", {"data_parallel_shard": world}),
        "FSDP+EP": ("fsdp_blocks", {"data_parallel_shard": world, "expert_parallel": expert_parallel}),
        "HSDP": ("hsdp", {"data_parallel_shard": devices}),
        "TP+DP": ("tp_dp", {"data_parallel_shard": nodes, "tensor_parallel": devices}),
    }
    computed: dict[tuple, StateFormula | Exception] = {}  # ZeRO-2 and ZeRO-3 share one layout
    out = []
    for row in rows:
        if row.name not in layouts or (row.name == "TP+DP" and devices == 1):
            out.append(row)
            continue
        strategy, sizes = layouts[row.name]
        key = (strategy, tuple(sorted(sizes.items())))
        if key not in computed:
            try:
                computed[key] = predicted_state(
                    strategy, module, sizes, precision=precision, block_types=block_types
                )
            except (TPPlanError, NoBlocksFoundError, ValueError) as err:
                computed[key] = err
        f = computed[key]
        if isinstance(f, TPPlanError):
            # tp_dp's setup would fail the same way: the row cannot be chosen
            notes.append(
                f"{row.name}: tp_dp cannot split this model over {devices} devices: {str(f).splitlines()[-1]}"
            )
            out.append(replace(row, fits=False))
            continue
        if isinstance(f, Exception):
            notes.append(f"{row.name}: state divided evenly ({str(f).splitlines()[0]})")
            out.append(row)
            continue
        params = f.param_bytes + (gathered if row.name == "ZeRO-2" else 0.0)
        state = params + f.grad_bytes + f.optimizer_bytes
        fits = state + (row.activation_bytes or 0.0) <= memory_bytes
        out.append(
            replace(
                row, param_bytes=params, grad_bytes=f.grad_bytes, optimizer_bytes=f.optimizer_bytes, fits=fits
            )
        )
    return out, notes
