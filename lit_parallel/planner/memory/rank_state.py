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
- ``pp_dp``: the parameters of the first stage's pieces (the pipeline plan), split as ``tp_dp``'s when
  ``tensor_parallel_size > 1``, padded over the stage's data-parallel shard ranks.

Bytes follow ZeRO's accounting of the precision (:mod:`lit_parallel.planner.precision`): per element
``params`` + ``grads`` + ``optimizer`` bytes; frozen parameters count their parameter bytes only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from lit_parallel.parallel.tensor_parallel import TPPlan
from lit_parallel.planner.memory.peak import ModelShape, shard_elements
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


def _padded_share(params: list[nn.Parameter], shard: int) -> int:
    """Rank 0's elements of ``params``, each sharded along dim 0 over ``shard`` ranks (``ceil(rows / shard)``
    rows; the padding of the last ranks is stored by every rank)."""
    return sum(-(-rows // shard) * per_row for rows, per_row in map(_rows, params))


def _unique(module: nn.Module) -> list[nn.Parameter]:
    return list(dict.fromkeys(module.parameters()))


def _state(elements: float, trainable: float, precision: str) -> StateFormula:
    b = precision_bytes(precision)
    return StateFormula(
        elements, trainable, elements * b.params, trainable * b.grads, trainable * b.optimizer
    )


def fsdp_state(
    module: nn.Module, blocks: list[nn.Module], *, shard: int, precision: str, expert_parallel: int = 1
) -> StateFormula:
    """``fsdp_blocks`` / ZeRO-2 over ``shard`` ranks (``hsdp``: the shard group), with
    ``expert_parallel_size`` (module docstring)."""
    params = _unique(module)
    if expert_parallel > 1:
        shape = ModelShape.of(module, blocks)
        elements = sum(shard_elements(d, x, shard, expert_parallel) for d, x in shape.groups())
        frozen = _padded_share([p for p in params if not p.requires_grad], shard)
        return _state(elements, elements - frozen, precision)
    trainable = _padded_share([p for p in params if p.requires_grad], shard)
    return _state(_padded_share(params, shard), trainable, precision)


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
) -> StateFormula:
    """``tp_dp`` (and a ``pp_dp`` stage with ``pieces``, the module paths it keeps): one tensor-parallel rank's
    shapes padded over ``data_parallel_shard`` ranks (module docstring)."""
    local = tp_local_model(module, plan) if plan.tp_size > 1 else module
    params = _unique(local) if pieces is None else _piece_params(local, pieces)
    trainable = _padded_share([p for p in params if p.requires_grad], data_parallel_shard)
    return _state(_padded_share(params, data_parallel_shard), trainable, precision)


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
) -> StateFormula:
    """A ``pp_dp`` rank holding the stage(s) made of ``pieces`` (module paths), split by ``plan`` when tensor
    parallelism is on, padded over the stage's ``data_parallel_shard`` ranks."""
    if plan is not None and plan.tp_size > 1:
        return tensor_parallel_state(
            module, plan, data_parallel_shard=data_parallel_shard, precision=precision, pieces=pieces
        )
    params = _piece_params(module, pieces)
    trainable = _padded_share([p for p in params if p.requires_grad], data_parallel_shard)
    return _state(_padded_share(params, data_parallel_shard), trainable, precision)
