"""The rounds of an ``advise --verify`` launch made into one set of figures: the parts each rank timed
between a strategy's steps (at the slowest rank's pace) and the medians over the rounds."""

from __future__ import annotations

import statistics
from typing import Any


def parts_timing(timer: Any) -> dict[str, Any] | None:
    """What ``timer`` sampled between a run's steps, as a :class:`StepTime` dict (``None`` without a timer
    or samples); the samples are dropped, so the next run starts afresh."""
    from dataclasses import asdict

    if timer is None or not timer.samples:
        return None
    return asdict(timer.timing())


def slowest_rank_timing(timer: Any) -> dict[str, Any] | None:
    """:func:`parts_timing` as the slowest rank saw it; call in every rank. A step that synchronises its
    ranks (every collective) goes at the pace of the slowest: every rank took its samples between the same
    two steps, so each sample becomes its largest over the ranks."""
    import torch.distributed as dist

    if timer is None:
        return None
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, timer.samples)
    timer.samples = [
        [max(parts) for parts in zip(*same, strict=True)] for same in zip(*gathered, strict=True)
    ]
    return parts_timing(timer)


def combine_rounds(rounds: list[dict[str, Any]], plain: list[str]) -> dict[str, Any]:
    """The rounds' figures as one: medians of the seconds, of the parts' timings and of the costs timed
    between the steps; the peaks of the first round (memory does not drift)."""
    med = statistics.median
    alone = [r["alone"] for r in rounds]
    out: dict[str, Any] = {"alone": {
        "overhead_s": med(a["overhead_s"] for a in alone),
        "one_process": {k: med(a["one_process"][k] for a in alone) for k in alone[0]["one_process"]},
    }, "calibration": {}}  # fmt: skip
    for name in plain:
        got = [r[name] for r in rounds if name in r]
        failed = [g for g in got if "error" in g]
        if failed:  # in any round (the later rounds skip it): the strategy is reported as failed
            out[name] = failed[0]
            continue
        out[name] = {"peaks": got[0]["peaks"], "step_s": med(g["step_s"] for g in got),
                     "timing": median_timing_dict([g.get("timing") for g in got])}  # fmt: skip
        timed = [g.get("timed_costs") or {} for g in got]  # costs timed between its steps
        keys = {k for t in timed for k, v in t.items() if v is not None}
        if keys:
            out[name]["timed_costs"] = {k: med(t[k] for t in timed if t.get(k) is not None) for k in keys}
        cal = [r[f"calibration.{name}"] for r in rounds if f"calibration.{name}" in r]
        out["calibration"][name] = {k: med(c[k] for c in cal) for k in cal[0]}
    return out


def median_timing_dict(timings: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Several rounds' parts timings (:class:`StepTime` dicts) as one, the median of each rate."""
    from dataclasses import asdict

    from lit_parallel.parallel.step_time import StepTime, median_timing

    got = [StepTime(**t) for t in timings if t]
    return asdict(median_timing(got)) if got else None
