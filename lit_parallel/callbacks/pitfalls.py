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

The step timings and their judges live in :mod:`~lit_parallel.callbacks.pitfall_timing`, the other
measurements in :mod:`~lit_parallel.callbacks.pitfall_checks`.
"""

from __future__ import annotations

import textwrap
from collections.abc import Collection
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

from lightning.pytorch import Callback
from torch.utils.data import DataLoader

from lit_parallel.callbacks.data_parallel import (
    DataParallelGroup,
    all_gather_object,
    check_mode,
    data_parallel_group,
    report,
)
from lit_parallel.callbacks.pitfall_checks import (
    Finding,
    draws_random_numbers,
    learning_rate_rule,
    rng_fingerprint,
    scaled_learning_rate,
    scheduled_peak_lrs,
    tensors_diverging,
)
from lit_parallel.callbacks.pitfall_timing import (
    StepTimer,
    judge_comm,
    judge_data,
    judge_stragglers,
    judge_throughput,
)


@dataclass
class _EpochRecord:
    """This rank's observations since the epoch started, besides step timings."""

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
            factor is a straggler. 1.4 leaves room for the jitter of ranks sharing a host's cores and is
            close to the relative performance of 0.7 at which NVIDIA's resiliency extension reports a
            straggler.
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
        straggler_limit: float = 1.4,
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
        self._record = _EpochRecord()
        self._timer = StepTimer()
        self._dp: DataParallelGroup | None = None
        self._reported: set[str] = set()
        self._last_table = ""
        self._batches = 0
        self._augmentation: dict[str, Any] = {}
        self._epoch = 0

    # ----------------------------------------------------------------------------------------- hooks
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._timer.install(trainer)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._timer.uninstall()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.teardown(trainer, pl_module, "fit")

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._dp = data_parallel_group(trainer.strategy)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._record = _EpochRecord()
        self._timer.start_epoch()
        self._epoch = trainer.current_epoch
        self._augmentation = self._augmentation_state(trainer)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        record = self._record
        if trainer.optimizers:
            lr = float(trainer.optimizers[0].param_groups[0]["lr"])
            if record.first_lr is None:
                record.first_lr = lr
            record.peak_lr = max(record.peak_lr, lr)
        self._timer.start_step(batch)  # last: its window holds the step alone

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._timer.end_step(trainer)  # first: the checks below run collectives of their own
        self._batches += 1
        if self._batches % self.check_every_n_steps == 0:
            self._check_divergence(trainer, pl_module)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._check_divergence(trainer, pl_module)
        self.check(trainer)

    # ----------------------------------------------------------------------------------- measurement
    def _check_divergence(self, trainer: Any, pl_module: Any) -> None:
        dp = self._dp or data_parallel_group(trainer.strategy)
        if not dp.distributed:
            return
        self._record.divergence_checks += 1
        for name, rel in tensors_diverging(pl_module, dp).items():
            self._record.diverged[name] = max(rel, self._record.diverged.get(name, 0.0))

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
            state["random"] = draws_random_numbers(loader.dataset)
        else:
            state["random"] = self._augmentation.get("random")
        generator = loader.generator
        state["rng"] = rng_fingerprint(generator)
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
            judge_data(ranks, self.data_wait_limit),
            judge_comm(ranks, self.comm_share_limit, trainer.strategy),
            judge_stragglers(ranks, self.straggler_limit),
            judge_throughput(ranks),
            self._judge_augmentation(ranks),
        ]
        self.findings = findings
        shape = {"epoch": self._epoch, "ranks": dp.size, "steps": summary["steps"]}
        self._last_table = format_table(findings, **shape)
        problems = [f for f in findings if f.status == "problem"]
        # a problem is warned about once per run, the first time it is found
        fresh = [f for f in problems if f.check not in self._reported] if self.mode == "warn" else []
        self._reported.update(f.check for f in fresh)
        if self.print_table and trainer.is_global_zero:
            # the rows of problems warned about now point to the warning instead of repeating it
            print(format_table(findings, **shape, warned={f.check for f in fresh}), flush=True)
        if self.mode == "raise":
            report([f.message() for f in problems], mode="raise", is_global_zero=trainer.is_global_zero)
        report([f.message() for f in fresh], mode="warn", is_global_zero=trainer.is_global_zero)
        return findings

    def table(self) -> str:
        """The last report, every row in full."""
        return self._last_table

    def _summary(self, trainer: Any) -> dict[str, Any]:
        r = self._record
        return {
            **self._timer.summary(),
            "rank": self._dp.rank if self._dp else 0,
            "diverged": dict(r.diverged),
            "divergence_checks": r.divergence_checks,
            "first_lr": r.first_lr,
            "peak_lr": max([r.peak_lr] + scheduled_peak_lrs(trainer)),
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


def format_table(
    findings: list[Finding], *, epoch: int, ranks: int, steps: int, warned: Collection[str] = ()
) -> str:
    """The report as a fixed-width table; problems get their fix on the following lines.

    Problems whose check is in ``warned`` only point to the warning that holds their evidence and fix.
    """
    widths = (28, 8, 74)
    head = (
        f"lit_parallel PitfallReport: epoch {epoch}, {ranks} data-parallel ranks, {steps} steps on this rank"
    )
    lines = [head, f"{'check':<{widths[0]}} {'status':<{widths[1]}} evidence", "-" * sum(widths)]
    for f in findings:
        status = f.status.upper() if f.status == "problem" else f.status
        pointer = f.status == "problem" and f.check in warned
        evidence = "see the ParallelTrainingWarning below (evidence and fix)" if pointer else f.evidence
        text = textwrap.wrap(evidence, widths[2]) or [""]
        lines.append(f"{f.check:<{widths[0]}} {status:<{widths[1]}} {text[0]}")
        pad = " " * (widths[0] + widths[1] + 2)
        lines += [pad + t for t in text[1:]]
        if f.status == "problem" and f.fix and not pointer:
            fix = textwrap.wrap("fix: " + f.fix, widths[2])
            lines += [pad + t for t in fix]
    return "\n".join(lines)
