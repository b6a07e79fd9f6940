"""Pipeline parallelism: the schedules, and the plan that cuts a model into stages at block boundaries.

Pure PyTorch (no Lightning). :func:`plan_pipeline` decides which blocks go to which stage and which rank
holds which stages; :mod:`~lit_parallel.parallel.pipeline.stage` builds the stage modules from the plan and
:mod:`~lit_parallel.parallel.pipeline.schedule` runs torch's schedules over them.

A model is cut into *pieces*: the blocks (found by :func:`~lit_parallel.parallel.find_transformer_blocks`,
all in one container and called in order), the parameterised modules before them (embeddings: the first
stage) and after them (final norm, head: the last stage). The blocks are split into contiguous runs
balanced by parameter count: the count is known identically on every rank without running anything
(a measured per-block time would differ from rank to rank and need an agreement step), and for the
repeated blocks of a transformer it is proportional to their compute (2 FLOPs per parameter per token).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lit_parallel.parallel.blocks import BlockPlan

# name -> (torch class name, stages per rank, stage-to-rank style); every schedule here ran on gloo in
# tests/strategies/test_pipeline.py (exact against one process). Refused ones carry the reason.
SCHEDULES: dict[str, tuple[str, int, str]] = {
    "GPipe": ("ScheduleGPipe", 1, "loop"),
    "1F1B": ("Schedule1F1B", 1, "loop"),
    "Interleaved1F1B": ("ScheduleInterleaved1F1B", 2, "loop"),
    "LoopedBFS": ("ScheduleLoopedBFS", 2, "loop"),
    "InterleavedZeroBubble": ("ScheduleInterleavedZeroBubble", 2, "loop"),
    "ZBVZeroBubble": ("ScheduleZBVZeroBubble", 2, "v"),
    "DualPipeV": ("ScheduleDualPipeV", 2, "v"),
}
REFUSED_SCHEDULES: dict[str, str] = {}
# The zero-bubble schedules split backward into input and weight gradients and find the weight gradients
# through the autograd graph of the stage's parameters; under FSDP2 the graph holds the gathered copies, not
# the parameters, and the gradients came out wrong (measured, torch 2.13). They run without FSDP2 only.
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")

__all__ = [
    "REFUSED_SCHEDULES",
    "SCHEDULES",
    "PipelinePlan",
    "ZERO_BUBBLE",
    "StagePlan",
    "balanced_split",
    "bubble_fraction",
    "check_schedule",
    "micro_batches_for",
    "plan_pipeline",
    "stage_to_rank",
]


def check_schedule(
    schedule: Any, pp_size: int | None = None, microbatches: int | None = None, data_parallel: int = 1
) -> None:
    """``schedule`` must be a supported name; ``microbatches`` must fit it (clear error with the fix)."""
    if schedule in ZERO_BUBBLE and data_parallel > 1:
        raise ValueError(
            f"schedule={schedule!r} with data_parallel_size={data_parallel}: zero-bubble schedules compute"
            " weight gradients from the autograd graph of the stage's parameters, which FSDP2 replaces by"
            " gathered copies (the gradients come out wrong on torch 2.13). Use data_parallel_size=1 with it,"
            " or schedule='Interleaved1F1B' / '1F1B' with data parallelism"
        )
    if schedule in REFUSED_SCHEDULES:
        raise ValueError(f"schedule={schedule!r} cannot run here: {REFUSED_SCHEDULES[schedule]}")
    if schedule not in SCHEDULES:
        raise ValueError(
            f"schedule={schedule!r} is not a pipeline schedule; choose one of {', '.join(SCHEDULES)}"
        )
    if pp_size is None or microbatches is None:
        return
    if (
        schedule in ("1F1B", "DualPipeV", "Interleaved1F1B", "InterleavedZeroBubble")
        and microbatches < pp_size
    ):
        raise ValueError(
            f"microbatches={microbatches} < pipeline_parallel_size={pp_size}: schedule={schedule!r} needs at"
            f" least one micro-batch per pipeline rank; use microbatches>={pp_size} or schedule='GPipe'"
        )
    if schedule == "DualPipeV" and microbatches < 2 * pp_size:
        raise ValueError(
            f"schedule='DualPipeV' needs microbatches >= the number of stages (2 x pipeline_parallel_size ="
            f" {2 * pp_size}); got microbatches={microbatches}"
        )
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, microbatches // pp_size)
        if microbatches % rounds:
            raise ValueError(
                f"schedule={schedule!r} runs micro-batches in rounds of pipeline_parallel_size={pp_size};"
                f" microbatches={microbatches} must be a multiple of {microbatches // rounds} (try"
                f" {rounds * pp_size})"
            )


# A schedule that runs any number of micro-batches on the same stages (same stages per rank, same stage-to-rank
# style): for a batch whose micro-batch count the configured schedule refuses (a dataset's short last batch).
_ANY_COUNT = {("loop", 1): "GPipe", ("loop", 2): "LoopedBFS", ("v", 2): "ZBVZeroBubble"}


def micro_batches_for(schedule: str, pp_size: int, microbatches: int, batch_size: int) -> tuple[str, int]:
    """The schedule and number of equal micro-batches that run a batch of ``batch_size`` samples.

    ``microbatches`` when it divides the batch; otherwise (a dataset's last, shorter batch) the largest count
    below it that divides the batch, under ``schedule`` when the schedule accepts that count, else under the
    schedule of the same stage layout that accepts any count (GPipe, LoopedBFS, ZBVZeroBubble). Equal
    micro-batches keep the mean of the micro-batch means equal to the batch's mean; the schedule changes only
    the order of the same forward and backward passes, not the gradients."""
    if batch_size < 1:
        raise ValueError(f"a batch of {batch_size} samples cannot run through the pipeline")
    count = max(m for m in range(1, min(microbatches, batch_size) + 1) if batch_size % m == 0)
    if count == microbatches:
        return schedule, count
    try:
        check_schedule(schedule, pp_size, count)
        return schedule, count
    except ValueError:
        _, per_rank, style = SCHEDULES[schedule]
        return _ANY_COUNT[(style, per_rank)], count


def bubble_fraction(pp_size: int, microbatches: int) -> float:
    """The idle fraction of GPipe and 1F1B with equal stages: ``(P - 1) / (M + P - 1)``."""
    return (pp_size - 1) / (microbatches + pp_size - 1)


def stage_to_rank(num_stages: int, pp_size: int, style: str) -> dict[int, int]:
    """Which pipeline rank runs each stage: round robin (``loop``) or there and back (``v``)."""
    if style == "loop":
        return {s: s % pp_size for s in range(num_stages)}
    out = {}
    for s in range(num_stages):
        lap, pos = divmod(s, pp_size)
        out[s] = pos if lap % 2 == 0 else pp_size - 1 - pos
    return out


@dataclass
class StagePlan:
    """One stage: its index, the rank that runs it, the pieces it owns and their parameter count."""

    index: int
    rank: int
    blocks: list[str]
    prefix: list[str] = field(default_factory=list)
    suffix: list[str] = field(default_factory=list)
    params: int = 0

    @property
    def pieces(self) -> list[str]:
        return [*self.prefix, *self.blocks, *self.suffix]


@dataclass
class PipelinePlan:
    """Stages of the pipeline and how they were chosen; ``container`` is the blocks' container."""

    schedule: str
    pp_size: int
    microbatches: int
    container: str
    stages: list[StagePlan]
    how: str

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def stages_of(self, pp_rank: int) -> list[StagePlan]:
        return [s for s in self.stages if s.rank == pp_rank]

    def table(self) -> str:
        """The plan as one short table (stage, rank, blocks, other modules, parameters)."""
        rows = [
            f"pipeline {self.schedule}, {self.num_stages} stages on {self.pp_size} ranks, "
            f"{self.microbatches} micro-batches, split {self.how}; bubble (P-1)/(M+P-1) = "
            f"{bubble_fraction(self.pp_size, self.microbatches):.0%} for GPipe/1F1B",
            "stage rank blocks                 other              params",
        ]
        for s in self.stages:
            blocks = _span(s.blocks, self.container)
            other = ",".join(_short(n) for n in [*s.prefix, *s.suffix]) or "-"
            rows.append(f"{s.index:>5} {s.rank:>4} {blocks:<22} {other:<18} {s.params:,}")
        return "\n".join(rows)


def _short(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _span(blocks: list[str], container: str) -> str:
    keys = [b[len(container) + 1 :] if container else b for b in blocks]
    if not keys:
        return "-"
    return f"{container}.{keys[0]}" if len(keys) == 1 else f"{container}.{keys[0]}..{keys[-1]} ({len(keys)})"


def balanced_split(weights: list[int], parts: int) -> list[int]:
    """Start indices of ``parts`` contiguous non-empty runs of ``weights`` minimising the heaviest run."""
    n = len(weights)
    if parts > n:
        raise ValueError(f"cannot cut {n} blocks into {parts} stages; every stage needs at least one block")
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: the heaviest run when the first i weights form k runs; cut[k][i]: where the last run starts
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    starts, i = [], n
    for k in range(parts, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


def _pieces(module: nn.Module, container: str) -> tuple[list[str], list[str]]:
    """Parameterised modules before (prefix) and after (suffix) the blocks' container, by registration
    order along the path from the root to the container."""
    prefix: list[str] = []
    suffix: list[str] = []
    path = container.split(".") if container else []
    node, here = module, ""
    for step in path:
        own = [n for n, _ in node.named_parameters(recurse=False)]
        if own:
            raise ValueError(
                f"parameters {own} sit directly on {here or 'the root module'}, outside any submodule, so no"
                " pipeline stage can own them alone; move them into a submodule (an nn.Module holding the"
                " parameter) or pass split=[...] with the module names where stages start"
            )
        seen = False
        for name, child in node.named_children():
            full = f"{here}.{name}" if here else name
            if name == step:
                seen = True
            elif any(True for _ in child.parameters()):
                (suffix if seen else prefix).append(full)
        node, here = getattr(node, step), f"{here}.{step}" if here else step
    return prefix, suffix


def _container_of(blocks: BlockPlan) -> str:
    parents = {name.rsplit(".", 1)[0] if "." in name else "" for name, _ in blocks.blocks}
    if len(parents) != 1 or blocks.how == "size":
        raise ValueError(
            "pipeline parallelism cuts the model between blocks of one container (a ModuleList/Sequential"
            f" called in order); found blocks under {sorted(parents) or 'no container'} ({blocks.how}). Pass"
            " block_types= naming the repeated block class"
        )
    return parents.pop()


def plan_pipeline(
    module: nn.Module,
    blocks: BlockPlan,
    *,
    pp_size: int,
    schedule: str,
    microbatches: int,
    split: str | list[str] = "auto",
) -> PipelinePlan:
    """Cut ``module`` into stages at block boundaries: ``"auto"`` balances parameter counts, a list names the
    blocks where stages 2, 3, ... start. Embeddings go to the first stage, head and norm to the last."""
    check_schedule(schedule, pp_size, microbatches)
    _, per_rank, style = SCHEDULES[schedule]
    num_stages = pp_size * per_rank
    container = _container_of(blocks)
    prefix, suffix = _pieces(module, container)
    modules = dict(module.named_modules())
    count = {n: sum(p.numel() for p in modules[n].parameters()) for n in [*prefix, *suffix]}
    names = [n for n, _ in blocks.blocks]
    weights = [blocks._block_params[n] for n in names]
    weights[0] += sum(count[n] for n in prefix)
    weights[-1] += sum(count[n] for n in suffix)
    if split == "auto":
        if num_stages > len(names):
            raise ValueError(
                f"pipeline_parallel_size={pp_size} with schedule={schedule!r} ({per_rank} stage(s) per rank) makes"
                f" {num_stages} stages, but the model has {len(names)} blocks and every stage needs at least one;"
                f" choose pipeline_parallel_size of at most {len(names) // per_rank}"
                + (" or a schedule with one stage per rank (1F1B, GPipe)" if per_rank > 1 else "")
            )
        starts, how = balanced_split(weights, num_stages), "auto (balanced by parameter count)"
    else:
        starts, how = _starts_from_names(split, names, num_stages), "by name"
    bounds = [*starts, len(names)]
    ranks = stage_to_rank(num_stages, pp_size, style)
    stages = []
    for s in range(num_stages):
        run = names[bounds[s] : bounds[s + 1]]
        stage = StagePlan(s, ranks[s], run, prefix if s == 0 else [], suffix if s == num_stages - 1 else [])
        stage.params = sum(weights[bounds[s] : bounds[s + 1]])
        stages.append(stage)
    _refuse_shared_parameters(module, stages)
    return PipelinePlan(schedule, pp_size, microbatches, container, stages, how)


def _starts_from_names(split: list[str], names: list[str], num_stages: int) -> list[int]:
    if len(split) != num_stages - 1:
        raise ValueError(
            f"split={split!r} names {len(split)} stage starts; {num_stages} stages need {num_stages - 1}"
            " (the first stage starts at the first block)"
        )
    starts = [0]
    for name in split:
        if name not in names:
            raise ValueError(
                f"split names {name!r}, which is not a block; stages start at blocks: {', '.join(names)}"
            )
        starts.append(names.index(name))
    if starts != sorted(set(starts)):
        raise ValueError(f"split={split!r} must name blocks in model order, each after the first block")
    return starts


def _refuse_shared_parameters(module: nn.Module, stages: list[StagePlan]) -> None:
    modules = dict(module.named_modules())
    owner: dict[int, tuple[int, str]] = {}
    for stage in stages:
        for piece in stage.pieces:
            for pname, p in modules[piece].named_parameters():
                first = owner.setdefault(id(p), (stage.index, f"{piece}.{pname}"))
                if first[0] != stage.index:
                    raise ValueError(
                        f"parameter {first[1]} (stage {first[0]}) is the same tensor as {piece}.{pname} (stage"
                        f" {stage.index}): tied weights cannot be split across pipeline stages; untie them"
                        " (give each module its own parameter) or use another strategy"
                    )
