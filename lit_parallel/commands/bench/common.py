"""Pieces every benchmark program shares: the per-step probe, ratio statistics, and the GPT model of the
fsdp and tp benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from lit_parallel.measure.collectives import Collective, CommCounter


class StepProbe(L.Callback):
    """Times every training batch (batch end to batch end) and counts the collectives of one step
    (``sent``, ``counts``, and every call in ``records``).

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
        self.records: list[Collective] = []

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
            self.records = list(self.counter.records)
            self.counter = None
        if self.use_gpu:
            torch.cuda.synchronize()
        self.ends.append(time.perf_counter())

    @property
    def step_times(self) -> list[float]:
        return [b - a for a, b in zip(self.ends, self.ends[1:])]


def rotated(variants: tuple[str, ...], repeats: int) -> Iterator[str]:
    """Every variant once per repeat, the order rotated from one repeat to the next, so drift on a busy
    machine hits all variants alike."""
    for rep in range(repeats):
        k = rep % len(variants)
        yield from variants[k:] + variants[:k]


def time_variants(
    variants: tuple[str, ...], repeats: int, warmup: int, run: Callable[[str], tuple[list[float], dict]]
) -> tuple[dict[str, list[float]], dict[str, dict]]:
    """Every variant ``repeats`` times in rotated order (:func:`rotated`); ``run(variant)`` trains once and
    returns its step seconds and what it counted. Per variant: each repeat's median step after ``warmup``,
    and what its first run counted."""
    times: dict[str, list[float]] = {v: [] for v in variants}
    counted: dict[str, dict] = {}
    for variant in rotated(variants, repeats):
        step_times, info = run(variant)
        times[variant].append(statistics.median(step_times[warmup:]))
        counted.setdefault(variant, info)
    return times, counted


def token_dataset(vocab: int, seq: int, samples: int) -> torch.utils.data.TensorDataset:
    """Seeded random token sequences as (input, next-token target) pairs, the same on every rank."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (samples, seq + 1), generator=g)
    return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])


def bench_trainer(args, strategy, use_gpu: bool, callbacks: list, max_steps: int | None = None) -> L.Trainer:
    """A quiet Trainer on every rank of the running group, for ``args.warmup + args.steps`` steps."""
    import torch.distributed as dist

    return L.Trainer(
        accelerator="gpu" if use_gpu else "cpu",
        devices=dist.get_world_size(),
        strategy=strategy,
        max_steps=max_steps or args.warmup + args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )


def launch_and_report(module: str, args, forwarded: list[str], print_report) -> int:
    """Run ``module``'s worker on ``args.devices`` ranks, print rank 0's result, write it to ``args.json``."""
    import json
    from pathlib import Path

    from lit_parallel.commands.launch import run_ranks

    result = run_ranks(module, args.devices, forwarded)
    print_report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def median_ratio(a: list[float], b: list[float]) -> float:
    """Median over repeats of ``a[i] / b[i]``: ratios of variants that ran back to back."""
    return statistics.median(x / y for x, y in zip(a, b))


# --- the GPT of `bench fsdp` and `bench tp` ---------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads  # tp_dp divides it by the TP size: the view below then sees local heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, dim: int, heads: int, layers: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def make_gpt(args) -> GPT:
    """The benchmark GPT from ``args`` (vocab, seq, dim, heads, layers), seeded: identical on every rank."""
    torch.manual_seed(0)
    return GPT(args.vocab, args.seq, args.dim, args.heads, args.layers)


class GPTBench(L.LightningModule):
    """Next-token cross-entropy on :func:`make_gpt`, AdamW."""

    def __init__(self, args):
        super().__init__()
        self.model = make_gpt(args)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)
