"""The per-rank state a setup left, read from the parameters themselves (no formula).

For every parameter of the module after a strategy's setup (on a simulated or a real process group): its
DTensor placements over the named mesh dimensions, its local shape on this rank, and the elements this rank
stores for it. ``fully_shard`` stores a shard padded along dim 0 to ``ceil(rows / shard)`` rows on every rank,
while the DTensor's local tensor is the unpadded view (empty on the ranks past the last row): the stored size
is FSDP2's own record of the padded shard (``_compat.fsdp_params``).

Bytes per rank, by category:

- parameters: the stored elements of every parameter, in its dtype;
- gradients: the same for every trainable parameter (FSDP2's sharded gradient is a view of the padded
  reduce-scatter output; a DTensor or plain gradient has the parameter's local shape);
- optimizer: AdamW's two states (``exp_avg``, ``exp_avg_sq``), each of the trainable parameter's local
  (unpadded) shape in its dtype; its one-element ``step`` counters are not counted.

Under mixed precision the parameters and gradients are stored in fp32 (the compute copies are made per
forward), so the categories differ from ZeRO's 2 + 2 + 12 accounting while the sum per parameter, 16 bytes,
is the same (:mod:`lit_parallel.planner.precision`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lit_parallel import _compat


@dataclass(frozen=True)
class ParameterPlacement:
    """One parameter on this rank.

    Attributes:
        name: its name in the module the setup ran on.
        shape: the whole (global) shape.
        local_shape: this rank's part (unpadded).
        stored: elements this rank stores (the padded FSDP2 shard, else the local part).
        itemsize: bytes of one element.
        placements: ``{mesh dimension: placement}`` (``"Shard(0)"``, ``"Replicate()"``, ...); empty for a plain
            tensor (replicated on every rank).
        trainable: whether it has a gradient and optimizer state.
    """

    name: str
    shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    stored: int
    itemsize: int
    placements: dict[str, str] = field(default_factory=dict)
    trainable: bool = True
    split_dims: tuple[str, ...] = ()

    @property
    def local_numel(self) -> int:
        return math.prod(self.local_shape)

    def split_over(self, dim: str) -> bool:
        """Whether the mesh dimension ``dim`` splits this parameter (a shard of it, not a replica)."""
        return dim in self.split_dims

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "local_shape": list(self.local_shape),
            "stored_elements": self.stored,
            "itemsize": self.itemsize,
            "placements": self.placements,
            "split_over": list(self.split_dims),
            "trainable": self.trainable,
        }


@dataclass(frozen=True)
class RankState:
    """Per-rank bytes of model state, and each parameter's placement (module docstring)."""

    rank: int
    coordinates: dict[str, int]
    parameters: tuple[ParameterPlacement, ...]

    @property
    def param_bytes(self) -> int:
        return sum(p.stored * p.itemsize for p in self.parameters)

    @property
    def grad_bytes(self) -> int:
        return sum(p.stored * p.itemsize for p in self.parameters if p.trainable)

    @property
    def optimizer_bytes(self) -> int:
        return sum(2 * p.local_numel * p.itemsize for p in self.parameters if p.trainable)

    @property
    def state_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def padding_elements(self) -> int:
        """Elements stored beyond this rank's part (FSDP2's padding of uneven shards)."""
        return sum(p.stored - p.local_numel for p in self.parameters)

    def split_and_replicated(self, dim: str) -> tuple[list[str], list[str]]:
        """Names of the parameters the mesh dimension ``dim`` splits, and of those it replicates."""
        split = [p.name for p in self.parameters if p.split_over(dim)]
        return split, [p.name for p in self.parameters if not p.split_over(dim)]

    def as_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "coordinates": self.coordinates,
            "param_bytes": self.param_bytes,
            "grad_bytes": self.grad_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            "state_bytes": self.state_bytes,
            "padding_elements": self.padding_elements,
        }


def _placements(p: torch.Tensor) -> tuple[dict[str, str], tuple[str, ...]]:
    """``{mesh dimension: placement}`` and the dimensions that split ``p`` (a plain tensor: none)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(p, DTensor):
        return {}, ()
    names = p.device_mesh.mesh_dim_names or tuple(str(i) for i in range(p.device_mesh.ndim))
    pairs = list(zip(names, p.placements))
    return {name: repr(pl) for name, pl in pairs}, tuple(name for name, pl in pairs if isinstance(pl, Shard))


def _local(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p


def rank_state(
    module: nn.Module,
    rank: int = 0,
    coordinates: dict[str, int] | None = None,
    *,
    prefix: str = "",
    sharded_by: Sequence[nn.Module] = (),
) -> RankState:
    """The state of ``module`` on this rank, read from its parameters (each counted once: tied weights share
    one), after a setup on ``rank`` at mesh ``coordinates`` (for the report only); ``prefix`` is taken off the
    names (a wrapper's attribute); ``sharded_by``: modules outside ``module`` that ``fully_shard`` was applied to
    (``pp_dp``'s stage modules), whose records hold the padded sizes of ``module``'s parameters."""
    records = [rec for m in (module, *sharded_by) for rec in _compat.fsdp_params(m)]
    stored = {id(rec.sharded_param): math.prod(rec.padded_sharded_param_size) for rec in records}
    seen: set[int] = set()
    rows = []
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        local = _local(p)
        placements, split = _placements(p)
        rows.append(
            ParameterPlacement(
                name=name.removeprefix(prefix),
                shape=tuple(p.shape),
                local_shape=tuple(local.shape),
                stored=stored.get(id(p), local.numel()),
                itemsize=p.element_size(),
                placements=placements,
                trainable=p.requires_grad,
                split_dims=split,
            )
        )
    return RankState(rank, dict(coordinates or {}), tuple(rows))
