"""Pieces every benchmark program shares: the per-step probe and ratio statistics."""

from __future__ import annotations

import statistics
import time

import lightning as L
import torch

from lit_parallel.parallel.comm import CommCounter


class StepProbe(L.Callback):
    """Times every training batch (batch end to batch end) and counts the collectives of one step.

    The counted step is the last warm-up step (``warmup - 1``), which is not timed, so counting costs
    no timed step anything.
    """

    def __init__(self, warmup: int, use_gpu: bool = False):
        self.warmup = warmup
        self.use_gpu = use_gpu
        self.ends: list[float] = []
        self.counter: CommCounter | None = None
        self.sent = 0.0
        self.counts: dict[str, int] = {}

    def on_train_start(self, trainer, pl_module):
        self.ends = [time.perf_counter()]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.warmup - 1:
            self.counter = CommCounter()
            self.counter.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.counter is not None:
            self.counter.__exit__(None, None, None)
            self.sent, self.counts = self.counter.sent_bytes(), self.counter.counts()
            self.counter = None
        if self.use_gpu:
            torch.cuda.synchronize()
        self.ends.append(time.perf_counter())

    @property
    def step_times(self) -> list[float]:
        return [b - a for a, b in zip(self.ends, self.ends[1:])]


def launch_and_report(module: str, args, forwarded: list[str], print_report) -> int:
    """Run ``module``'s worker on ``args.devices`` ranks, print rank 0's result, write it to ``args.json``."""
    import json
    from pathlib import Path

    from lit_parallel.launch import run_ranks

    result = run_ranks(module, args.devices, forwarded)
    print_report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def median_ratio(a: list[float], b: list[float]) -> float:
    """Median over repeats of ``a[i] / b[i]``: ratios of variants that ran back to back."""
    return statistics.median(x / y for x, y in zip(a, b))
