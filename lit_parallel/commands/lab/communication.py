"""`lit-parallel lab communication`: how much of a DDP step is spent waiting for communication.

Two ranks train an MLP of ~1M parameters with DDP. For each batch size, bucket size and gradient
compression hook the step is timed twice: normally, and inside ``no_sync()`` (no all-reduce at all).
The difference is the *exposed* communication, the part DDP could not hide behind the backward pass;
its share of the step is what the plot shows. Small batches leave little backward to overlap with, so
communication is exposed; compression halves the bytes but adds work.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from lit_parallel.commands.lab.common import FEATURES, figure, launch, mlp, run_worker, save, timed, write_csv
from lit_parallel.commands.launch import add_worker_arguments

HOOKS = ("none", "fp16")


def _step(model: Any, opt: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()


def _measure(batch: int, bucket_mb: float, hook: str, repeats: int) -> dict[str, float]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(mlp(hidden=512, depth=4), bucket_cap_mb=bucket_mb)
    if hook == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(batch, FEATURES), torch.randint(0, 4, (batch,))
    with_comm = timed(lambda: _step(model, opt, x, y), repeats)

    def local() -> None:
        with model.no_sync():
            _step(model, opt, x, y)

    without = timed(local, repeats)
    exposed = max(0.0, with_comm - without)
    return {
        "step_s": with_comm,
        "no_comm_step_s": without,
        "exposed_comm_s": exposed,
        "exposed_share": exposed / with_comm,
    }


def compute(args: argparse.Namespace) -> dict[str, Any]:
    """In every rank: every batch size x bucket size x hook, timed with and without communication."""
    rows = []
    for batch in map(int, args.batches.split(",")):
        for bucket in map(float, args.buckets.split(",")):
            for hook in HOOKS:
                figures = _measure(batch, bucket, hook, args.repeats)
                rows.append({"batch": batch, "bucket_mb": bucket, "hook": hook, **figures})
    return {"rows": rows, "params": sum(p.numel() for p in mlp(hidden=512, depth=4).parameters())}


def worker_args(quick: bool) -> list[str]:
    batches, buckets, repeats = ("8,256", "1,25", 3) if quick else ("8,32,128,512", "1,5,25", 7)
    return [f"--batches={batches}", f"--buckets={buckets}", f"--repeats={repeats}"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lit_parallel.commands.lab.communication")
    add_worker_arguments(p)
    p.add_argument("--batches", default="8,256")
    p.add_argument("--buckets", default="1,25")
    p.add_argument("--repeats", type=int, default=3)
    return p


def run(out: Path, quick: bool = False, result: dict[str, Any] | None = None) -> list[Path]:
    """Launch the ranks (unless ``result`` already holds what they computed), write CSV and PNG."""
    res = (
        result
        if result is not None
        else launch("lit_parallel.commands.lab.communication", 2, worker_args(quick))
    )
    rows = res["rows"]
    files = [write_csv(out / "communication.csv", rows)]
    fig, (ax_share, ax_time) = figure(2)
    for bucket in sorted({r["bucket_mb"] for r in rows}):
        for hook in HOOKS:
            pts = [
                (r["batch"], r["exposed_share"], r["step_s"])
                for r in rows
                if r["bucket_mb"] == bucket and r["hook"] == hook
            ]
            label = f"bucket {bucket:g} MB, hook {hook}"
            ax_share.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
            ax_time.plot([p[0] for p in pts], [p[2] * 1e3 for p in pts], "o-", label=label)
    ax_share.set(
        title=f"exposed communication ({res['params']:,} params, 2 ranks)",
        xlabel="batch per rank",
        ylabel="share of the step",
        xscale="log",
        ylim=(-0.05, 1.05),
    )
    ax_time.set(title="step time", xlabel="batch per rank", ylabel="ms", xscale="log")
    ax_share.legend(fontsize=7)
    files.append(save(fig, out / "communication.png"))
    return files


if __name__ == "__main__":
    raise SystemExit(run_worker(compute, parser().parse_args()))
