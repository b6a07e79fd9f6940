"""PitfallReport: watch a run and report the multi-device mistakes the field knows best, with evidence.

Checks, each measured on every rank of the data-parallel group and decided from the gathered numbers:

- parameters or buffers diverging across ranks (checksums compared every ``check_every_n_steps``);
- learning rate not scaled for the global batch (linear rule for SGD-like optimizers, square root for
  Adam-like ones, warm-up for large scale factors), against a declared base learning rate and batch;
- data loading as the bottleneck (share of step time spent waiting for the next batch, per rank);
- communication share of step time: the time compute waits on collectives (exposed communication:
  DDP's reducer timings for its gradient all-reduces, and :class:`CollectiveWaitTimer` for every other
  collective the step waits on — FSDP2's all-gathers and reduce-scatters, DTensor redistributions,
  ``sync_dist`` logging), above ``comm_share_limit``;
- stragglers: a rank consistently slower in its own compute (step time less collective waits), and
  throughput in samples/s per rank and in total;
- identical random augmentation across ranks (same random state on every rank while the dataset draws
  random numbers), silent when ``seed_everything(workers=True)`` gives workers distinct seeds.
"""

from __future__ import annotations

import statistics
import textwrap
import time
import weakref
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import torch
from lightning.pytorch import Callback
from lightning.pytorch.utilities.data import extract_batch_size
from torch.utils.data import DataLoader

from lit_parallel.callbacks.data_parallel import (
    DataParallelGroup,
    all_gather_object,
    check_mode,
    data_parallel_group,
    report,
)
from lit_parallel.callbacks.pitfall_checks import (
    _draws_random_numbers,
    _rng_fingerprint,
    _scheduled_peaks,
    learning_rate_rule,
    scaled_learning_rate,
    tensors_diverging,
)
from lit_parallel.parallel.waits import CollectiveWaitTimer, transfer_waits


@dataclass
class Finding:
    """One row of the report."""

    check: str
    status: Literal["ok", "problem", "info", "n/a"]
    evidence: str
    fix: str = ""

    def message(self) -> str:
        return f"PitfallReport: {self.check}: {self.evidence}" + (f" Fix: {self.fix}" if self.fix else "")


@dataclass
class _EpochTimes:
    """This rank's measurements since the last report."""

    step_starts: list[float] = field(default_factory=list)
    fetch: list[float] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    ddp_compute: list[float] = field(default_factory=list)
    ddp_exposed_comm: list[float] = field(default_factory=list)
    diverged: dict[str, float] = field(default_factory=dict)
    divergence_checks: int = 0
    first_lr: float | None = None
    peak_lr: float = 0.0


class PitfallReport(Callback):
    """Watches a run and reports, at the end of each training epoch and on demand, the known pitfalls.

    Each check is measured on every rank, gathered, and judged identically on every rank; the table is
    printed on global rank 0 with the evidence and the fix of each problem. A problem found for the
    first time is also a :class:`~lit_parallel.callbacks.ParallelTrainingWarning` on rank 0
    (``mode="warn"``), or stops the run on every rank (``mode="raise"``).

    Args:
        base_lr, base_batch_size: the learning rate you tuned and the batch size you tuned it for; the
            learning-rate check is skipped without them.
        lr_rule: ``"auto"`` (from the optimizer), ``"linear"`` or ``"sqrt"``.
        check_every_n_steps: how often parameters and buffers are compared across ranks.
        data_wait_limit: share of step time waiting for data above which loading is the bottleneck.
        comm_share_limit: share of step time waiting on communication above which it is reported.
        straggler_limit: a rank whose own compute per step exceeds the median of the others by this
            factor is a straggler.
        warmup_from_scale: learning-rate scale factor from which a warm-up is expected.
        probe_augmentation: read ``dataset[0]`` twice (random state restored) to learn whether the
            dataset draws random numbers.
        print_table: print the table on rank 0 at the end of each epoch.
    """

    def __init__(
        self,
        *,
        base_lr: float | None = None,
        base_batch_size: int | None = None,
        lr_rule: Literal["auto", "linear", "sqrt"] = "auto",
        check_every_n_steps: int = 50,
        data_wait_limit: float = 0.1,
        comm_share_limit: float = 0.2,
        straggler_limit: float = 1.25,
        warmup_from_scale: float = 4.0,
        probe_augmentation: bool = True,
        print_table: bool = True,
        mode: Literal["warn", "raise"] = "warn",
    ) -> None:
        if (base_lr is None) != (base_batch_size is None):
            raise ValueError(
                f"PitfallReport(base_lr={base_lr}, base_batch_size={base_batch_size}): give both (the learning"
                " rate you tuned and the batch size you tuned it for) or neither"
            )
        if lr_rule not in ("auto", "linear", "sqrt"):
            raise ValueError(f"PitfallReport(lr_rule={lr_rule!r}): use 'auto', 'linear' or 'sqrt'")
        if check_every_n_steps < 1:
            raise ValueError(f"PitfallReport(check_every_n_steps={check_every_n_steps}) must be at least 1")
        self.base_lr = base_lr
        self.base_batch_size = base_batch_size
        self.lr_rule = lr_rule
        self.check_every_n_steps = check_every_n_steps
        self.data_wait_limit = data_wait_limit
        self.comm_share_limit = comm_share_limit
        self.straggler_limit = straggler_limit
        self.warmup_from_scale = warmup_from_scale
        self.probe_augmentation = probe_augmentation
        self.print_table = print_table
        self.mode = check_mode(mode, "PitfallReport")
        self.findings: list[Finding] = []
        self._times = _EpochTimes()
        self._dp: DataParallelGroup | None = None
        self._reported: set[str] = set()
        self._last_table = ""
        self._batches = 0
        self._waits: CollectiveWaitTimer | None = None
        self._fetch_started: float | None = None
        self._ddp_iteration: int | None = None
        self._ddp_seen: Any = None
        self._augmentation: dict[str, Any] = {}
        self._profiler: Any = None
        self._epoch = 0

    # ----------------------------------------------------------------------------------------- hooks
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        self._waits = CollectiveWaitTimer(trainer.strategy.root_device).install()
        profiler = trainer.profiler
        if "start" not in profiler.__dict__:
            start, stop = profiler.start, profiler.stop

            def timed_start(action_name: str) -> None:
                if action_name.endswith("train_dataloader_next"):
                    self._fetch_started = time.perf_counter()
                start(action_name)

            def timed_stop(action_name: str) -> None:
                stop(action_name)
                if action_name.endswith("train_dataloader_next") and self._fetch_started is not None:
                    self._times.fetch.append(time.perf_counter() - self._fetch_started)
                    self._fetch_started = None

            profiler.start, profiler.stop = timed_start, timed_stop
            self._profiler = profiler

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._ddp_seen = None
        if self._waits is not None:
            self._waits.uninstall()
            self._waits = None
        if self._profiler is not None:
            self._profiler.__dict__.pop("start", None)
            self._profiler.__dict__.pop("stop", None)
            self._profiler = None

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, "fit")

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._dp = data_parallel_group(trainer.strategy)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._times = _EpochTimes()
        self._epoch = trainer.current_epoch
        self._augmentation = self._augmentation_state(trainer)
        if self._waits is not None:
            self._waits.clear()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        now = time.perf_counter()
        times = self._times
        times.step_starts.append(now)
        try:
            times.samples.append(int(extract_batch_size(batch)))
        except Exception:  # a batch Lightning cannot size: throughput stays unknown
            times.samples.append(0)
        if trainer.optimizers:
            lr = float(trainer.optimizers[0].param_groups[0]["lr"])
            if times.first_lr is None:
                times.first_lr = lr
            times.peak_lr = max(times.peak_lr, lr)
        if self._waits is not None:  # last: the window holds the step alone
            self._waits.open()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._waits is not None:  # first: the checks below run collectives of their own
            self._waits.close()
        self._batches += 1
        self._read_ddp_timings(trainer)
        if self._batches % self.check_every_n_steps == 0:
            self._check_divergence(trainer, pl_module)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._check_divergence(trainer, pl_module)
        self.check(trainer)

    # ----------------------------------------------------------------------------------- measurement
    def _read_ddp_timings(self, trainer: Any) -> None:
        ddp = _ddp_module(trainer)
        if ddp is None:
            return
        if self._ddp_seen is None or self._ddp_seen() is not ddp:
            # DDP samples its timings at a few early iterations, then every 100th: ask for every one on
            # CPU, every 10th on GPUs (reading CUDA timers waits for the previous backward's events).
            # A weak reference: the DDP wrapper (and its reducer) must die with the strategy's teardown.
            on_cpu = all(p.device.type == "cpu" for p in ddp.parameters())
            ddp._set_ddp_runtime_logging_sample_rate(1 if on_cpu else 10)
            self._ddp_seen = weakref.ref(ddp)
        data = ddp._get_ddp_logging_data()
        iteration = data.get("iteration")
        if iteration is None or iteration == self._ddp_iteration or "backward_comm_time" not in data:
            return
        self._ddp_iteration = iteration
        ns = 1e-9
        compute = (data.get("forward_compute_time", 0) + data.get("backward_compute_time", 0)) * ns
        exposed = max(0, data["backward_comm_time"] - data.get("backward_compute_comm_overlap_time", 0)) * ns
        self._times.ddp_compute.append(compute)
        self._times.ddp_exposed_comm.append(exposed)

    def _check_divergence(self, trainer: Any, pl_module: Any) -> None:
        dp = self._dp or data_parallel_group(trainer.strategy)
        if not dp.distributed:
            return
        self._times.divergence_checks += 1
        for name, rel in tensors_diverging(pl_module, dp).items():
            self._times.diverged[name] = max(rel, self._times.diverged.get(name, 0.0))

    def _augmentation_state(self, trainer: Any) -> dict[str, Any]:
        loaders = trainer.train_dataloader
        loader = loaders if isinstance(loaders, DataLoader) else None
        state: dict[str, Any] = {"random": None, "workers": 0, "lightning_seeded": False, "user_init": False}
        if loader is None:
            return state
        state["workers"] = loader.num_workers
        init = loader.worker_init_fn
        state["lightning_seeded"] = (
            isinstance(init, partial) and init.func.__name__ == "pl_worker_init_function"
        )
        state["user_init"] = init is not None and not state["lightning_seeded"]
        if self.probe_augmentation and "random" not in self._augmentation:
            state["random"] = _draws_random_numbers(loader.dataset)
        else:
            state["random"] = self._augmentation.get("random")
        generator = loader.generator
        state["rng"] = _rng_fingerprint(generator)
        return state

    # --------------------------------------------------------------------------------------- judging
    def check(self, trainer: Any) -> list[Finding]:
        """Gather every rank's measurements since the epoch started and judge them (call on every rank)."""
        dp = self._dp or data_parallel_group(trainer.strategy)
        summary = self._summary(trainer)
        ranks = all_gather_object(summary, dp)
        findings = [
            self._judge_divergence(ranks),
            self._judge_lr(trainer, ranks, dp),
            self._judge_data(ranks),
            self._judge_comm(trainer, ranks),
            self._judge_stragglers(ranks),
            self._judge_throughput(ranks),
            self._judge_augmentation(ranks),
        ]
        self.findings = findings
        self._last_table = format_table(findings, epoch=self._epoch, ranks=dp.size, steps=summary["steps"])
        if self.print_table and trainer.is_global_zero:
            print(self._last_table, flush=True)
        problems = [f for f in findings if f.status == "problem"]
        if self.mode == "raise":
            report([f.message() for f in problems], mode="raise", is_global_zero=trainer.is_global_zero)
        fresh = [f for f in problems if f.check not in self._reported]
        self._reported.update(f.check for f in fresh)
        report([f.message() for f in fresh], mode="warn", is_global_zero=trainer.is_global_zero)
        return findings

    def table(self) -> str:
        """The last report, as printed."""
        return self._last_table

    def _summary(self, trainer: Any) -> dict[str, Any]:
        t = self._times
        intervals = [b - a for a, b in zip(t.step_starts, t.step_starts[1:])]
        # the first interval includes the epoch's first fetch (worker start-up): leave it out
        fetch = t.fetch[1 : 1 + len(intervals)]
        # the first steps include one-time work (FSDP's lazy init, DDP's probe, compilation): skip them
        windows = self._waits.windows() if self._waits is not None else []
        windows = windows[min(2, len(windows) - 1) :] if windows else []
        ddp_exposed = statistics.median(t.ddp_exposed_comm) if t.ddp_exposed_comm else None
        waited = statistics.median([w.waited for w in windows]) if windows else None
        return {
            "ddp_exposed": ddp_exposed,
            "waited": waited,
            "recent_windows": windows[-16:],
            "rank": self._dp.rank if self._dp else 0,
            "steps": len(t.step_starts),
            "interval": statistics.median(intervals) if intervals else None,
            "interval_total": sum(intervals),
            "fetch_total": sum(fetch),
            "samples": sum(t.samples[: len(intervals)]),
            "batch": t.samples[0] if t.samples else None,
            "compute_steps": statistics.median([w.compute for w in windows]) if windows else None,
            "compute_ddp": statistics.median(t.ddp_compute) if t.ddp_compute else None,
            "diverged": dict(t.diverged),
            "divergence_checks": t.divergence_checks,
            "first_lr": t.first_lr,
            "peak_lr": max([t.peak_lr] + _scheduled_peaks(trainer)),
            "augmentation": self._augmentation,
        }

    def _judge_divergence(self, ranks: list[dict]) -> Finding:
        check = "parameter/buffer divergence"
        checks = ranks[0]["divergence_checks"]
        if checks == 0:
            return Finding(check, "n/a", "not distributed, or no check ran yet")
        diverged: dict[str, float] = {}
        for r in ranks:
            for name, rel in r["diverged"].items():
                diverged[name] = max(rel, diverged.get(name, 0.0))
        if not diverged:
            return Finding(check, "ok", f"parameters and buffers identical on all ranks ({checks} checks)")
        names = sorted(diverged, key=diverged.get, reverse=True)
        listed = ", ".join(f"{n} (rel. difference {diverged[n]:.2g})" for n in names[:4])
        more = f" and {len(names) - 4} more" if len(names) > 4 else ""
        bn = any(n.endswith(("running_mean", "running_var")) for n in names)
        fix = (
            "BatchNorm running statistics are per-rank: add lit_parallel.SyncBatchNormConversion()."
            if bn
            else "update these tensors only from data all ranks share (all-reduce what one rank computes,"
            " or register it as a parameter so the strategy synchronizes its gradient), and do not edit"
            " parameters on one rank."
        )
        return Finding(check, "problem", f"{len(names)} tensors differ across ranks: {listed}{more}.", fix)

    def _judge_lr(self, trainer: Any, ranks: list[dict], dp: DataParallelGroup) -> Finding:
        check = "learning-rate scaling"
        if self.base_lr is None:
            return Finding(check, "n/a", "declare base_lr and base_batch_size to check it")
        if not trainer.optimizers or ranks[0]["batch"] is None:
            return Finding(check, "n/a", "no optimizer step or batch size seen yet")
        optimizer = trainer.optimizers[0]
        rule = learning_rate_rule(optimizer) if self.lr_rule == "auto" else self.lr_rule
        per_rank = ranks[0]["batch"]
        accumulate = trainer.accumulate_grad_batches
        global_batch = per_rank * dp.size * accumulate
        expected = scaled_learning_rate(self.base_lr, self.base_batch_size, global_batch, rule)
        actual = max(r["peak_lr"] for r in ranks)
        first = ranks[0]["first_lr"]
        k = global_batch / self.base_batch_size
        how = (
            f"{type(optimizer).__name__} peak lr {actual:.4g} with a global batch of {global_batch}"
            f" ({per_rank} per rank x {dp.size} ranks x {accumulate} accumulated); declared base lr"
            f" {self.base_lr:g} for batch {self.base_batch_size}, so the {rule} rule gives {expected:.4g}"
        )
        call = f"lit_parallel.scaled_learning_rate({self.base_lr:g}, {self.base_batch_size}, {global_batch}, rule={rule!r})"
        ratio = actual / expected if expected else float("inf")
        if not 0.8 <= ratio <= 1.25:
            return Finding(
                check,
                "problem",
                f"{how} (actual/expected = {ratio:.2f}).",
                f"lr = {call} = {expected:.4g}"
                + (", with a warm-up over the first steps." if k >= self.warmup_from_scale else "."),
            )
        if k >= self.warmup_from_scale and first is not None and first >= 0.5 * actual:
            return Finding(
                check,
                "problem",
                f"{how}; the scale factor is {k:.0f} but the first step already ran at lr {first:.4g} (no warm-up).",
                "warm up linearly from the base lr to the scaled lr over the first few percent of steps"
                " (torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1/k, total_iters=...)).",
            )
        return Finding(check, "ok", f"{how} (actual/expected = {ratio:.2f}).")

    def _judge_data(self, ranks: list[dict]) -> Finding:
        check = "data loading"
        shares = [
            (r["rank"], r["fetch_total"] / r["interval_total"]) for r in ranks if r["interval_total"] > 0
        ]
        if not shares:
            return Finding(check, "n/a", "fewer than two steps measured")
        worst_rank, worst = max(shares, key=lambda s: s[1])
        text = (
            "waiting for the next batch: "
            + ", ".join(f"rank {r} {s:.0%}" for r, s in shares)
            + " of step time"
        )
        if worst > self.data_wait_limit:
            return Finding(
                check,
                "problem",
                f"{text} (rank {worst_rank} above {self.data_wait_limit:.0%}): the devices wait for the input pipeline.",
                "raise DataLoader(num_workers=...) (with persistent_workers=True, pin_memory=True), move"
                " decoding/augmentation off the training process, or cache preprocessed data.",
            )
        return Finding(check, "ok", text + ".")

    def _judge_comm(self, trainer: Any, ranks: list[dict]) -> Finding:
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
            + f" of step time; the transfers themselves (the wait of the last rank to arrive) {share:.0%}"
        )
        if max(s for _, s in shares) > 2 * share + 0.05:
            text += " (the rest: ranks waiting for slower ranks, see stragglers)"
        if share > self.comm_share_limit:
            return Finding(
                check,
                "problem",
                f"{text}, above {self.comm_share_limit:.0%}: the collectives are not hidden behind compute.",
                _comm_fix(trainer.strategy),
            )
        return Finding(check, "ok", text + ".")

    def _judge_stragglers(self, ranks: list[dict]) -> Finding:
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
        if others > 0 and slow / others > self.straggler_limit:
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

    def _judge_throughput(self, ranks: list[dict]) -> Finding:
        per_rank = [(r["rank"], r["samples"] / r["interval_total"]) for r in ranks if r["interval_total"] > 0]
        if not per_rank:
            return Finding("throughput", "n/a", "fewer than two steps measured")
        total = sum(v for _, v in per_rank)
        text = ", ".join(f"rank {r} {v:.1f}" for r, v in per_rank)
        return Finding("throughput", "info", f"samples/s: {text}; total {total:.1f}.")

    def _judge_augmentation(self, ranks: list[dict]) -> Finding:
        check = "random augmentation"
        states = [r["augmentation"] for r in ranks]
        if not states or not states[0]:
            return Finding(check, "n/a", "no single train DataLoader")
        first = states[0]
        if first.get("random") is None:
            return Finding(check, "n/a", "could not probe the dataset (IterableDataset, or probing off)")
        if not any(s.get("random") for s in states):
            return Finding(check, "ok", "dataset[0] is the same on two reads: no random augmentation.")
        workers = first["workers"]
        if workers > 0 and first["lightning_seeded"]:
            return Finding(
                check, "ok", "seed_everything(workers=True) gives every worker of every rank its own seed."
            )
        if workers > 0 and first["user_init"]:
            return Finding(check, "n/a", "a custom worker_init_fn seeds the workers")
        rng = [s["rng"] for s in states]
        same = [r["rank"] for r in ranks if rng.count(r["augmentation"]["rng"]) > 1]
        where = (
            "in the training process (num_workers=0)" if workers == 0 else f"in {workers} workers per rank"
        )
        if same:
            fix = (
                "seed each rank differently before the epoch, e.g. torch.manual_seed(lit_parallel.per_rank_seed(42,"
                " self.trainer)) in on_train_start."
                if workers == 0
                else "L.seed_everything(42, workers=True) (Lightning then seeds each worker from the rank), or a"
                " worker_init_fn that seeds from lit_parallel.per_rank_seed(...)."
            )
            return Finding(
                check,
                "problem",
                f"the dataset draws random numbers (dataset[0] differs between two reads) {where}, and ranks"
                f" {same} start the epoch with the same random state, so they apply the same augmentation"
                " sequence: the global batch holds fewer distinct views than it should.",
                fix,
            )
        return Finding(
            check, "ok", f"random augmentation {where} with a different random state on every rank."
        )


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


def format_table(findings: list[Finding], *, epoch: int, ranks: int, steps: int) -> str:
    """The report as a fixed-width table; problems get their fix on the following lines."""
    widths = (28, 8, 74)
    head = (
        f"lit_parallel PitfallReport: epoch {epoch}, {ranks} data-parallel ranks, {steps} steps on this rank"
    )
    lines = [head, f"{'check':<{widths[0]}} {'status':<{widths[1]}} evidence", "-" * sum(widths)]
    for f in findings:
        status = f.status.upper() if f.status == "problem" else f.status
        text = textwrap.wrap(f.evidence, widths[2]) or [""]
        lines.append(f"{f.check:<{widths[0]}} {status:<{widths[1]}} {text[0]}")
        pad = " " * (widths[0] + widths[1] + 2)
        lines += [pad + t for t in text[1:]]
        if f.status == "problem" and f.fix:
            fix = textwrap.wrap("fix: " + f.fix, widths[2])
            lines += [pad + t for t in fix]
    return "\n".join(lines)
