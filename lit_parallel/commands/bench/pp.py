"""`lit-parallel bench pp`: the pipeline bubble, measured per rank against (P - 1) / (M + P - 1).

For GPipe and 1F1B and M = 1, 2, 4, 8 micro-batches, every rank records when each of its stage's forward
and backward computations runs (torch's ``forward_one_chunk`` / ``backward_one_chunk``). A step starts
after a barrier; its length is the slowest rank's. A rank's idle fraction is 1 - (its compute time / the
step's length), median over the timed steps. The theory assumes equal stages and free communication, so
the model is blocks of equal size with a small embedding and head. One step per rank is drawn as a
timeline (PNG, matplotlib). 1F1B needs M >= P (torch's ``Schedule1F1B``), so its M = 1 row is absent.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from lit_parallel.commands.extras import require_extra
from lit_parallel.commands.launch import add_worker_arguments

SCHEDULES = ("GPipe", "1F1B")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", type=int, default=2, help="pipeline ranks (processes, default 2)")
    p.add_argument("--accelerator", choices=("cpu", "gpu"), default="cpu", help="cpu (gloo) or gpu (nccl)")
    p.add_argument("--microbatches", default="1,2,4,8", help="micro-batch counts M (default 1,2,4,8)")
    p.add_argument("--dim", type=int, default=256, help="model width (default 256)")
    p.add_argument("--layers", type=int, default=8, help="blocks, split evenly over the ranks (default 8)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=64, help="small: the head stays cheap (default 64)")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16, help="samples per step (default 16)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per configuration (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per configuration (default 2)")
    p.add_argument("--out", default="bench-pp", help="folder for the timeline and bubble plots")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    add_worker_arguments(p)


def run(args: argparse.Namespace) -> int:
    if args.worker:
        return _worker(args)
    counts = _counts(args.microbatches)
    if args.devices < 2:
        raise ValueError(f"--devices={args.devices}: a pipeline needs at least 2 ranks")
    if args.layers % args.devices:
        raise ValueError(
            f"--layers={args.layers} must be a multiple of --devices={args.devices} (equal stages)"
        )
    if any(args.batch_size % m for m in counts):
        raise ValueError(f"--batch-size={args.batch_size} must be divisible by every M in {counts}")
    require_extra("bench", "the timeline and bubble plots bench pp draws")  # before any rank starts
    from lit_parallel.commands.bench.common import launch_and_report

    if args.json and args.out == "bench-pp":
        args.out = str(Path(args.json).resolve().parent)  # the plots next to the JSON
    forwarded = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in _FORWARDED]
    code = launch_and_report("lit_parallel.commands.bench.pp", args, forwarded, print_report)
    return code


_FORWARDED = (
    "accelerator",
    "microbatches",
    "dim",
    "layers",
    "heads",
    "vocab",
    "seq",
    "batch_size",
    "steps",
    "warmup",
    "out",
)


def _counts(text: str) -> list[int]:
    try:
        counts = [int(m) for m in text.split(",") if m.strip()]
    except ValueError:
        counts = []
    if not counts or any(m < 1 for m in counts):
        raise ValueError(f"--microbatches={text!r} must be comma-separated positive integers, e.g. 1,2,4,8")
    return counts


def print_report(result: dict[str, Any]) -> None:
    from lit_parallel.commands.terminal import Column, fit_table, terminal_console

    cfg = result["config"]
    title = (
        f"bench pp: {cfg['params'] / 1e6:.2f}M-parameter GPT, {cfg['devices']} stages ({cfg['backend']}),"
        f" batch {cfg['batch_size']}, median of {cfg['steps']} steps"
    )
    p = cfg["devices"]
    headers = ("schedule", "M", "theory (P-1)/(M+P-1)", *[f"idle rank {r}" for r in range(p)], "step (ms)")
    columns = [Column(h, "right") for h in headers]
    rows = [
        [
            row["schedule"],
            str(row["microbatches"]),
            f"{row['theory']:.1%}",
            *[f"{x:.1%}" for x in row["idle"]],
            f"{row['step_s'] * 1e3:.1f}",
        ]
        for row in result["rows"]
    ]
    console = terminal_console()
    console.print(fit_table(columns, rows, width=console.width, title=title))
    for path in result.get("plots", []):
        print(f"wrote {path}")


# --- the worker: one process per pipeline rank ------------------------------------------------------------


def _worker(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from lit_parallel.commands.bench.common import make_gpt
    from lit_parallel.commands.launch import init_ranks, write_result
    from lit_parallel.parallel.pipeline.plan import bubble_fraction

    device = init_ranks(args.accelerator)
    p = dist.get_world_size()
    rows, timelines = [], {}
    for schedule in SCHEDULES:
        for m in _counts(args.microbatches):
            if schedule == "1F1B" and m < p:
                continue
            idle, step_s, timeline = _measure(args, schedule, m, device)
            rows.append(
                {
                    "schedule": schedule,
                    "microbatches": m,
                    "theory": bubble_fraction(p, m),
                    "idle": idle,
                    "step_s": step_s,
                }
            )
            timelines[f"{schedule} M={m}"] = timeline
    if dist.get_rank() == 0:
        params = sum(q.numel() for q in make_gpt(args).parameters())
        config = {k: getattr(args, k) for k in ("dim", "layers", "seq", "batch_size", "steps")}
        result = {
            "config": {**config, "devices": p, "backend": dist.get_backend(), "params": params},
            "rows": rows,
            "timelines": timelines,
        }
        result["plots"] = _plots(result, Path(args.out))
        write_result(args.result, result)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _measure(args, schedule: str, m: int, device) -> tuple[list[float], float, list]:
    """Idle fraction of every rank (median over timed steps), the median step, one step's intervals."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from lit_parallel.commands.bench.common import make_gpt
    from lit_parallel.parallel.blocks import find_transformer_blocks
    from lit_parallel.parallel.mesh import ParallelDims
    from lit_parallel.parallel.pipeline.plan import plan_pipeline
    from lit_parallel.parallel.pipeline.schedule import build_pipeline, parallelize_stages

    p = dist.get_world_size()
    model = make_gpt(args).to(device)
    dims = ParallelDims.for_pipeline(world_size=p, pipeline_parallel=p)
    dims.build_mesh(device.type)
    names = [n for n, _ in find_transformer_blocks(model).blocks]
    split = [names[i * args.layers // p] for i in range(1, p)]  # equal stages, as the theory assumes
    plan = plan_pipeline(
        model, find_transformer_blocks(model), pp_size=p, schedule=schedule, microbatches=m, split=split
    )
    stages = parallelize_stages(model, plan, dims, shard=False)

    def loss_fn(out, y):
        return F.cross_entropy(out.flatten(0, 1), y.flatten()) / m

    pipe = build_pipeline(plan, stages, dims, loss_fn, device)
    intervals: list[tuple[str, float, float]] = []
    for stage in pipe.pipe_stages:
        _record(stage, intervals)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, args.vocab, (args.batch_size, args.seq), generator=g).to(device)
    y = torch.randint(0, args.vocab, (args.batch_size, args.seq), generator=g).to(device)
    idle, steps, timeline = [], [], []
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(args.warmup + args.steps):
        dist.barrier()
        intervals.clear()
        t0 = time.perf_counter()
        pipe.step((x,), y)
        own = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(own, op=dist.ReduceOp.MAX)  # the step lasts until the slowest rank is done
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step < args.warmup:
            continue
        busy = sum(end - start for _, start, end in intervals)
        share = torch.tensor([1.0 - busy / own.item()], dtype=torch.float64)
        gathered = [torch.zeros(1, dtype=torch.float64) for _ in range(p)]
        dist.all_gather(gathered, share)
        idle.append([t.item() for t in gathered])
        steps.append(own.item())
        timeline = [(kind, start - t0, end - t0) for kind, start, end in intervals]
    all_timelines: list[Any] = [None] * p
    dist.all_gather_object(all_timelines, timeline)
    per_rank = [statistics.median(step[r] for step in idle) for r in range(p)]
    return per_rank, statistics.median(steps), all_timelines


def _record(stage, intervals: list) -> None:
    """Record when the stage computes: forward and backward of each micro-batch (instance-level wrap)."""
    for name, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B")):
        inner = getattr(stage, name)

        def timed(*a, _inner=inner, _kind=kind, **kw):
            start = time.perf_counter()
            try:
                return _inner(*a, **kw)
            finally:
                intervals.append((_kind, start, time.perf_counter()))

        setattr(stage, name, timed)


def _plots(result: dict[str, Any], out: Path) -> list[str]:
    import matplotlib  # the bench extra: run() has checked that it is installed

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []
    p = result["config"]["devices"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for schedule in SCHEDULES:
        rows = [r for r in result["rows"] if r["schedule"] == schedule]
        for rank in range(p):
            ax.plot(
                [r["microbatches"] for r in rows],
                [r["idle"][rank] for r in rows],
                "o-",
                label=f"{schedule} rank {rank}",
            )
    ms = sorted({r["microbatches"] for r in result["rows"]})
    ax.plot(ms, [(p - 1) / (m + p - 1) for m in ms], "k--", label="(P-1)/(M+P-1)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches M")
    ax.set_ylabel("idle fraction")
    ax.set_title(f"pipeline bubble, P={p}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / "pp_bubble.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(str(path))
    for label in ("GPipe M=4", "1F1B M=4"):
        if label not in result["timelines"]:
            continue
        fig, ax = plt.subplots(figsize=(8, 1 + 0.6 * p))
        for rank, intervals in enumerate(result["timelines"][label]):
            for kind, start, end in intervals:
                color = "tab:blue" if kind == "F" else "tab:orange"
                ax.barh(
                    rank, (end - start) * 1e3, left=start * 1e3, color=color, edgecolor="black", linewidth=0.3
                )
        ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
        ax.invert_yaxis()
        ax.set_xlabel("ms since the step started (blue: forward, orange: backward)")
        ax.set_title(f"one step, {label}")
        fig.tight_layout()
        path = out / f"pp_timeline_{label.split()[0]}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(str(path))
    return written


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m lit_parallel.commands.bench.pp")
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
