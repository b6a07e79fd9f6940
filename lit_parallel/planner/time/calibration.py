"""What each strategy adds to a step on this cluster, measured on five tiny models.

On a GPU cluster a tiny collective costs microseconds; on CPU ranks (gloo) it costs what the operating
system's scheduler makes of it, and FSDP2's per-group work (hooks, copies into and out of the flat
all-gather / reduce-scatter buffers, DTensor dispatch in the optimizer) dominates small models. Little of
that follows from a bandwidth figure, so it is measured: :class:`CalibrationNet` (``blocks`` residual
blocks of ``layers`` Linears of ``width`` features) is trained for a few steps in one process and under
each strategy in a real launch (``lit-parallel advise --verify``); the difference is what the strategy
adds. Five shapes separate five costs:

* ``reference`` (2 blocks of 1 layer, width 4): the strategy's fixed cost per step (one bucket, or the
  root group and two block groups);
* ``thin`` (6 blocks of 1 layer): 4 more FSDP groups and 8 more parameter tensors;
* ``wide`` (6 blocks of 12 layers): the same groups, 132 more tensors than ``thin`` (a long lever: models
  have tens to hundreds of tensors, and each calibration step is noisy);
* ``heavy`` (``reference`` at width 1024): the same groups and tensors, about 8.4 MB more parameters;
* ``buffered`` (``reference`` with a buffer): what syncing buffers adds (DDP broadcasts them at every
  forward, a synchronisation of the ranks in the middle of the step; FSDP2 does not);
* ``paired`` (6 blocks of 2 layers; ``tp_dp`` only): tensor parallelism's automatic plan splits each block's
  two Linears, column-wise then row-wise: 12 split layers, each with one all-reduce (a row-wise layer's
  output in forward, a column-wise layer's input gradient in backward) and DTensor dispatch around it, as in
  ``wide``, whose other 10 Linears per block stay replicated.

So ``per tensor = (wide - thin) / 132``, ``per group = (thin - reference - 8 x per tensor) / 4`` and ``per
byte = (heavy - reference) / its extra parameter bytes``; a model with ``G`` groups, ``T`` parameter
tensors and ``B`` parameter bytes gets ``fixed + (G - 3) x per group + (T - 6) x per tensor + (B -
240) x per byte`` (``+ buffered - reference`` when it has buffers) on top of its one-process step:
every collective, copy and hook the strategy runs, bytes included. DDP has no groups: its per-group cost
is 0. ``tp_dp`` pays per all-reduce of its plan as well (one for each
split layer, column-wise or row-wise, except a column-wise layer whose input needs no gradient; a model's
attention splits three or four column-wise layers for each row-wise one):
``per tensor = (wide - paired) / 120`` (the same split layers) and ``per all-reduce = (paired - thin - 12
x per tensor) / 12``. ``advise --verify`` replaces the latter, and the FSDP strategies' fixed and
per-group costs, with the same shapes timed between the model's own steps
(:mod:`~lit_parallel.commands.advise.cost_timers`). ``pp_dp`` runs the ``reference``, ``thin``, ``wide`` and
``heavy`` shapes: what it adds, divided by that run's pipeline slots (micro-batches + stages - 1), is a
cost per slot, per FSDP group, per parameter tensor and per parameter byte of the largest stage, per slot
(:func:`fit_pipeline_cost`); its stage boundary transfers are priced by the measured bus bandwidth.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import nn

# name -> (blocks, layers per block, width); "buffered" is "reference" with a buffer (DDP syncs buffers)
SHAPES: dict[str, tuple[int, int, int]] = {
    "reference": (2, 1, 4),
    "thin": (6, 1, 4),
    "wide": (6, 12, 4),
    "heavy": (2, 1, 1024),
    "buffered": (2, 1, 4),
    "paired": (6, 2, 4),
}
# measured under tp_dp only (and in one process): the others' fit has no use for it
TP_ONLY_SHAPES = ("paired",)
FEATURES = 4
BATCH = 8


class Residual(nn.Module):
    """``x + layers(x)``: one calibration block (``layers`` Linears in an ``nn.Sequential``)."""

    def __init__(self, layers: int, width: int = FEATURES) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.layers(x)


class CalibrationNet(nn.Module):
    """``Linear(4, width)`` then ``blocks`` :class:`Residual` blocks of ``layers`` Linears each (a chain of
    blocks, so ``pp_dp`` can cut it into stages as well)."""

    def __init__(self, blocks: int, layers: int, width: int = FEATURES, buffer: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, width)
        self.blocks = nn.ModuleList(Residual(layers, width) for _ in range(blocks))
        if buffer:  # state that is not a parameter (running statistics, say): DDP broadcasts it every step
            self.register_buffer("state", torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return h


def calibration_model(name: str) -> nn.Module:
    return CalibrationNet(*SHAPES[name], buffer=name == "buffered")


def calibration_input() -> tuple[torch.Tensor]:
    return (torch.randn(BATCH, FEATURES, generator=torch.Generator().manual_seed(0)),)


def tp_all_reduces(name: str) -> int:
    """All-reduces of one step of a calibration shape under the automatic tensor-parallel plan: one for each
    layer it splits, the first two Linears of each block of two or more (column-wise, whose input, the
    previous Linear's output, needs a gradient, then row-wise; the others read a Linear's output and stay
    replicated), none in a block of one Linear (its output feeds no row-wise layer)."""
    blocks, layers, _ = SHAPES[name]
    return 2 * blocks if layers >= 2 else 0


def counts(name: str) -> tuple[int, int, int]:
    """(FSDP groups, parameter tensors, fp32 parameter bytes) of a calibration shape; the groups are its
    blocks plus the root group."""
    blocks, layers, width = SHAPES[name]
    params = (FEATURES + 1) * width + blocks * layers * (width + 1) * width
    return blocks + 1, 2 + 2 * blocks * layers, 4 * params


@dataclass(frozen=True)
class StrategyCost:
    """Seconds a strategy adds to one step: fixed, per FSDP group, per parameter tensor and per parameter
    byte, beyond the reference shape (``reference_groups`` groups, ``reference_tensors`` tensors,
    ``reference_bytes`` bytes)."""

    fixed_s: float
    group_s: float
    tensor_s: float
    reference_groups: int
    reference_tensors: int
    slot_s: float = 0.0  # pp_dp: per pipeline slot (micro-batch or bubble), the schedule's bookkeeping
    # (pp_dp's group_s is per FSDP group of its largest stage, per slot)
    byte_s: float = 0.0
    reference_bytes: int = 0
    buffers_s: float = 0.0  # a model with buffers: DDP broadcasts them at every forward (a synchronisation)
    # tp_dp: per all-reduce of its plan (one per split layer that needs one; DTensor's work around it)
    all_reduce_s: float = 0.0

    @classmethod
    def fit(cls, extra_s: dict[str, float], *, grouped: bool, tensor_parallel: bool = False) -> StrategyCost:
        """From the seconds the strategy added to each shape (``grouped``: FSDP, which has groups;
        ``tensor_parallel``: tp_dp, whose ``wide`` and ``paired`` shapes hold split layers)."""
        (g_ref, t_ref, b_ref), (g_thin, t_thin, _), (_, t_wide, _), (_, _, b_heavy) = (
            counts(n) for n in ("reference", "thin", "wide", "heavy")
        )
        per_tensor = max(0.0, (extra_s["wide"] - extra_s["thin"]) / (t_wide - t_thin))
        per_reduce = 0.0
        if tensor_parallel:  # wide and paired split the same layers; paired and thin have the same groups
            t_paired = counts("paired")[1]
            per_tensor = max(0.0, (extra_s["wide"] - extra_s["paired"]) / (t_wide - t_paired))
            more = extra_s["paired"] - extra_s["thin"] - per_tensor * (t_paired - t_thin)
            per_reduce = max(0.0, more / tp_all_reduces("paired"))
        per_group = 0.0
        if grouped:
            rest = extra_s["thin"] - extra_s["reference"] - per_tensor * (t_thin - t_ref)
            per_group = max(0.0, rest / (g_thin - g_ref))
        per_byte = max(0.0, (extra_s["heavy"] - extra_s["reference"]) / (b_heavy - b_ref))
        buffers = 0.0  # DDP's broadcast of buffers at every forward; FSDP2 syncs none
        if not grouped and "buffered" in extra_s:
            buffers = max(0.0, extra_s["buffered"] - extra_s["reference"])
        return cls(
            max(0.0, extra_s["reference"]),
            per_group,
            per_tensor,
            g_ref,
            t_ref,
            byte_s=per_byte,
            reference_bytes=b_ref,
            buffers_s=buffers,
            all_reduce_s=per_reduce,
        )

    def seconds(
        self,
        groups: int,
        tensors: int,
        param_bytes: float = 0.0,
        buffers: bool = False,
        all_reduces: int = 0,
    ) -> float:
        """What the strategy adds to the step of a model with ``groups`` FSDP groups, ``tensors``
        parameter tensors, ``param_bytes`` bytes of parameters as communicated, ``buffers`` or not, and
        ``all_reduces`` all-reduces of tensor parallelism's split layers (never less than the fixed cost)."""
        more = (
            self.group_s * (groups - self.reference_groups)
            + self.tensor_s * (tensors - self.reference_tensors)
            + self.byte_s * (param_bytes - self.reference_bytes)
        )
        return (
            self.fixed_s
            + max(0.0, more)
            + (self.buffers_s if buffers else 0.0)
            + self.all_reduce_s * all_reduces
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def fit_costs(
    one_process_s: dict[str, float], strategy_s: dict[str, dict[str, float]]
) -> dict[str, StrategyCost]:
    """Per strategy, its :class:`StrategyCost` from the step seconds of every shape in one process
    (``one_process_s``) and under the strategy (``strategy_s[strategy][shape]``)."""
    out = {}
    for strategy, seconds in strategy_s.items():
        extra = {name: seconds[name] - one_process_s[name] for name in shapes_of(strategy)}
        out[strategy] = StrategyCost.fit(
            extra, grouped=strategy != "ddp_tuned", tensor_parallel=strategy == "tp_dp"
        )
    return out


def shapes_of(strategy: str | None) -> tuple[str, ...]:
    """The calibration shapes measured under ``strategy`` (``None``: one process, every shape)."""
    return tuple(n for n in SHAPES if strategy in (None, "tp_dp") or n not in TP_ONLY_SHAPES)


# pp_dp's calibration on 2 stages: 1 and 3 blocks per stage, 3 blocks of 12 layers, and the reference's
# stages at width 1024
PIPELINE_SHAPES = ("reference", "thin", "wide", "heavy")


def calibration_slots(stages: int) -> int:
    """Pipeline slots (micro-batches + stages - 1) of a calibration shape's pp_dp run on ``stages``."""
    from lit_parallel.planner.pipeline_layout import pipeline_microbatches

    return (pipeline_microbatches(BATCH, stages) or stages) + stages - 1


def stage_groups(name: str, stages: int) -> int:
    """FSDP groups of a calibration shape's largest pp_dp stage: its blocks and the stage's root."""
    return -(-SHAPES[name][0] // stages) + 1


def stage_tensors(name: str, stages: int) -> int:
    """Parameter tensors of a calibration shape's largest pp_dp stage: the input layer's two and its share
    of the blocks' Linears, two each."""
    blocks, layers, _ = SHAPES[name]
    return 2 + 2 * -(-blocks // stages) * layers


def stage_bytes(name: str, stages: int) -> int:
    """fp32 parameter bytes of a calibration shape's largest pp_dp stage: the first, the input layer and
    its share of the blocks."""
    blocks, layers, width = SHAPES[name]
    return 4 * ((FEATURES + 1) * width + -(-blocks // stages) * layers * (width + 1) * width)


def fit_pipeline_cost(
    one_process_s: dict[str, float], pipeline_s: dict[str, float], stages: int
) -> StrategyCost:
    """``pp_dp``'s cost per pipeline slot (micro-batches + stages - 1): what it added to each of
    :data:`PIPELINE_SHAPES`, spread over the slots of their run, is ``slot_s + group_s x G + tensor_s x T
    + byte_s x B`` with ``G`` the FSDP groups, ``T`` the parameter tensors and ``B`` the parameter bytes of
    the largest stage. Every slot runs each group's hooks and FSDP2's per-parameter work (its DTensor
    views, the copies of each parameter into and out of the group's gather buffers, for every micro-batch's
    forward and backward, though one data-parallel rank has nothing to gather): a transformer block of a
    dozen tensors costs more per slot than a calibration block of two."""
    groups, tensors, _ = counts("reference")
    slots = calibration_slots(stages)
    per_slot = {n: max(0.0, pipeline_s[n] - one_process_s[n]) / slots for n in PIPELINE_SHAPES}
    g = {n: stage_groups(n, stages) for n in PIPELINE_SHAPES}
    t = {n: stage_tensors(n, stages) for n in PIPELINE_SHAPES}
    b = {n: stage_bytes(n, stages) for n in PIPELINE_SHAPES}
    # heavy is reference at a larger width (same groups and tensors), wide is thin with more layers per
    # block (same groups), thin is reference with more blocks
    per_byte = max(0.0, (per_slot["heavy"] - per_slot["reference"]) / (b["heavy"] - b["reference"]))
    wide = per_slot["wide"] - per_byte * (b["wide"] - b["thin"])
    per_tensor = max(0.0, (wide - per_slot["thin"]) / (t["wide"] - t["thin"]))
    thin = (
        per_slot["thin"] - per_byte * (b["thin"] - b["reference"]) - per_tensor * (t["thin"] - t["reference"])
    )
    per_group = max(0.0, (thin - per_slot["reference"]) / (g["thin"] - g["reference"]))
    slot = per_slot["reference"] - per_group * g["reference"] - per_tensor * t["reference"]
    slot = max(0.0, slot - per_byte * b["reference"])
    return StrategyCost(0.0, per_group, per_tensor, groups, tensors, slot_s=slot, byte_s=per_byte)


def pipeline_slot_s(cost: StrategyCost, groups: int, tensors: int, stage_param_bytes: float) -> float:
    """What ``pp_dp`` adds per slot to a model whose largest stage has ``groups`` FSDP groups, ``tensors``
    parameter tensors and ``stage_param_bytes`` bytes of parameters (:func:`fit_pipeline_cost`)."""
    return cost.slot_s + cost.group_s * groups + cost.tensor_s * tensors + cost.byte_s * stage_param_bytes


def load_cluster(path: str) -> dict[str, Any]:
    """What ``lit-parallel advise --verify --json PATH`` measured of a cluster (its ``measured_cluster``
    entry, or that entry saved alone): ``busbw_gbps``, ``latency_s`` and ``strategy_costs`` as
    :class:`StrategyCost` objects. Raises ``ValueError`` naming what is missing."""
    import json
    from pathlib import Path

    fix = "make it with `lit-parallel advise --model ... --verify --json PATH` on the cluster"
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"--cluster {path}: cannot read it as JSON ({err}); {fix}") from None
    data = data.get("measured_cluster", data) if isinstance(data, dict) else None
    need = ("busbw_gbps", "latency_s", "strategy_costs")
    if not isinstance(data, dict) or any(k not in data for k in need):
        raise ValueError(f"--cluster {path}: no measured_cluster with {', '.join(need)} in it; {fix}")
    known = {f.name for f in fields(StrategyCost)}  # a file from another version may hold more
    try:
        costs = {
            name: StrategyCost(**{k: v for k, v in c.items() if k in known})
            for name, c in data["strategy_costs"].items()
        }
    except (TypeError, AttributeError) as err:
        raise ValueError(f"--cluster {path}: a strategy cost is malformed ({err}); {fix}") from None
    ranks = data.get("ranks")
    return {
        "busbw_gbps": float(data["busbw_gbps"]),
        "latency_s": float(data["latency_s"]),
        "costs": costs,
        "ranks": int(ranks) if isinstance(ranks, (int, float)) and ranks >= 1 else None,
    }


def for_ranks(costs: dict[str, StrategyCost], measured: int, ranks: int) -> dict[str, StrategyCost]:
    """Costs measured on ``measured`` ranks, for a cluster of ``ranks``: ring collectives (all-reduce,
    all-gather, reduce-scatter) move ``(n - 1) / n`` of the bytes through every rank, so the per-byte cost
    scales by that ratio; the per-call costs are kept as measured (what they become on more ranks, a launch
    of ``measured`` ranks cannot tell)."""
    from dataclasses import replace

    if measured == ranks or measured < 2 or ranks < 2:
        return costs
    ratio = ((ranks - 1) / ranks) / ((measured - 1) / measured)
    # pp_dp's per-byte cost is each stage's own copies (fit_pipeline_cost), not ring traffic: kept
    return {name: c if name == "pp_dp" else replace(c, byte_s=c.byte_s * ratio) for name, c in costs.items()}
