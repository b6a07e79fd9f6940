"""`lit-parallel lab scaling`: 1, 2, 4 processes on the same problem.

Equal global batch: each of N ranks reads global_batch / N samples per step, so every run takes the same
optimizer steps: the final accuracy should match, and throughput shows what N processes buy on this
machine (on a laptop the ranks share the cores: the speed-up stops where the cores run out). Kept
per-rank batch: the global batch grows with N and the number of steps shrinks; with the learning rate
unchanged training falls behind, with the linear scaling rule (learning rate x N; Goyal et al. 2017)
it catches up.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from lit_parallel.commands.lab.common import (
    accuracy,
    classification_data,
    figure,
    launch,
    mlp,
    run_worker,
    save,
    write_csv,
)
from lit_parallel.commands.launch import add_worker_arguments

GLOBAL_BATCH, PER_RANK_BATCH, LR = 32, 16, 0.2


def _train(
    per_rank_batch: int, lr: float, samples: int, epochs: int, rank: int, world: int
) -> dict[str, float]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    data = classification_data(samples)
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(data, batch_size=per_rank_batch, sampler=sampler, drop_last=True)
    model = DDP(mlp())
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    dist.barrier()
    start, seen = time.perf_counter(), 0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            seen += len(y) * world
    dist.barrier()
    elapsed = time.perf_counter() - start
    test = classification_data(1024, seed=1)
    return {
        "samples_per_s": seen / elapsed,
        "accuracy": accuracy(model.module, test),
        "steps": len(loader) * epochs,
    }


def compute(args: argparse.Namespace) -> dict[str, Any]:
    """In every rank: the three runs at this world size."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    return {
        "equal global batch": _train(GLOBAL_BATCH // world, LR, args.samples, args.epochs, rank, world),
        "kept per-rank batch, same lr": _train(PER_RANK_BATCH, LR, args.samples, args.epochs, rank, world),
        "kept per-rank batch, lr x N": _train(
            PER_RANK_BATCH, LR * world, args.samples, args.epochs, rank, world
        ),
    }


def worker_args(quick: bool) -> list[str]:
    samples, epochs = (256, 3) if quick else (2048, 5)
    return [f"--samples={samples}", f"--epochs={epochs}"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lit_parallel.commands.lab.scaling")
    add_worker_arguments(p)
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--epochs", type=int, default=3)
    return p


def run(out: Path, quick: bool = False, result: dict[str, Any] | None = None) -> list[Path]:
    """Launch 1, 2 (and 4) ranks, write CSV and PNG; ``result`` may hold the 2-rank run already made
    (``lab all`` runs it in its shared launch)."""
    ranks = (1, 2) if quick else (1, 2, 4)
    epochs = parser().parse_args(worker_args(quick)).epochs
    rows = []
    for n in ranks:
        res = (
            result
            if (n == 2 and result is not None)
            else launch("lit_parallel.commands.lab.scaling", n, worker_args(quick))
        )
        rows += [{"ranks": n, "run": name, **figures} for name, figures in res.items()]
    files = [write_csv(out / "scaling.csv", rows)]
    fig, (ax_speed, ax_acc) = figure(2)
    for name in dict.fromkeys(r["run"] for r in rows):
        pts = [r for r in rows if r["run"] == name]
        if name == "equal global batch":
            ax_speed.plot([r["ranks"] for r in pts], [r["samples_per_s"] for r in pts], "o-", label=name)
        ax_acc.plot([r["ranks"] for r in pts], [r["accuracy"] for r in pts], "o-", label=name)
    ax_speed.set(
        title="throughput, equal global batch", xlabel="processes", ylabel="samples / s", xticks=list(ranks)
    )
    ax_acc.set(
        title=f"test accuracy after {epochs} epochs",
        xlabel="processes",
        ylabel="accuracy",
        xticks=list(ranks),
    )
    ax_acc.legend(fontsize=8)
    files.append(save(fig, out / "scaling.png"))
    return files


if __name__ == "__main__":
    raise SystemExit(run_worker(compute, parser().parse_args()))
