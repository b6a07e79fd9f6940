"""`lit-parallel advise --verify`: the prediction next to what the same step measured on this machine.

:func:`verify` runs one process and a launch (:mod:`lit_parallel.commands.advise.measure`) and returns one row per
figure, predicted next to measured; each round of the measurement is predicted from the parts timed in it
and compared with its own steps (:func:`paired_step`). Beside the package's count of a peak (LiveMemory), the
rows carry torch's own MemTracker's count of the same step where it counts the same bytes
(:mod:`lit_parallel.measure.mem_tracker`): an independent check of the counter both sides share.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import torch
from rich.markup import escape
from torch import nn

from lit_parallel.commands.advise.report import (
    MEMORY_TARGET,
    TIME_TARGET,
    Prediction,
    predict,
    timing_unit,
)
from lit_parallel.formatting import format_bytes
from lit_parallel.measure.live_memory import CATEGORIES
from lit_parallel.measure.mem_tracker import SAME_AS_LIVE_MEMORY
from lit_parallel.planner.model_summary import meta_model, shaped_input
from lit_parallel.planner.time.calibration import StrategyCost, fit_costs, fit_pipeline_cost
from lit_parallel.planner.time.step import PartsTimer, StepTime


def error_rows(
    strategy: str,
    predicted: Any,
    measured: Any,
    step_pred: dict[str, float | None],
    step_meas: float,
    rounds: list[tuple[float, float]] | None = None,
    by_torch: dict[str, int] | None = None,
) -> list[dict]:
    """One row per figure: predicted, measured, relative error, within target; ``step_pred`` is
    :meth:`Prediction.step_s`'s split (the step row keeps it as ``parts``). ``rounds``: each round's
    predicted and measured step seconds (:func:`paired_step`): with more than one, they give the step row's
    figures. ``by_torch``: torch's MemTracker's peak of the measured step
    (:func:`~lit_parallel.measure.mem_tracker.stop_mem_tracker`), or ``None``: each peak row has its figure that
    counts the same bytes (``mem_tracker``, else ``None``) and ``mem_tracker_difference``, measured /
    MemTracker - 1."""
    rows = []
    for cat in (*CATEGORIES, "total"):
        pv = predicted.total if cat == "total" else getattr(predicted, cat)
        mv = measured.total if cat == "total" else measured.by_category.get(cat, 0)
        err = abs(pv - mv) / mv if mv else (0.0 if pv == 0 else None)
        tv = by_torch[SAME_AS_LIVE_MEMORY[cat]] if by_torch and cat in SAME_AS_LIVE_MEMORY else None
        rows.append(
            {
                "strategy": strategy,
                "figure": f"peak {cat}",
                "predicted": pv,
                "measured": mv,
                "error": err,
                "ok": None if cat != "total" else err is not None and err <= MEMORY_TARGET,
                "mem_tracker": tv,
                "mem_tracker_difference": mv / tv - 1 if tv else None,
            }
        )
    if step_pred["step_s"] is not None:
        if rounds and len(rounds) > 1 and all(p is not None for p, _ in rounds):
            step = paired_step(rounds)
        else:
            step = {
                "predicted": step_pred["step_s"],
                "measured": step_meas,
                "error": abs(step_pred["step_s"] - step_meas) / step_meas,
            }
        rows.append(
            {
                "strategy": strategy,
                "figure": "step time s",
                **step,
                "ok": step["error"] <= TIME_TARGET,
                "parts": step_pred,
            }
        )
    return rows


def paired_step(rounds: list[tuple[float, float]]) -> dict[str, Any]:
    """The step row of several rounds, each a ``(predicted, measured)`` pair of seconds: the prediction made
    from what was timed in a round against the step measured in the same round (this machine's speed drifts
    by tens of percent within seconds; a round's parts and steps see the same drift). ``predicted`` and
    ``measured``: the medians over the rounds; ``error``: the relative error of the median round (the median
    of ``predicted / measured``, less 1, as a magnitude); ``round_errors``: every round's signed error."""
    import statistics

    signed = [p / m - 1 for p, m in rounds]
    return {
        "predicted": statistics.median(p for p, _ in rounds),
        "measured": statistics.median(m for _, m in rounds),
        "error": abs(statistics.median(signed)),
        "round_errors": signed,
    }


def launch_costs(res: dict[str, Any], ranks: int) -> dict[str, StrategyCost]:
    """What each strategy added to a step in the launch ``res`` (:func:`~lit_parallel.commands.advise.measure.launch`
    of ``ranks`` ranks): fitted from its calibration shapes against the same shapes in one process, timed in
    the launch; the costs timed between the strategy's own steps (``tp_dp``'s per all-reduce, FSDP's fixed
    and per group; :mod:`~lit_parallel.commands.advise.cost_timers`) as timed there, where they were."""
    one_cal = res["alone"]["one_process"]
    costs = fit_costs(one_cal, {k: v for k, v in res["calibration"].items() if k != "pp_dp"})
    if "pp_dp" in res["calibration"]:
        costs["pp_dp"] = fit_pipeline_cost(one_cal, res["calibration"]["pp_dp"], ranks)
    for name, cost in costs.items():
        timed = res.get(name, {}).get("timed_costs")
        if timed:
            costs[name] = replace(cost, **timed)
    return costs


def verify(path: str, kwargs: dict[str, Any], args: Any, console: Any) -> tuple[list[dict], dict[str, Any]]:
    """Measure one process (and a launch of ``args.verify_ranks`` ranks) and compare with the prediction.
    Returns the rows and what the launch measured of the cluster (bus bandwidth, latency, strategy costs)."""
    from lit_parallel.commands.advise.measure import launch
    from lit_parallel.parallel.example_inputs import meta_example_input, real_inputs, vocabulary
    from lit_parallel.planner.model_summary import load_model_class

    factory = load_model_class(path)
    torch.manual_seed(0)
    model = factory(**kwargs)
    given = shaped_input(args.input_shape)
    ex = meta_example_input(
        model,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        given=given(args.batch_size or 1) if given else None,
    )
    one = predict(
        path,
        kwargs,
        precision="32-true",
        devices=1,
        nodes=1,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        device_type="cpu",
        step_time=False,
        busbw_gbps=None,
        input_shape=args.input_shape,
    )
    _, module, _, largest = meta_model(path, kwargs)
    unit = timing_unit(one, module, largest)
    timer = None
    if unit is not None:
        timer = PartsTimer(
            module,
            block_name=unit.block,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            example_inputs=given,
        )
    peak, by_torch, step_s, pairs = _one_process_rounds(
        one, model, real_inputs(ex.args, vocabulary(model)), timer
    )
    cluster: dict[str, Any] = {}
    rows = error_rows(
        "one_process",
        one.report.peaks["one_process"],
        peak,
        one.step_s("one_process"),
        step_s,
        pairs,
        by_torch,
    )
    if args.verify_ranks > 1:
        res = launch(
            path,
            json.dumps(kwargs) if kwargs else None,
            ranks=args.verify_ranks,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            grad_bytes=one.report.shape.trainable * 4,
            input_shape=args.input_shape,
            timing_unit=None if unit is None else (unit.block or ""),
        )
        launched, cluster = launch_rows(path, kwargs, args, res, console)
        rows += launched
    return rows, cluster


def launch_rows(
    path: str, kwargs: dict[str, Any], args: Any, res: dict[str, Any], console: Any
) -> tuple[list[dict], dict[str, Any]]:
    """The rows of a launch's strategies (``res``, :func:`~lit_parallel.commands.advise.measure.launch` of
    ``args.verify_ranks`` ranks): predicted with what the launch measured of the machine, against what it
    measured of each strategy, the step time round by round (:func:`paired_step`); and what it measured of
    the cluster."""
    from lit_parallel.commands.advise.measure import combine_rounds, hybrid_layout, peak_from

    n = args.verify_ranks
    shard, replicas = hybrid_layout(n)  # hsdp runs as two replicas: that many nodes of shard ranks each
    preds = {}
    for name, devices, nodes in (("multi", n, 1), ("hsdp", shard, replicas)):
        preds[name] = predict(
            path,
            kwargs,
            precision="32-true",
            devices=devices,
            nodes=nodes,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            device_type="cpu",
            step_time=False,
            busbw_gbps=res["busbw_gbps"],
            latency_s=res["latency_s"],
            input_shape=args.input_shape,
        )
    measured = {}  # what the launch measured of each strategy it predicts
    for strategy, got in res.items():
        if strategy in ("busbw_gbps", "latency_s", "calibration", "alone", "rounds"):
            continue
        if "error" in got:
            console.print(f"[yellow]note[/yellow]: {strategy} not measured: {escape(got['error'])}")
        elif strategy in preds["multi"].report.peaks:  # pp_dp may not be: the notes say why
            measured[strategy] = got
    costs = launch_costs(res, n)
    whole = _predicted_steps(res, list(measured), preds, costs)
    rounds = [combine_rounds([r], [s for s in measured if s in r]) for r in res.get("rounds", [])]
    by_round = [(_predicted_steps(r, list(measured), preds, launch_costs(r, n)), r) for r in rounds]
    rows: list[dict] = []
    for strategy, got in measured.items():
        label = f"hsdp {replicas}x{shard}" if strategy == "hsdp" else f"{strategy} x{n}"
        peak = preds.get(strategy, preds["multi"]).report.peaks[strategy]
        pairs = [(s[strategy]["step_s"], r[strategy]["step_s"]) for s, r in by_round if strategy in s]
        ranks = [peak_from(d) for d in got["peaks"]]
        largest = max(range(len(ranks)), key=lambda i: ranks[i].total)  # the rank the row reports
        by_torch = (got.get("mem_tracker_peaks") or [None] * len(ranks))[largest]  # its step, torch's count
        rows += error_rows(label, peak, ranks[largest], whole[strategy], got["step_s"], pairs, by_torch)
    cluster = {
        "ranks": n,
        "busbw_gbps": res["busbw_gbps"],
        "latency_s": res["latency_s"],
        "strategy_costs": {k: c.as_dict() for k, c in costs.items()},
    }
    return rows, cluster


def _predicted_steps(
    figures: dict[str, Any],
    strategies: list[str],
    preds: dict[str, Prediction],
    costs: dict[str, StrategyCost],
) -> dict[str, dict[str, float | None]]:
    """Each of ``strategies``' predicted step (:meth:`Prediction.step_s`'s split) from ``figures``, a
    launch's or one round's: Lightning's overhead and the calibration shapes in one process as timed in the
    launch (every rank at once: the ranks' own speed on this machine), and each strategy's compute and
    AdamW timed between its own steps (its ``timing``). ``preds``: the predictions of the launch's layout
    (``multi``) and of ``hsdp``'s; ``costs``: :func:`launch_costs` of ``figures``."""
    out = {}
    for strategy in strategies:
        if strategy in figures:
            timing = figures[strategy].get("timing")
            pred = replace(
                preds.get(strategy, preds["multi"]),
                overhead_s=figures["alone"]["overhead_s"],
                costs=costs,
                timing=StepTime(**timing) if timing else None,
            )
            out[strategy] = pred.step_s(strategy)
    return out


def _one_process_rounds(one: Prediction, model: nn.Module, inputs: tuple, timer: PartsTimer | None):
    """The one-process step measured in rounds, each after timing Lightning's overhead, with ``timer``
    timing the prediction's parts between the measured steps: this machine's speed drifts by tens of percent
    within a second, so the prediction and the measurement see it at the same moments. Writes the medians
    of the parts over the rounds into ``one``; returns the first round's peak, the median step seconds and
    each round's ``(predicted, measured)`` step seconds (:func:`paired_step`; empty without ``timer``). The
    first round's step is counted by torch's MemTracker too: its peak is returned after LiveMemory's
    (``None`` where torch has no MemTracker)."""
    import statistics

    from lit_parallel.commands.advise.measure import (
        ROUNDS,
        lightning_overhead,
        measure_step,
        measure_step_with_mem_tracker,
        parts_timing,
    )
    from lit_parallel.planner.time.step import median_timing

    peak, by_torch, steps, timings, overheads = None, None, [], [], []
    for _ in range(ROUNDS if timer is not None else 1):
        overheads.append(lightning_overhead())
        between = timer.sample if timer else None
        if peak is None:
            peak, by_torch, step_s = measure_step_with_mem_tracker(model, inputs, between=between)
        else:
            _, step_s = measure_step(model, inputs, between=between)
        steps.append(step_s)
        timings.append(parts_timing(timer))
    if timer is None:
        return peak, by_torch, statistics.median(steps), []
    pairs = [
        (replace(one, timing=StepTime(**t), overhead_s=o).step_s("one_process")["step_s"], m)
        for t, o, m in zip(timings, overheads, steps, strict=True)
    ]
    one.timing = median_timing([StepTime(**t) for t in timings])
    one.overhead_s = statistics.median(overheads)
    return peak, by_torch, statistics.median(steps), pairs


# why a strategy's peak has no MemTracker figure beside it
PIPELINE_UNTRACKED = (
    "torch's MemTracker refuses a module that runs more than once in a step, as a pipeline stage does once per"
    " micro-batch"
)
NO_MEM_TRACKER = "this torch has no MemTracker"
MEM_TRACKER_FAILED = "torch's MemTracker failed in the measured step (a WARNING above says why)"


def print_verification(rows: list[dict], console: Any) -> None:
    from lit_parallel._compat import has_feature
    from lit_parallel.commands.terminal import Column, fit_table

    columns = [
        Column("strategy"),
        Column("figure", wrap=True),
        *(Column(h, "right") for h in ("predicted", "measured", "error", "within target")),
        *(Column(h, "right", wrap=True) for h in ("MemTracker", "measured vs MemTracker")),
        Column("each round's error", "right", wrap=True),
    ]
    cells = []
    for row in rows:
        fmt = (
            (lambda v: f"{v * 1e3:.1f} ms")
            if row["figure"].startswith("step")
            else (lambda v: format_bytes(v, decimal=True))
        )
        err = "-" if row["error"] is None else f"{row['error']:.1%}"
        ok = {True: "[green]yes[/green]", False: "[red]no[/red]", None: ""}[row["ok"]]
        each = " ".join(f"{e:+.0%}" for e in row.get("round_errors", []))
        by_torch = "-" if row.get("mem_tracker") is None else fmt(row["mem_tracker"])
        diff = row.get("mem_tracker_difference")
        cells.append(
            [
                row["strategy"],
                row["figure"],
                fmt(row["predicted"]),
                fmt(row["measured"]),
                err,
                ok,
                by_torch,
                "-" if diff is None else f"{diff:+.1%}",
                each,
            ]
        )
    title = (
        f"predicted vs measured on this machine (targets: peak within {MEMORY_TARGET:.0%}, "
        f"step time within {TIME_TARGET:.0%})"
    )
    console.print(fit_table(columns, cells, width=console.width, title=title))
    console.print(
        "measured: lit_parallel's count of live tensor storages (LiveMemory); MemTracker: torch's own count of"
        " the same step (torch.distributed._tools.mem_tracker), shown for the total, parameters and gradients:"
        " Lightning runs forward and backward inside optimizer.step, whose allocations torch files as"
        " optimizer state"
    )
    untracked = [r["strategy"] for r in rows if r["figure"] == "peak total" and r.get("mem_tracker") is None]
    if untracked and not has_feature("mem_tracker"):
        console.print(f"[yellow]note[/yellow]: no MemTracker figures: {NO_MEM_TRACKER}")
        return
    for strategy in untracked:
        why = PIPELINE_UNTRACKED if strategy.startswith("pp_dp") else MEM_TRACKER_FAILED
        console.print(f"[yellow]note[/yellow]: {escape(strategy)}: no MemTracker figure: {why}")


def print_cluster(cluster: dict[str, Any], console: Any) -> None:
    """One line on what the verifying launch measured of this machine's collectives and strategies."""
    costs = "; ".join(
        f"{name} {c['slot_s'] * 1e3:.2f} ms + {c['group_s'] * 1e3:.2f} ms per stage FSDP group"
        f" + {c['tensor_s'] * 1e6:.0f} us per stage parameter tensor"
        f" + {c['byte_s'] * 1e9:.2f} ms per MB of the stage's parameters, per pipeline slot"
        if name == "pp_dp"
        else f"{name} {c['fixed_s'] * 1e3:.2f} ms + {c['group_s'] * 1e3:.2f} ms per FSDP group"
        f" + {c['tensor_s'] * 1e6:.0f} us per parameter tensor + {c['byte_s'] * 1e9:.2f} ms per MB of parameters"
        + (f" + {c['buffers_s'] * 1e3:.2f} ms with buffers" if c.get("buffers_s") else "")
        for name, c in cluster["strategy_costs"].items()
    )
    console.print(
        f"measured on {cluster['ranks']} ranks: all-reduce {cluster['busbw_gbps']:.3g} GB/s bus bandwidth,"
        f" {cluster['latency_s'] * 1e6:.0f} us latency; what each strategy adds to a step: {costs}"
    )
