"""The peak-memory and step-time part of `lit-parallel advise`: predict and print.

:func:`predict` builds the model on the meta device and predicts every strategy's per-rank peak
(:mod:`lit_parallel.planner.memory.peak`) and step time (:mod:`lit_parallel.planner.time.step`);
:mod:`lit_parallel.commands.advise.compare` compares it with what the same step measures on this machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
from rich.markup import escape
from torch import nn

from lit_parallel.formatting import format_bytes
from lit_parallel.measure.live_memory import CATEGORIES
from lit_parallel.parallel.memory import estimate_all_to_all_bytes
from lit_parallel.parallel.tensor_parallel.plan import TPPlan
from lit_parallel.planner.memory.peak import EXPERT_PARALLEL, PeakReport
from lit_parallel.planner.memory.predict import predict_peaks
from lit_parallel.planner.model_summary import meta_model, shaped_input
from lit_parallel.planner.precision import compute_dtype
from lit_parallel.planner.time.calibration import StrategyCost
from lit_parallel.planner.time.pipeline import StageWork
from lit_parallel.planner.time.step import (
    ExpertExchange,
    StepTime,
    collectives_per_step,
    comm_seconds,
    predict_step_time,
)

MEMORY_TARGET, TIME_TARGET = 0.10, 0.25  # the planner's published error targets
# time the whole model (or else its largest block) only when it takes less than this share of RAM
STEP_TIME_BLOCK_LIMIT = 0.05
# strategies never measured in a launch priced with the measured cost of the closest one
_COST_OF = {"hsdp": "fsdp_blocks", "tp_dp": "fsdp_blocks", EXPERT_PARALLEL: "fsdp_blocks"}


@dataclass
class Prediction:
    """Everything `advise` predicts for one model, input and cluster shape."""

    model: str
    report: PeakReport
    timing: StepTime | None = None
    overhead_s: float = 0.0
    busbw_gbps: float | None = None
    latency_s: float = 0.0
    groups: int = 1
    costs: dict[str, StrategyCost] | None = None
    notes: list[str] = field(default_factory=list)
    buffers: bool = False  # the model has buffers (DDP broadcasts them every step)
    stage_work: list[StageWork] | None = None  # pp_dp: each stage's share of the ops and FLOPs
    # tp_dp: the all-reduces of its automatic plan's step (a row-wise layer's output in forward, a column-wise
    # layer's input gradient in backward where its input needs one), and the share of the compute the plan
    # splits (of the parameters outside embeddings)
    tp_all_reduces: int = 0
    tp_split: float = 1.0

    def step_s(self, strategy: str) -> dict[str, float | None]:
        """Seconds of one step: compute + optimizer (divided where sharded) + communication + Lightning's
        per-step overhead; communication is ``None`` without a bus bandwidth. With a measured cost of the
        strategy (:mod:`~lit_parallel.planner.time.calibration`) communication is what it was measured to add
        per step, per FSDP group, per parameter tensor and per parameter byte (``hsdp`` and ``tp_dp``: the
        ``fsdp_blocks`` cost without its per-byte part, plus their own bytes over the bus bandwidth)."""
        if strategy == "pp_dp":  # the pipeline's bubble and stage boundaries: :func:`pipeline_step_s`
            return pipeline_step_s(self)
        if self.timing is None:
            return {"compute_s": None, "optimizer_s": None, "comm_s": None, "step_s": None}
        r = self.report
        tp = r.devices / (self.tp_split + r.devices * (1 - self.tp_split)) if strategy == "tp_dp" else 1
        shard = (
            1
            if strategy in ("one_process", "ddp_tuned")
            else (r.devices if strategy == "hsdp" else r.devices * r.nodes)
        )
        compute, opt = self.timing.compute_s / tp, self.timing.optimizer_s(shard)
        comm = None
        if self.busbw_gbps:
            comm = self._comm_s(strategy)
        step = compute + opt + (comm or 0.0) + self.overhead_s
        return {"compute_s": compute, "optimizer_s": opt, "comm_s": comm, "step_s": step}

    def expert_exchange(self) -> ExpertExchange:
        """What ``fsdp_blocks_ep`` splits and exchanges per step: the experts over the report's
        expert-parallel size, the FSDP groups they add, and the all-to-all bytes of the simulated MoE calls
        (tokens routed, top-k, hidden width; in the compute dtype, the experts equally loaded)."""
        r = self.report
        ep = r.expert_parallel_size
        if ep == 1:
            return ExpertExchange()
        c = 4 if r.precision == "32-true" else 2
        sent = sum(
            estimate_all_to_all_bytes(
                rows, hidden=h, top_k=k, moe_layers=1, num_experts=e, expert_parallel=ep, element_bytes=c
            )
            for rows, h, k, e in r.moe_calls
            if k is not None
        )
        return ExpertExchange(r.shape.expert_params, ep, r.shape.expert_groups(ep), len(r.moe_calls), sent)

    def _comm_s(self, strategy: str) -> float:
        r = self.report
        grad = 4 if r.precision in ("32-true",) else 2
        own_cost = self.costs is not None and strategy in self.costs
        cost = (
            self.costs.get(strategy if own_cost else _COST_OF.get(strategy, strategy)) if self.costs else None
        )
        experts = self.expert_exchange() if strategy == EXPERT_PARALLEL else ExpertExchange()
        # the root FSDP group: the parameters outside blocks, experts excepted (they are groups of their own)
        root = min(r.shape.params - r.shape.block_params, r.shape.params - experts.expert_params)

        def sent(latency_s: float) -> float:  # the step's bytes at the bus bandwidth, latency_s per call
            return comm_seconds(
                strategy,
                r.shape.params,
                devices=r.devices,
                nodes=r.nodes,
                grad_bytes=grad,
                busbw_gbps=self.busbw_gbps,
                latency_s=latency_s,
                groups=self.groups,
                root_params=root,
                experts=experts,
            )

        if cost is None or strategy == "one_process" or r.devices * r.nodes == 1:
            return sent(self.latency_s)
        if not own_cost:  # priced with another strategy's cost: its own bytes at the bus bandwidth
            calls = collectives_per_step(
                strategy,
                groups=self.groups,
                grad_bytes=r.shape.params * grad,
                expert_groups=experts.groups,
                moe_calls=experts.calls,
            )
            more_calls = calls - collectives_per_step("fsdp_blocks", groups=self.groups, grad_bytes=grad)
            own = cost.seconds(self.groups, self.timing.tensors, cost.reference_bytes)  # no per-byte part
            return sent(0.0) + max(0, more_calls) * self.latency_s + own
        # measured for this strategy: the bytes are in its per-byte cost; DDP's extra buckets pay the latency
        calls = collectives_per_step(strategy, groups=self.groups, grad_bytes=r.shape.params * grad)
        more_calls = max(0, calls - 1) if strategy == "ddp_tuned" else 0
        return more_calls * self.latency_s + cost.seconds(
            self.groups,
            self.timing.tensors,
            r.shape.params * grad,
            buffers=self.buffers,
            all_reduces=self.tp_all_reduces,
        )

    def as_dict(self) -> dict[str, Any]:
        out = self.report.as_dict()
        for strategy, entry in out["peak"].items():
            entry["time"] = self.step_s(strategy)
        out.update(
            model=self.model,
            overhead_s=self.overhead_s,
            busbw_gbps=self.busbw_gbps,
            latency_s=self.latency_s,
            notes=self.notes,
        )
        if self.costs:
            out["strategy_costs"] = {name: cost.as_dict() for name, cost in self.costs.items()}
        if self.timing is not None:
            t = self.timing
            out["block_timing"] = {
                "unit": t.block_description,
                "block_s": t.block_s,
                "op_s": t.op_s,
                "flop_s": t.flop_s,
                "ops": t.ops,
                "flops": t.flops,
                "optimizer_tensor_s": t.optimizer_tensor_s,
                "optimizer_element_s": t.optimizer_element_s,
                "tensors": t.tensors,
                "elements": t.elements,
                "fsdp_groups": self.groups,
                "device": t.device,
            }
        return out


def tp_plan(module: nn.Module, tp: int) -> tuple[tuple[nn.Module, TPPlan] | None, str]:
    """``tp_dp``'s automatic plan for ``module`` (on meta) over ``tp`` ranks, with the copy of ``module`` it
    was inferred on (converted as tensor parallelism converts it: torch's ``nn.MultiheadAttention`` split
    into its projections; ``module`` is left as it is); or ``(None, why not)``."""
    import copy

    from lit_parallel.parallel.tensor_parallel.infer import infer_tp_plan
    from lit_parallel.parallel.tensor_parallel.plan import TPPlanError

    work = copy.deepcopy(module)
    try:
        return (work, infer_tp_plan(work, tp_size=tp)), ""
    except (TPPlanError, RuntimeError, ValueError) as err:
        return None, f"tp_dp: no tensor-parallel plan for {tp} ranks: {str(err).splitlines()[0]}"


def _tp_plan_figures(module: nn.Module, plan: TPPlan, given: Any, seq_len: int | None) -> tuple[int, float]:
    """Of ``tp_dp``'s plan for ``module``: the all-reduces of its step (a row-wise layer's output in forward,
    a column-wise layer's input gradient in backward where its input needs one; counted in a forward on meta
    of one sample, ``given`` or made up as the memory simulation makes it) and the share of the parameters
    outside embeddings that it splits (what tensor parallelism divides of the compute)."""
    from lit_parallel.parallel.example_inputs import meta_example_input
    from lit_parallel.planner.memory.tensor_parallel import all_reduces_per_step

    split = sum(p.numel() for layer in plan.split for p in module.get_submodule(layer.path).parameters())
    dense = [p for m in module.modules() if not isinstance(m, nn.Embedding) for p in m.parameters(False)]
    share = min(1.0, split / sum(p.numel() for p in dense)) if dense else 0.0
    args = meta_example_input(module, batch_size=1, seq_len=seq_len, given=given(1) if given else None).args
    return all_reduces_per_step(module, plan, args), share


@dataclass(frozen=True)
class TimingUnit:
    """The part of a model `advise` times to predict its step: a block (``block``: its qualified name) or,
    with ``block`` ``None``, the whole model (Python work between blocks included)."""

    block: str | None


def timing_unit(
    pred: Prediction, module: nn.Module, largest: str | None, device: torch.device | None = None
) -> TimingUnit | None:
    """What `advise` times of ``module``: the whole model when it takes at most
    :data:`STEP_TIME_BLOCK_LIMIT` of the memory of ``device`` (this machine's RAM for the CPU, the GPU's
    for CUDA), else its largest block (``largest``); ``None`` when even that is too large to time here (a
    note in ``pred`` says so)."""
    if device is not None and device.type == "cuda":
        capacity, what = torch.cuda.get_device_properties(device).total_memory, f"{device}'s memory"
    else:
        capacity, what = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's RAM"
    if pred.report.peaks["one_process"].total <= STEP_TIME_BLOCK_LIMIT * capacity:
        largest = None
    unit = module.get_submodule(largest) if largest else module
    unit_bytes = sum(p.numel() for p in unit.parameters()) * 16
    if unit_bytes > STEP_TIME_BLOCK_LIMIT * capacity:
        pred.notes.append(
            f"no step time: timing {largest or 'the model'} needs ~{format_bytes(unit_bytes, decimal=True)}, "
            f"more than {STEP_TIME_BLOCK_LIMIT:.0%} of {what}"
        )
        return None
    return TimingUnit(largest)


def step_time_device(device_type: str) -> torch.device | None:
    """Where `advise` times the step of a prediction for ``device_type`` devices: this machine's device of
    that type (CUDA: the current device), or ``None`` when it has none. A CPU timing is no prediction for
    a GPU: the two differ by orders of magnitude, and not by one factor (per-op overheads, FLOP rates)."""
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    return torch.device("cpu") if device_type == "cpu" else None


def predict(
    path: str,
    kwargs: dict[str, Any],
    *,
    precision: str,
    devices: int,
    nodes: int,
    batch_size: int | None,
    seq_len: int | None,
    device_type: str,
    step_time: bool,
    busbw_gbps: float | None,
    latency_s: float = 0.0,
    input_shape: tuple[int, ...] | None = None,
    costs: dict[str, StrategyCost] | None = None,
    expert_parallel: int = 1,
) -> Prediction:
    """Peak memory of every strategy, and the step time when the model (or its largest block) can be timed
    here; ``costs``: what each strategy adds per step on the cluster (``advise --cluster``);
    ``expert_parallel``: above 1, ``fsdp_blocks`` with that ``expert_parallel_size`` too (the advisor's)."""
    name, module, names, largest = meta_model(path, kwargs)
    given = shaped_input(input_shape)
    tp, why = tp_plan(module, devices) if devices > 1 else (None, "")
    report = predict_peaks(
        module,
        precision=precision,
        devices=devices,
        nodes=nodes,
        batch_size=batch_size,
        seq_len=seq_len,
        block_names=names,
        device_type=device_type,
        example_inputs=given(batch_size or 1) if given else None,
        tp_plan=tp,
        expert_parallel=expert_parallel,
    )
    if expert_parallel > 1 and any(k is None for _, _, k, _ in report.moe_calls):
        report.notes.append(
            f"{report.label(EXPERT_PARALLEL)}: the all-to-all bytes of MoE layers without a top_k attribute"
            " are not counted in its step time"
        )
    pred = Prediction(
        name,
        report,
        busbw_gbps=busbw_gbps,
        latency_s=latency_s,
        groups=len(names) + 1,
        costs=costs,
        buffers=any(True for _ in module.buffers()),
    )
    if why:  # no plan splits this model over `devices` ranks: no tp_dp row, and why
        for peaks in (report.peaks, report.peaks_checkpointed):
            peaks.pop("tp_dp", None)
        report.notes.append(why)
    elif tp is not None:
        pred.tp_all_reduces, pred.tp_split = _tp_plan_figures(*tp, given, seq_len)
    if report.pipeline is not None:
        from lit_parallel.planner.pipeline_layout import micro_batch_args
        from lit_parallel.planner.time.pipeline import pipeline_stage_work

        lay = report.pipeline.layout
        whole = given(report.batch_size) if given else None
        pred.stage_work = pipeline_stage_work(
            module, names, lay, micro_batch_args(module, lay.micro_batch, seq_len, whole)
        )
    if not step_time:
        return pred
    timing_device = step_time_device(device_type)
    if timing_device is None:
        pred.notes.append(
            f"no step time: the prediction is for {device_type} devices and this machine has none to time the"
            f" model on (timing it on the CPU would predict a CPU step). Run `advise` where a {device_type}"
            " device is visible, or predict for this machine's CPU with --device-type cpu"
        )
        return pred
    unit = timing_unit(pred, module, largest, timing_device)
    if unit is None:
        return pred
    low = report.pipeline.layout.micro_batch if report.pipeline is not None else None  # pp_dp's slots run it
    pred.timing = predict_step_time(
        module,
        block_name=unit.block,
        dtype=compute_dtype(precision),
        batch_size=batch_size,
        seq_len=seq_len,
        example_inputs=given,
        low_batch=low,
        device=timing_device,
    )
    from lit_parallel.commands.advise.measure import lightning_overhead

    pred.overhead_s = lightning_overhead()
    if busbw_gbps is None and devices * nodes > 1:
        pred.notes.append(
            "step time without communication: pass --busbw-gbps (`lit-parallel doctor` measures it)"
        )
    return pred


def pipeline_step_s(pred: Prediction) -> dict[str, float | None]:
    """``pp_dp``'s seconds of one step for an ``advise`` prediction (the shape of ``Prediction.step_s``):
    each stage's compute per micro-batch from its share of the ops and FLOPs
    (:mod:`~lit_parallel.planner.time.pipeline`), the schedule over them (the slowest stage busy, the others
    once: the bubble), the largest stage's AdamW step, the stage boundary transfers (and FSDP2's
    collectives over the stage's data-parallel ranks) at the measured latency and bandwidth, the measured
    bookkeeping per slot (per FSDP group, parameter tensor and parameter byte of the largest stage),
    Lightning's per-step overhead. ``None`` entries: not predictable (no timing, no pipeline)."""
    from lit_parallel.planner.time.calibration import pipeline_slot_s
    from lit_parallel.planner.time.pipeline import transfer_seconds, uneven_pipeline_step
    from lit_parallel.planner.time.step import comm_seconds

    pipe, t = pred.report.pipeline, pred.timing
    if t is None or pipe is None:
        return {"compute_s": None, "optimizer_s": None, "comm_s": None, "step_s": None}
    lay, share = pipe.layout, pipe.stage_share
    m = lay.microbatches
    # without a count per stage: stages equal, as their parameters (one stage's groups: its blocks + root)
    equal = StageWork(share, share, round(share * (pred.groups - 1)) + 1, round(share * t.tensors))
    work = pred.stage_work or [equal] * lay.stages
    # every micro-batch dispatches the stage's ops again; its FLOPs are 1/M of the step's
    slot_s = [w.ops * t.ops * t.op_s + w.flops * t.flops / m * t.flop_s for w in work]
    cost = (pred.costs or {}).get("pp_dp")  # measured per slot by advise --verify's calibration
    groups, tensors = max(w.groups for w in work), max(w.tensors for w in work)
    # the measured cost per slot already holds the calibration's transfers (one each way of a few bytes,
    # latency and all): only the model's bytes are added to it; without one, a latency each way as well
    transfer = transfer_seconds(pipe.boundary_bytes, 0.0 if cost else pred.latency_s, pred.busbw_gbps)
    grad = 4 if pred.report.precision == "32-true" else 2
    per_slot = (
        pipeline_slot_s(cost, groups, tensors, share * pred.report.shape.params * grad) if cost else 0.0
    )
    time = uneven_pipeline_step(slot_s, microbatches=m, transfer_s=transfer, overhead_per_slot_s=per_slot)
    opt = share * (t.tensors * t.optimizer_tensor_s + t.elements / lay.data_parallel * t.optimizer_element_s)
    comm = time.p2p_s + time.overhead_s  # transfers and the schedule's per-slot bookkeeping
    if pred.busbw_gbps and lay.data_parallel > 1:
        grad = 4 if pred.report.precision == "32-true" else 2
        comm += comm_seconds(
            "fsdp_blocks",
            round(share * pred.report.shape.params),
            devices=lay.data_parallel,
            nodes=1,
            grad_bytes=grad,
            busbw_gbps=pred.busbw_gbps,
            latency_s=pred.latency_s,
            groups=groups,
        )
    compute = time.compute_s + time.bubble_s
    return {
        "compute_s": compute,
        "optimizer_s": opt,
        "comm_s": comm,
        "step_s": compute + opt + comm + pred.overhead_s,
    }


def print_prediction(pred: Prediction, console: Any) -> None:
    from lit_parallel.commands.terminal import Column, fit_table

    r = pred.report
    b = lambda n: format_bytes(n, decimal=True)  # noqa: E731
    console.print(
        f"[bold]peak memory per rank[/bold] of one training step (AdamW), micro-batch {r.batch_size} "
        f"({r.input_description}), {r.precision}; activations by precision (no AC / AC): "
        + ", ".join(f"{p} {b(v['off'])} / {b(v.get('on', v['off']))}" for p, v in r.activations.items())
    )
    columns = [
        Column("strategy", wrap=True),
        *(Column(c, "right") for c in (*CATEGORIES, "peak", "peak with AC")),
        Column("at", wrap=True),
        Column("step time", "right"),
        Column("async ckpt host copy", "right"),
    ]
    rows = []
    for s, p in r.peaks.items():
        t = pred.step_s(s)["step_s"]
        host = r.host_copy.get(s)
        rows.append(
            [
                escape(r.label(s)),
                *(b(getattr(p, c)) for c in CATEGORIES),
                b(p.total),
                b(r.peaks_checkpointed[s].total),
                escape(p.phase + (f" ({p.moment})" if p.moment else "")),
                "-" if t is None else f"{t * 1e3:.1f} ms",
                "-" if host is None else b(host),
            ]
        )
    console.print(fit_table(columns, rows, width=console.width))
    if r.host_copy:
        console.print(
            "async ckpt host copy: as in the memory table, counted per tensor as each strategy cuts it (rank 0"
            " holds the larger part of an uneven dim 0), with the buffers; pp_dp: the rank that holds the most"
        )
    if pred.timing is not None:
        t = pred.timing
        console.print(
            f"step time: {t.block_description} timed here on {t.device}: {t.block_s * 1e3:.2f} ms forward + backward"
            f" -> {t.op_s * 1e6:.1f} us per op, {t.flop_s * 1e12:.1f} ps per FLOP; the step has {t.ops:,}"
            f" ops and {t.flops:.3g} FLOPs = {t.compute_s * 1e3:.2f} ms; AdamW {t.optimizer_s() * 1e3:.2f} ms;"
            f" Lightning's per-step overhead {pred.overhead_s * 1e3:.2f} ms"
            + (
                f"; collectives at {pred.busbw_gbps:g} GB/s, {pred.latency_s * 1e6:.0f} us each"
                if pred.busbw_gbps
                else ""
            )
        )
    if r.pipeline is not None:
        console.print(
            f"pp_dp: {r.pipeline.layout.describe()}; the row is its largest stage (stage"
            f" {r.pipeline.off.stage}); bubble and stage boundary transfers are in its step time"
        )
    if r.checkpointing_note:
        console.print(f"[yellow]note[/yellow]: {escape(r.checkpointing_note)}")
    for note in [*r.notes, *pred.notes]:
        console.print(f"[yellow]note[/yellow]: {escape(note)}")


# --- verification ----------------------------------------------------------------------------------------
