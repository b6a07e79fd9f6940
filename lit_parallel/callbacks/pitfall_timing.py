"""Step timing behind :class:`~lit_parallel.callbacks.PitfallReport`: data waits, exposed communication,
stragglers and throughput.

:class:`StepTimer` measures on each rank during the epoch; :meth:`StepTimer.summary` condenses it into
numbers that are gathered from every rank, and the ``judge_*`` functions decide from the gathered
numbers, identically on every rank.
"""

from __future__ import annotations

import statistics
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch.utilities.data import extract_batch_size

from lit_parallel._compat import ddp_logging_data
from lit_parallel.callbacks.patching import patch_attribute
from lit_parallel.callbacks.pitfall_checks import Finding
from lit_parallel.measure.collective_waits import CollectiveWaitTimer, transfer_waits

# the profiler action around each fetch of a training batch
_FETCH_ACTION = "train_dataloader_next"


@dataclass
class StepTimes:
    """This rank's timings since the epoch started."""

    step_starts: list[float] = field(default_factory=list)
    fetch: list[float] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    ddp_compute: list[float] = field(default_factory=list)
    ddp_exposed_comm: list[float] = field(default_factory=list)


class StepTimer:
    """Times every training step on this rank: batch fetch, collective waits, DDP's own timings.

    Fetch times come from the trainer's profiler (its ``start``/``stop`` around fetching the next
    batch, shadowed on that profiler for the run), collective waits from :class:`CollectiveWaitTimer`,
    and DDP's gradient all-reduces, which run in C++ out of that timer's sight, from DDP's reducer.
    """

    def __init__(self) -> None:
        self.times = StepTimes()
        self._waits: CollectiveWaitTimer | None = None
        self._fetch_started: float | None = None
        self._undo_profiler: list[Callable[[], None]] = []
        self._ddp_iteration: int | None = None
        self._ddp_seen: Any = None

    def install(self, trainer: Any) -> None:
        self._waits = CollectiveWaitTimer(trainer.strategy.root_device).install()
        profiler = trainer.profiler
        if "start" in vars(profiler):  # another PitfallReport times the fetches already
            return
        start, stop = profiler.start, profiler.stop

        def timed_start(action_name: str) -> None:
            if action_name.endswith(_FETCH_ACTION):
                self._fetch_started = time.perf_counter()
            start(action_name)

        def timed_stop(action_name: str) -> None:
            stop(action_name)
            if action_name.endswith(_FETCH_ACTION) and self._fetch_started is not None:
                self.times.fetch.append(time.perf_counter() - self._fetch_started)
                self._fetch_started = None

        self._undo_profiler = [
            patch_attribute(profiler, "start", timed_start),
            patch_attribute(profiler, "stop", timed_stop),
        ]

    def uninstall(self) -> None:
        self._ddp_seen = None
        if self._waits is not None:
            self._waits.uninstall()
            self._waits = None
        for undo in self._undo_profiler:
            undo()
        self._undo_profiler = []

    def start_epoch(self) -> None:
        self.times = StepTimes()
        if self._waits is not None:
            self._waits.clear()

    def start_step(self, batch: Any) -> None:
        times = self.times
        times.step_starts.append(time.perf_counter())
        try:
            times.samples.append(int(extract_batch_size(batch)))
        except Exception:  # a batch Lightning cannot size: throughput stays unknown
            times.samples.append(0)
        if self._waits is not None:  # last: the window holds the step alone
            self._waits.open()

    def end_step(self, trainer: Any) -> None:
        if self._waits is not None:  # first: later checks run collectives of their own
            self._waits.close()
        self._read_ddp_timings(trainer)

    def _read_ddp_timings(self, trainer: Any) -> None:
        ddp = _ddp_module(trainer)
        if ddp is None:
            return
        if self._ddp_seen is None or self._ddp_seen() is not ddp:
            # DDP samples its timings at a few early iterations, then every 100th: ask for every one on
            # CPU, every 10th on GPUs (reading CUDA timers waits for the previous backward's events).
            # A weak reference: the DDP wrapper (and its reducer) must die with the strategy's teardown.
            on_cpu = all(p.device.type == "cpu" for p in ddp.parameters())
            data = ddp_logging_data(ddp, sample_rate=1 if on_cpu else 10)
            self._ddp_seen = weakref.ref(ddp)
        else:
            data = ddp_logging_data(ddp)
        iteration = data.get("iteration")
        if iteration is None or iteration == self._ddp_iteration or "backward_comm_time" not in data:
            return
        self._ddp_iteration = iteration
        ns = 1e-9
        compute = (data.get("forward_compute_time", 0) + data.get("backward_compute_time", 0)) * ns
        exposed = max(0, data["backward_comm_time"] - data.get("backward_compute_comm_overlap_time", 0)) * ns
        self.times.ddp_compute.append(compute)
        self.times.ddp_exposed_comm.append(exposed)

    def summary(self) -> dict[str, Any]:
        """This rank's timings as plain numbers, to be gathered from every rank."""
        t = self.times
        intervals = [b - a for a, b in zip(t.step_starts, t.step_starts[1:])]
        # the first interval includes the epoch's first fetch (worker start-up): leave it out
        fetch = t.fetch[1 : 1 + len(intervals)]
        # the first steps include one-time work (FSDP's lazy init, DDP's probe, compilation): skip them
        windows = self._waits.windows() if self._waits is not None else []
        windows = windows[min(2, len(windows) - 1) :] if windows else []
        return {
            "ddp_exposed": statistics.median(t.ddp_exposed_comm) if t.ddp_exposed_comm else None,
            "waited": statistics.median([w.waited for w in windows]) if windows else None,
            "recent_windows": windows[-16:],
            "steps": len(t.step_starts),
            "interval": statistics.median(intervals) if intervals else None,
            "interval_total": sum(intervals),
            "fetch_total": sum(fetch),
            "samples": sum(t.samples[: len(intervals)]),
            "batch": t.samples[0] if t.samples else None,
            "compute_steps": statistics.median([w.compute for w in windows]) if windows else None,
            "compute_ddp": statistics.median(t.ddp_compute) if t.ddp_compute else None,
        }


def judge_data(ranks: list[dict], limit: float) -> Finding:
    """Share of step time each rank waits for its next batch, against ``limit``."""
    check = "data loading"
    shares = [(r["rank"], r["fetch_total"] / r["interval_total"]) for r in ranks if r["interval_total"] > 0]
    if not shares:
        return Finding(check, "n/a", "fewer than two steps measured")
    worst_rank, worst = max(shares, key=lambda s: s[1])
    text = (
        "waiting for the next batch: " + ", ".join(f"rank {r} {s:.0%}" for r, s in shares) + " of step time"
    )
    if worst > limit:
        return Finding(
            check,
            "problem",
            f"{text} (rank {worst_rank} above {limit:.0%}): the devices wait for the input pipeline.",
            "raise DataLoader(num_workers=...) (with persistent_workers=True, pin_memory=True), move"
            " decoding/augmentation off the training process, or cache preprocessed data.",
        )
    return Finding(check, "ok", text + ".")


def _share(share: float, limit: float) -> str:
    """``share`` in whole percent, with as many decimals as it takes not to read as ``limit`` (10.4 % is
    above a limit of 10 %; "10%" would not say so)."""
    for digits in range(4):
        text = f"{share:.{digits}%}"
        if share == limit or text != f"{limit:.{digits}%}":
            return text
    return text


def judge_comm(ranks: list[dict], limit: float, strategy: Any) -> Finding:
    """Share of step time the transfers themselves take (skew between ranks left out), against ``limit``."""
    check = "exposed communication"
    # each rank's own view: DDP's reducer waits plus every other collective the step waited on
    shares = [
        (r["rank"], ((r["ddp_exposed"] or 0.0) + (r["waited"] or 0.0)) / r["interval"])
        for r in ranks
        if (r["ddp_exposed"] is not None or r["waited"] is not None) and r["interval"]
    ]
    if not shares:
        return Finding(check, "n/a", "fewer than two steps measured")
    # A rank that reaches a collective first waits for the others as well as for the transfer; the
    # rank that arrives last waits for the transfer alone. Collective by collective (wait timer), or
    # rank by rank (DDP's reducer gives one total per step), the smallest wait is the communication
    # itself; the rest is skew between ranks.
    ddp = [r["ddp_exposed"] for r in ranks]
    itself = min(ddp) if all(v is not None for v in ddp) else 0.0
    transfers = transfer_waits([r["recent_windows"] for r in ranks])
    if transfers:
        itself += statistics.median(transfers)
    elif all(r["waited"] is not None for r in ranks):
        itself += min(r["waited"] for r in ranks)
    share = itself / statistics.median([r["interval"] for r in ranks if r["interval"]])
    text = (
        "compute waits on collectives for "
        + ", ".join(f"rank {r} {s:.0%}" for r, s in shares)
        + f" of step time; the transfers themselves (the wait of the last rank to arrive) {_share(share, limit)}"
    )
    if max(s for _, s in shares) > 2 * share + 0.05:
        text += " (the rest: ranks waiting for slower ranks, see stragglers)"
    if share > limit:
        return Finding(
            check,
            "problem",
            f"{text}, above {limit:.0%}: the collectives are not hidden behind compute.",
            _comm_fix(strategy),
        )
    return Finding(check, "ok", text + ".")


def judge_stragglers(ranks: list[dict], limit: float) -> Finding:
    """A rank whose own compute per step exceeds the median of the others by the factor ``limit``."""
    check = "stragglers"
    # DDP's all-reduces run in C++, out of the wait timer's sight: its reducer times compute itself
    source = "compute_ddp" if all(r["compute_ddp"] is not None for r in ranks) else "compute_steps"
    values = [(r["rank"], r[source]) for r in ranks if r[source] is not None]
    if len(values) < 2:
        return Finding(check, "n/a", "needs two ranks with measured steps")
    text = "own compute per step (collective waits excluded): " + ", ".join(
        f"rank {r} {v * 1e3:.1f} ms" for r, v in values
    )
    slow_rank, slow = max(values, key=lambda v: v[1])
    others = statistics.median([v for r, v in values if r != slow_rank])
    if others > 0 and slow / others > limit:
        return Finding(
            check,
            "problem",
            f"{text}: rank {slow_rank} is {slow / others:.1f}x slower than the median of the others, and every"
            " rank waits for it at each synchronization.",
            f"find what differs on rank {slow_rank}: its device (clocks, thermal throttling, a shared or"
            " slower GPU), other processes on its host, or rank-dependent work in the step (logging,"
            " checkpointing, uneven sequence lengths).",
        )
    return Finding(check, "ok", text + ".")


def judge_throughput(ranks: list[dict]) -> Finding:
    """Samples per second per rank and in total."""
    per_rank = [(r["rank"], r["samples"] / r["interval_total"]) for r in ranks if r["interval_total"] > 0]
    if not per_rank:
        return Finding("throughput", "n/a", "fewer than two steps measured")
    total = sum(v for _, v in per_rank)
    text = ", ".join(f"rank {r} {v:.1f}" for r, v in per_rank)
    return Finding("throughput", "info", f"samples/s: {text}; total {total:.1f}.")


def _comm_fix(strategy: Any) -> str:
    """What to change when communication is exposed, for the strategy in use."""
    kinds = {cls.__name__ for cls in type(strategy).__mro__}
    common = "raise the per-rank batch (more compute per byte communicated)"
    if "TensorParallelStrategy" in kinds or kinds & {"ModelParallelStrategy", "TransformerFSDPStrategy"} == {
        "ModelParallelStrategy"
    }:
        return (
            f"{common}, and keep each tensor-parallel group inside one node (fast links) or make it smaller"
            " (TensorParallelStrategy(tensor_parallel_size=...)): it communicates in every block."
        )
    if "TransformerFSDPStrategy" in kinds or "FSDPStrategy" in kinds:
        return (
            f"{common} or accumulate gradients; shard within a node and replicate across nodes"
            " (HybridShardStrategy, 'hsdp');"
            " keep parameters gathered between forward and backward (reshard_after_forward=False, one"
            " all-gather fewer per block); wrap larger blocks so fewer, larger collectives run."
        )
    return (
        f"{common}, accumulate gradients (Trainer(accumulate_grad_batches=...)), compress gradients"
        " (ddp_tuned with comm_hook='bf16'/'powersgd'), or let ddp_tuned size the buckets (bucket_cap_mb='auto')."
    )


def _ddp_module(trainer: Any) -> Any:
    model = getattr(trainer.strategy, "model", None)
    return model if isinstance(model, torch.nn.parallel.DistributedDataParallel) else None
