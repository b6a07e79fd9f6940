"""Per-rank peak memory of one training step under each strategy, predicted before any run.

Model state (parameters, gradients, optimizer state) is ZeRO's accounting per rank
(:mod:`lit_parallel.planner.memory.table`); activations and the temporaries of forward and backward come
from one step simulated on the meta device (:mod:`lit_parallel.planner.simulation`); what each
strategy adds is written out below. The step follows Lightning's order: ``training_step`` (forward) runs
while last step's gradients still exist, ``zero_grad`` comes after it, then backward, then
``optimizer.step`` (AdamW). The peak is the largest of three moments:

* forward (its highest point, usually its end): state + last step's gradients + the activations saved
  so far + temporaries (the output, the loss's intermediate results);
* inside backward: state + the gradients so far + the activations not yet freed + gradient temporaries;
* optimizer step: state + all gradients + AdamW's scratch (two fp32 tensors of the largest parameter in
  the for-loop implementation torch uses on CPU; one fp32 copy of every parameter with ``foreach``, its
  default on CUDA).

What each strategy adds (``N`` ranks sharding, ``c`` bytes of the compute dtype):

* ``ddp_tuned``: gradients live in DDP's buckets (``gradient_as_bucket_view``) for the whole step.
* ``fsdp_blocks`` (ZeRO-3), ``hsdp`` (``N`` = devices per node), ZeRO-2 (``fsdp_blocks`` with
  ``reshard_after_forward=False``) and ``fsdp_blocks`` with ``expert_parallel_size = e`` (below), as FSDP2
  in torch 2.13 does it (``_fsdp_collectives.py``,
  ``_fsdp_param_group.py``). Every FSDP group (each block, and the root: the parameters outside blocks)
  is gathered into unsharded parameters of its padded size ``P`` (dim 0 of each parameter padded to a
  multiple of ``N``); shards, and the sharded gradients, are ``P / N`` each. Forward, per block ``k``
  (sizes from the meta simulation at that block's start, inside it and after it):

  - the copy-out of block ``k``: the flat all-gather output of block ``k`` (``P_k``) and of the group
    before it (kept until this copy-out returns) next to the gathered parameters;
  - inside and after block ``k``: block ``k``'s flat output (kept until the next group's copy-out or the
    root's forward returns: the root is the LightningModule and its forward ``training_step``, so the
    last block's flat output is still there when the loss is computed);
  - gathered parameters: the root all the time, block ``k`` while it runs; ZeRO-2 keeps every block
    gathered until its gradients are reduce-scattered.

  Backward: the loss's and the head's part, before the last block's (the root gathered, ZeRO-3's root
  prefetching the last block's all-gather); then, as block ``k``'s gradients are done: its
  unsharded gradient next to its gathered parameters; then (both freed) the reduce-scatter input
  (``P_k``), its output (the new sharded gradient, ``P_k / N``) and, on gloo (CPU), the collective's
  copy of the input (``P_k``); blocks after ``k`` hold sharded gradients, the root's gradients stay
  unsharded until backward ends; ZeRO-3 also holds block ``k-1``'s prefetched all-gather output, ZeRO-2
  the blocks before ``k`` still gathered.

  Categories, as :class:`~lit_parallel.measure.live_memory.LiveMemory` measures them: gathered
  parameters are ``params``; unsharded gradients and the reduce-scatter output (the sharded gradient)
  ``grads``; flat all-gather outputs (also a prefetched one), reduce-scatter inputs and gloo's copies
  ``temporaries``.

  With expert parallelism (``fsdp_blocks_ep``) a rank keeps ``E / e`` experts of each MoE layer, each an
  FSDP group of its own sharded over the ``N / e`` ranks holding the same experts, inside its block's group
  (sharded over all ``N``). So what a block gathers is its non-expert parameters padded over ``N`` plus its
  local experts padded over ``N / e``: ``P_k = pad_N(D_k) + pad_{N/e}(X_k / e)`` instead of ``pad_N(D_k +
  X_k)``; its unsharded gradients ``D_k + X_k / e``; its shards ``pad_N(D_k) / N + pad_{N/e}(X_k / e) / (N /
  e)``, which sum to ZeRO-3's ``P / N`` over the model. The moments above are taken with these sizes, the
  block's and its experts' gathers counted together (the experts' group is gathered while the block's is).
  Activations and temporaries are the one-process step's: with the experts equally loaded, a rank's experts
  process as many rows as its own tokens route (``T x top-k``); the all-to-alls' send and receive buffers
  (``T x top-k x hidden`` each, while a layer exchanges) are not counted.
* ``tp_dp`` with its plan (``advise`` infers it): one tensor-parallel rank's model
  (:mod:`lit_parallel.planner.memory.tensor_parallel`: split layers with their per-rank shapes, head counts per rank)
  simulated on meta, under FSDP2's moments over the data-parallel ranks (over one: no flat buffers, the
  root's gathered copy); and each row-wise layer's forward all-reduce, with its block gathered (DTensor
  parameters) and four copies of its output (the partial sum, the result, gloo's two buffers).
  Without a plan: activations and temporaries inside blocks divided by the tensor-parallel size.
* ``pp_dp``: the largest pipeline stage, from one micro-batch simulated with its activations attributed
  to the blocks (:mod:`lit_parallel.planner.memory.pipeline`, where its terms are written out).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lit_parallel.parallel.expert_parallel import MoELayer, find_moe_layers
from lit_parallel.planner.memory.pipeline import PipelinePrediction
from lit_parallel.planner.memory.table import StateRow
from lit_parallel.planner.simulation import StepSimulation

STRATEGIES = ("one_process", "ddp_tuned", "zero2", "fsdp_blocks", "hsdp", "tp_dp")
# fsdp_blocks with expert parallelism: predicted next to the others when the report has an expert-parallel size
EXPERT_PARALLEL = "fsdp_blocks_ep"
# tp_dp: copies of a row-wise layer's output live at its forward all-reduce: the partial sum, the reduced
# result, gloo's input and output buffers
TP_ALL_REDUCE_COPIES = 4
LABELS = {
    "one_process": "one process (no DDP)",
    "ddp_tuned": "ddp_tuned",
    "zero2": "ZeRO-2 (fsdp_blocks, reshard_after_forward=False)",
    "fsdp_blocks": "fsdp_blocks (ZeRO-3)",
    "hsdp": "hsdp",
    "tp_dp": "tp_dp",
    "pp_dp": "pp_dp (largest stage)",
    EXPERT_PARALLEL: "fsdp_blocks (expert_parallel_size={ep})",  # PeakReport.label fills it in
}
_ROW = {"one_process": "DDP", "ddp_tuned": "DDP", "zero2": "ZeRO-2", "fsdp_blocks": "FSDP/ZeRO-3"}
_ROW.update({"hsdp": "HSDP", "tp_dp": "TP+DP", EXPERT_PARALLEL: "FSDP+EP"})


@dataclass(frozen=True)
class Peak:
    """Bytes per rank at the peak of one step, by category, and the moment it happens."""

    strategy: str
    params: float
    grads: float
    optimizer: float
    activations: float
    temporaries: float
    phase: str  # "forward", "backward" or "optimizer step"
    moment: str = ""  # which moment of that phase (FSDP: which block's gather or reduce-scatter)

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.temporaries

    def as_dict(self) -> dict[str, Any]:
        keys = ("params", "grads", "optimizer", "activations", "temporaries", "total")
        return {
            "phase": self.phase,
            "moment": self.moment or self.phase,
            **{f"{k}_bytes": float(getattr(self, k)) for k in keys},
        }


Rows = tuple[tuple[int, int], ...]  # (dim 0, elements per row) of each parameter


@dataclass(frozen=True)
class ExpertRows:
    """One MoE layer's expert weights as FSDP pads them.

    Attributes:
        num_experts: experts in the layer (``E``).
        stacked: one tensor per weight, experts along dim 0 (``rows``: ``(E, elements per expert)`` each);
            otherwise a list of expert modules (``rows``: one expert's parameters).
        rows: as above.
    """

    num_experts: int
    stacked: bool
    rows: Rows

    def local(self, expert_parallel: int) -> Rows:
        """What one of ``expert_parallel`` ranks keeps: ``E / e`` experts (every row of them when ``e`` is 1)."""
        per_rank = self.num_experts // expert_parallel
        if self.stacked:
            return tuple((per_rank, per_row) for _, per_row in self.rows)
        return self.rows * per_rank

    @property
    def numel(self) -> int:
        return sum(r * n for r, n in self.local(1))


@dataclass(frozen=True)
class ModelShape:
    """The counts the strategy terms need, in elements; ``*_shapes``: ``(dim 0, elements per row)`` of each
    parameter of every block (module order) and of the root (the parameters outside blocks);
    ``*_dense_shapes`` the same without expert weights, ``*_experts`` the expert weights of each MoE layer
    (:class:`ExpertRows`)."""

    params: int
    trainable: int
    param_tensors: int
    largest_param: int
    block_params: int
    largest_block: int
    block_shapes: tuple[Rows, ...] = ()
    root_shapes: Rows = ()
    block_dense_shapes: tuple[Rows, ...] = ()
    root_dense_shapes: Rows = ()
    block_experts: tuple[tuple[ExpertRows, ...], ...] = ()
    root_experts: tuple[ExpertRows, ...] = ()

    @classmethod
    def of(cls, module: nn.Module, blocks: list[nn.Module]) -> ModelShape:
        params = list(dict.fromkeys(module.parameters()))
        sizes = [sum(p.numel() for p in b.parameters()) for b in blocks]
        in_blocks = {id(p) for b in blocks for p in b.parameters()}
        layers = _moe_layers(module)
        experts = {id(p) for layer in layers for p in _expert_params(layer)}
        root = [p for p in params if id(p) not in in_blocks]
        return cls(
            params=sum(p.numel() for p in params),
            trainable=sum(p.numel() for p in params if p.requires_grad),
            param_tensors=sum(1 for p in params if p.requires_grad),
            largest_param=max((p.numel() for p in params if p.requires_grad), default=0),
            block_params=sum(sizes),
            largest_block=max(sizes, default=0),
            block_shapes=tuple(_rows(b.parameters()) for b in blocks),
            root_shapes=_rows(root),
            block_dense_shapes=tuple(
                _rows(p for p in b.parameters() if id(p) not in experts) for b in blocks
            ),
            root_dense_shapes=_rows(p for p in root if id(p) not in experts),
            block_experts=tuple(
                tuple(_expert_rows(layer) for layer in layers if _owner(layer, blocks) is b) for b in blocks
            ),
            root_experts=tuple(_expert_rows(layer) for layer in layers if _owner(layer, blocks) is None),
        )

    @property
    def expert_params(self) -> int:
        """Elements of every expert weight."""
        return sum(e.numel for group in (*self.block_experts, self.root_experts) for e in group)

    def groups(self) -> list[tuple[Rows, tuple[ExpertRows, ...]]]:
        """``(non-expert rows, experts)`` of each block, then of the root (the FSDP groups before experts are
        split); without the expert split (a shape made by hand) every row counts as non-expert."""
        if len(self.block_dense_shapes) != len(self.block_shapes):
            return [(b, ()) for b in self.block_shapes] + [(self.root_shapes, ())]
        blocks = list(zip(self.block_dense_shapes, self.block_experts))
        return [*blocks, (self.root_dense_shapes, self.root_experts)]

    def expert_groups(self, expert_parallel: int) -> int:
        """FSDP groups the experts add on a rank under expert parallelism: one per stacked-experts module,
        one per local expert of a module list."""
        return sum(
            1 if e.stacked else e.num_experts // expert_parallel
            for group in (*self.block_experts, self.root_experts)
            for e in group
        )

    def param_tensors_per_rank(self, expert_parallel: int) -> int:
        """Trainable parameter tensors a rank holds: lists of expert modules keep ``E / e`` of their experts."""
        dropped = sum(
            len(e.rows) * (e.num_experts - e.num_experts // expert_parallel)
            for group in (*self.block_experts, self.root_experts)
            for e in group
            if not e.stacked
        )
        return self.param_tensors - dropped


def _rows(params: Any) -> Rows:
    return tuple((p.shape[0], math.prod(p.shape[1:])) if p.dim() else (1, 1) for p in params)


def _moe_layers(module: nn.Module) -> list[MoELayer]:
    try:
        return find_moe_layers(module)
    except ValueError:  # experts already split by transformers' own expert parallelism: plain parameters
        return []


def _expert_params(layer: MoELayer) -> list[nn.Parameter]:
    if layer.kind == "stacked":
        return list(layer.module.parameters(recurse=False))
    return list(getattr(layer.module, layer.experts_name or "").parameters())


def _expert_rows(layer: MoELayer) -> ExpertRows:
    if layer.kind == "stacked":
        return ExpertRows(layer.num_experts, True, _rows(_expert_params(layer)))
    first = getattr(layer.module, layer.experts_name or "")[0]
    return ExpertRows(layer.num_experts, False, _rows(first.parameters()))


def _owner(layer: MoELayer, blocks: list[nn.Module]) -> nn.Module | None:
    """The block holding ``layer``, or ``None`` (the root)."""
    return next((b for b in blocks if any(m is layer.module for m in b.modules())), None)


def gathered_elements(
    dense: Rows, experts: tuple[ExpertRows, ...], shard: int, expert_parallel: int = 1
) -> int:
    """Elements one FSDP group (a block, or the root) gathers over ``shard`` ranks, padded: with
    ``expert_parallel = e > 1`` its non-expert rows padded over ``shard`` and its ``E / e`` local experts
    padded over the ``shard / e`` ranks holding them (their own FSDP groups)."""
    if expert_parallel == 1:
        return padded(dense + tuple(row for e in experts for row in e.local(1)), shard)
    inner = shard // expert_parallel
    return padded(dense, shard) + sum(padded(e.local(expert_parallel), inner) for e in experts)


def shard_elements(
    dense: Rows, experts: tuple[ExpertRows, ...], shard: int, expert_parallel: int = 1
) -> float:
    """Elements of one FSDP group's shards on each rank (padded): :func:`gathered_elements` divided by the
    ranks each part is sharded over."""
    if expert_parallel == 1:
        return gathered_elements(dense, experts, shard) / shard
    inner = shard // expert_parallel
    return padded(dense, shard) / shard + sum(
        padded(e.local(expert_parallel), inner) / inner for e in experts
    )


def padded(shapes: tuple[tuple[int, int], ...], shard: int) -> int:
    """Elements FSDP2 gathers for these parameters over ``shard`` ranks: dim 0 of each parameter padded to
    a multiple of ``shard`` (``_get_dim0_padded_size``); also the size of their flat all-gather output
    and reduce-scatter input."""
    return sum(-(-rows // shard) * shard * per_row for rows, per_row in shapes)


@dataclass
class PeakReport:
    """Every prediction for one model, micro-batch, precision and cluster shape."""

    precision: str
    devices: int
    nodes: int
    batch_size: int
    input_description: str
    shape: ModelShape
    peaks: dict[str, Peak] = field(default_factory=dict)  # strategy -> without checkpointing
    peaks_checkpointed: dict[str, Peak] = field(default_factory=dict)
    activations: dict[str, dict[str, float]] = field(default_factory=dict)  # precision -> {"off", "on"}
    block_activation_share: float = 0.0
    pipeline: PipelinePrediction | None = None  # pp_dp's layout and largest stage
    notes: list[str] = field(default_factory=list)
    checkpointing_note: str = ""  # why the "with AC" figures are the ones without, when they are
    expert_parallel_size: int = 1  # > 1: fsdp_blocks with expert parallelism is predicted too
    # (rows, hidden, top_k, num_experts) of each MoE layer call (planner.simulation.StepSimulation)
    moe_calls: tuple[tuple[int, int, int | None, int], ...] = ()
    # strategy -> bytes of async_checkpoint's host copy on the rank holding the most (planner.memory.host_copy)
    host_copy: dict[str, float] = field(default_factory=dict)

    def label(self, strategy: str) -> str:
        """How ``strategy``'s row is named (``fsdp_blocks (expert_parallel_size=4)``, ...)."""
        return LABELS[strategy].format(ep=self.expert_parallel_size)

    def as_dict(self) -> dict[str, Any]:
        return {
            "precision": self.precision,
            "batch_size": self.batch_size,
            "input": self.input_description,
            "activations_bytes": self.activations,
            "peak": {
                s: {
                    "label": self.label(s),
                    "activation_checkpointing_off": self.peaks[s].as_dict(),
                    "activation_checkpointing_on": self.peaks_checkpointed[s].as_dict(),
                    "async_checkpoint_host_copy_bytes": self.host_copy.get(s),
                }
                for s in self.peaks
            },
            **({"pipeline": self.pipeline.as_dict()} if self.pipeline is not None else {}),
        }


def _strategy_peak(
    strategy: str,
    sim: StepSimulation,
    rows: dict[str, StateRow],
    shape: ModelShape,
    *,
    c: int,
    opt_bytes: int,
    extra: dict,
) -> Peak:
    """The three moments of one step for ``strategy``; the largest wins."""
    sharded = strategy in ("zero2", "fsdp_blocks", "hsdp", "tp_dp", EXPERT_PARALLEL)
    # ZeRO-2 here is FSDP2 without resharding: the state is sharded like ZeRO-3 (the parameters' shards
    # are what is stored), and the gathered copies are the extra below
    row = rows["FSDP/ZeRO-3" if strategy == "zero2" else _ROW[strategy]]
    p, g, o = row.param_bytes, row.grad_bytes, row.optimizer_bytes
    ep = extra.get("ep", 1) if strategy == EXPERT_PARALLEL else 1
    o += 4 * shape.param_tensors_per_rank(ep)  # AdamW's step counters: one fp32 scalar per parameter tensor
    fw, bw = sim.forward_peak.by_category, sim.backward_peak.by_category
    share, tp, shard = extra["share"], extra["tp"], extra["shard"]

    def split(n: float) -> float:  # tensor parallelism divides what happens inside blocks
        return n * (share / tp + (1 - share)) if strategy == "tp_dp" else n

    block_c = shape.largest_block * c / tp
    root_c = (shape.params - shape.block_params) * c
    if strategy in ("zero2", "fsdp_blocks", "hsdp", EXPERT_PARALLEL):
        moments = fsdp_moments(
            strategy,
            sim,
            shape,
            (p, g, o),
            c=c,
            opt_bytes=opt_bytes,
            shard=shard,
            gloo=extra["gloo"],
            expert_parallel=ep,
        )
        return max(moments, key=lambda m: m.total)
    gathered = {"fw": (0.0, 0.0), "bw": (0.0, 0.0)}  # (parameters gathered, scratch: prefetch + block grads)
    if sharded:  # tp_dp: root kept gathered, one block in forward; in backward the next is prefetched too
        gathered = {"fw": (root_c + block_c, 0.0), "bw": (root_c + block_c, block_c)}
    fraction = bw["grads"] / sim.grad_bytes if sim.grad_bytes else 0.0
    grads_bw = g if strategy == "ddp_tuned" else g * fraction  # DDP's buckets hold every gradient all step
    moments = [
        Peak(
            strategy,
            p + gathered["fw"][0],
            g,
            o,
            split(fw["activations"]),
            split(fw["temporaries"]) + gathered["fw"][1],
            "forward",
        ),
        Peak(
            strategy,
            p + gathered["bw"][0],
            grads_bw,
            o,
            split(bw["activations"]),
            split(bw["temporaries"]) + gathered["bw"][1],
            "backward",
        ),
        Peak(strategy, p, g, o, 0.0, opt_bytes / (shard if sharded else 1), "optimizer step"),
    ]
    return max(moments, key=lambda m: m.total)


@dataclass(frozen=True)
class _Fsdp:
    """What FSDP2's moments are made of: the per-rank state (shards padded), the gathered bytes of the root
    group and of each block (padded), each block's shards and its unsharded gradients on this rank, whether
    blocks stay gathered (ZeRO-2), the ranks sharding, gloo; ``flat``: 0 where the forward's flat all-gather
    outputs do not exist (one rank per shard); ``last``: the unsharded gradient of each block's last
    parameter reduced with the block."""

    strategy: str
    p: float
    g: float
    o: float
    root: float
    blocks: list[float]
    block_shards: list[float]
    block_grads: list[float]
    last: list[float]
    keep: bool
    shard: int
    gloo: bool
    flat: float = 1.0


def fsdp_moments(
    strategy: str,
    sim: StepSimulation,
    shape: ModelShape,
    state: tuple,
    *,
    c: int,
    opt_bytes: int,
    shard: int,
    gloo: bool,
    expert_parallel: int = 1,
) -> list[Peak]:
    """FSDP2's moments (module docstring): each block's gather, inside and after it in forward, the loss,
    each block's reduce-scatter in backward, the rest of backward, the optimizer step; with
    ``expert_parallel > 1`` a block gathers, holds and reduces its non-expert parameters and its local
    experts only (module docstring)."""
    ep = expert_parallel
    groups = shape.groups()
    shards = [shard_elements(d, x, shard, ep) for d, x in groups]
    ratio = sum(shards) * shard / shape.params if shape.params else 1.0
    blocks = groups[:-1]
    # the unsharded gradient of the last parameter the block's own group reduces (with expert parallelism
    # the experts are groups of their own: the block's last non-expert parameter)
    lasts = [d if ep > 1 else rows for (d, _), rows in zip(blocks, shape.block_shapes)]
    # one rank per shard (HSDP of replicas of 1, tp_dp over one data-parallel rank): the gathered copies are
    # there, the forward's flat all-gather outputs are not
    f = _Fsdp(
        strategy,
        state[0] * ratio,
        state[1] * ratio,
        state[2],  # shards are padded; AdamW's state not
        gathered_elements(*groups[-1], shard, ep) * c,
        [gathered_elements(d, x, shard, ep) * c for d, x in blocks],
        [n * c for n in shards[:-1]],
        [(sum(r * n for r, n in d) + sum(e.numel // ep for e in x)) * c for d, x in blocks],
        [math.prod(rows[-1]) * c if rows else 0.0 for rows in lasts],
        keep=strategy == "zero2",
        shard=shard,
        gloo=gloo,
        flat=0.0 if shard == 1 else 1.0,
    )
    moments = _fsdp_forward(f, sim) + _fsdp_backward(f, sim, shape, c)
    moments.append(Peak(strategy, f.p, f.g, f.o, 0.0, opt_bytes / shard, "optimizer step"))
    return moments


def _fsdp_forward(f: _Fsdp, sim: StepSimulation) -> list[Peak]:
    """Each block's gather, inside and after it; the loss."""
    s, p, g, o, root, blocks = f.strategy, f.p, f.g, f.o, f.root, f.blocks
    moments = []
    if len(sim.block_starts) == len(blocks) == len(sim.block_inside) == len(sim.block_after):
        for k, (act, tmp) in enumerate(sim.block_starts):
            gathered = root + (sum(blocks[: k + 1]) if f.keep else blocks[k])
            after = root + (sum(blocks[: k + 1]) if f.keep else 0.0)
            # the copy-out of block k: its flat all-gather output and the previous group's coexist; block
            # k's flat output is kept until the next group's copy-out (or the root's forward returns)
            flats = f.flat * (blocks[k] + (blocks[k - 1] if k else root))
            moments.append(Peak(s, p + gathered, g, o, act, tmp + flats, "forward", f"block {k} gathered"))
            act, tmp = sim.block_inside[k]
            moments.append(
                Peak(s, p + gathered, g, o, act, tmp + f.flat * blocks[k], "forward", f"inside block {k}")
            )
            act, tmp = sim.block_after[k]
            moments.append(
                Peak(s, p + after, g, o, act, tmp + f.flat * blocks[k], "forward", f"after block {k}")
            )
    # the loss: the root's forward is the LightningModule's training_step (a registered FSDP forward
    # method), so the last group's flat output lives until the loss is computed
    fw = sim.forward_peak.by_category
    last = blocks[-1] if blocks else root
    moments.append(
        Peak(
            s,
            p + root + (sum(blocks) if f.keep else 0.0),
            g,
            o,
            fw["activations"],
            fw["temporaries"] + f.flat * last,
            "forward",
            "loss",
        )
    )
    return moments


def _fsdp_backward(f: _Fsdp, sim: StepSimulation, shape: ModelShape, c: int) -> list[Peak]:
    """Each block's reduce-scatter, the loss's and head's backward, the rest of backward."""
    s, p, g, o, root, blocks, keep = f.strategy, f.p, f.g, f.o, f.root, f.blocks, f.keep
    moments = []
    # as block k's gradients are done: its unsharded gradients (grads) and gathered parameters (params),
    # which are freed (resharded) before its reduce-scatter input (temporaries), output (the new sharded
    # gradient: grads) and, on gloo, the collective's copy of the input (temporaries) exist, with the
    # unsharded gradient of the block's last parameter (foreach_reduce's loop variable still holds it); the
    # blocks after it hold sharded gradients, the root's so far are unsharded; ZeRO-2 keeps the blocks
    # before k gathered, ZeRO-3 has block k-1's flat all-gather output prefetched (temporaries until copied)
    full = [sum(r * n for r, n in b) for b in shape.block_shapes]  # one process's: what the simulation holds
    if len(sim.block_grads_done) == len(blocks):
        for k, (act, tmp, grads) in enumerate(sim.block_grads_done):
            last = f.last[k]
            before = (
                blocks[k],
                f.block_grads[k],
                0.0,
            )  # (params, grads, temporaries) before the reduce-scatter
            during = (0.0, f.block_shards[k] + last, blocks[k] * (2 if f.gloo else 1))  # and during it
            more_p, more_g, more_t = max(before, during, key=sum)
            root_grads = max(0.0, grads - sum(full[k:]) * c)
            sharded = g * sum(full[k + 1 :]) / shape.trainable if shape.trainable else 0.0
            gathered = root + (sum(blocks[:k]) if keep else 0.0)
            prefetched = blocks[k - 1] if k and not keep else 0.0
            moments.append(
                Peak(
                    s,
                    p + gathered + more_p,
                    sharded + root_grads + more_g,
                    o,
                    act,
                    tmp + prefetched + more_t,
                    "backward",
                    f"block {k} reduce-scattered",
                )
            )
    # the loss's and the head's backward, before the last block's: only the root gathered (ZeRO-2: every
    # block), the root's unsharded gradients so far; ZeRO-3's root prefetches the last block's all-gather
    if sim.backward_head is not None and blocks:
        head = sim.backward_head.by_category
        moments.append(
            Peak(
                s,
                p + root + (sum(blocks) if keep else 0.0),
                head["grads"],
                o,
                head["activations"],
                head["temporaries"] + (0.0 if keep else blocks[-1]),
                "backward",
                "loss and head",
            )
        )
    # the rest of backward (its highest point may come before any block is done): ZeRO-3 has a block
    # gathered and the next one's all-gather output prefetched
    bw = (sim.backward_blocks or sim.backward_peak).by_category
    fraction = bw["grads"] / sim.grad_bytes if sim.grad_bytes else 0.0
    largest = max(blocks, default=0.0)
    moments.append(
        Peak(
            s,
            p + root + (sum(blocks) if keep else largest),
            g * fraction,
            o,
            bw["activations"],
            bw["temporaries"] + (0.0 if keep else largest),
            "backward",
        )
    )
    return moments


def add_strategy_peaks(
    report: PeakReport,
    sims: dict[tuple[str, bool], StepSimulation],
    rows: dict[str, StateRow],
    *,
    c: int,
    opt_bytes: int,
    device_type: str,
) -> None:
    """Every strategy's peak from the one-process simulations, without and with checkpointing (the row
    without, where checkpointing was not simulated), into ``report``."""
    precision, devices, shape = report.precision, report.devices, report.shape
    sim = sims[(precision, False)]
    world = devices * report.nodes
    ep = report.expert_parallel_size
    for strategy in STRATEGIES + ((EXPERT_PARALLEL,) if ep > 1 else ()):
        extra = {
            "share": report.block_activation_share,
            "tp": devices if strategy == "tp_dp" else 1,
            "shard": devices if strategy == "hsdp" else world,
            "gloo": device_type == "cpu",  # gloo's reduce-scatter copies its input
            "ep": ep,
        }
        args = {"c": c, "opt_bytes": opt_bytes, "extra": extra}
        report.peaks[strategy] = _strategy_peak(strategy, sim, rows, shape, **args)
        report.peaks_checkpointed[strategy] = _strategy_peak(
            strategy, sims.get((precision, True), sim), rows, shape, **args
        )
