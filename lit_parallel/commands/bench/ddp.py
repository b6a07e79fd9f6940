"""`lit-parallel bench ddp`: ddp_tuned vs Lightning's ddp vs a plain PyTorch DDP loop, in one run.

Every variant trains the same model on the same data with the same sampler and batch size. Step time
is the wall time between consecutive batch ends (data loading included, as a user sees it), after
warm-up steps; each repeat gives a median, and the table shows the median over repeats, with the
variants' order rotated between repeats so that drift on a busy machine hits all of them alike.
Ratios are computed within each repeat (variants that ran back to back) and their median is shown.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from lit_parallel.commands.launch import add_worker_arguments

VARIANTS = ("ddp_tuned", "lightning_ddp", "plain_ddp")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", type=int, default=2, help="ranks (processes) to run (default 2)")
    p.add_argument("--accelerator", choices=("cpu", "gpu"), default="cpu", help="cpu (gloo) or gpu (nccl)")
    p.add_argument("--width", type=int, default=1024, help="hidden width of the MLP (default 1024)")
    p.add_argument("--depth", type=int, default=10, help="Linear layers (default 10: about 10.5M parameters)")
    p.add_argument("--batch-size", type=int, default=32, help="per-rank batch size (default 32)")
    p.add_argument("--steps", type=int, default=12, help="timed steps per repeat (default 12)")
    p.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="untimed steps per repeat (default 3; ddp_tuned probes on step 1 and builds DDP on step 2)",
    )
    p.add_argument("--repeats", type=int, default=5, help="repeats of every variant (default 5)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    add_worker_arguments(p)


def run(args: argparse.Namespace) -> int:
    if args.worker:
        return _worker(args)
    if args.repeats < 1 or args.steps < 1 or args.warmup < 1:
        raise ValueError("--repeats, --steps and --warmup must each be at least 1")
    from lit_parallel.commands.bench.common import launch_and_report

    forwarded = [
        f"--accelerator={args.accelerator}",
        f"--width={args.width}",
        f"--depth={args.depth}",
        f"--batch-size={args.batch_size}",
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
        f"--repeats={args.repeats}",
        f"--devices={args.devices}",
    ]
    return launch_and_report("lit_parallel.commands.bench.ddp", args, forwarded, print_report)


def print_report(result: dict[str, Any]) -> None:
    from lit_parallel.commands.terminal import Column, fit_table, terminal_console

    cfg = result["config"]
    title = (
        f"bench ddp: {cfg['params'] / 1e6:.1f}M-parameter MLP, {cfg['devices']} ranks ({cfg['backend']}),"
        f" batch {cfg['batch_size']}/rank, median of {cfg['repeats']} repeats x {cfg['steps']} steps"
    )
    columns = [Column("variant")] + [
        Column(h, "right")
        for h in ("step time (ms)", "samples/s", "vs lightning ddp", "vs plain loop", "bytes/step")
    ]
    rows = []
    for name in VARIANTS:
        v = result["variants"][name]
        rows.append(
            [
                name,
                f"{v['median_step_s'] * 1e3:.1f}",
                f"{v['samples_per_s']:.1f}",
                f"{v['ratio_vs_lightning_ddp']:.3f}",
                f"{v['ratio_vs_plain']:.3f}",
                f"{v['bytes_per_step']:,}" if v["bytes_per_step"] is not None else "same reducer",
            ]
        )
    console = terminal_console()
    console.print(fit_table(columns, rows, width=console.width, title=title))
    console.print(
        f"ddp_tuned buckets: {result['ddp_tuned']['bucket_caps_mb']} MiB; {result['ddp_tuned']['reason']}"
    )
    console.print(f"per-repeat medians (s): {result['per_repeat']}")


# ----------------------------------------------------------------------------------------- ranks


def _worker(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from lit_parallel.commands.launch import init_ranks, write_result

    device = init_ranks(args.accelerator)
    use_gpu = device.type == "cuda"
    data = _random_data(args)
    times, tuned_info = _time_variants(args, data, device)
    bytes_per_step = {
        "ddp_tuned": _count_bytes_lightning(args, data, use_gpu),
        "plain_ddp": _count_bytes_plain(args, data, device),
        "lightning_ddp": None,  # same DDP reducer as the plain loop; Lightning registers hooks only on CUDA
    }
    if dist.get_rank() == 0:
        write_result(args.result, _report(args, dist.get_backend(), times, bytes_per_step, tuned_info))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _random_data(args: argparse.Namespace) -> Any:
    """Enough random samples for every step of one run on every rank (the same on every rank)."""
    import torch

    n_samples = args.devices * args.batch_size * (args.warmup + args.steps)
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(
        torch.randn(n_samples, args.width, generator=g), torch.randint(0, 10, (n_samples,), generator=g)
    )


def _time_variants(args: argparse.Namespace, data: Any, device: Any) -> tuple[dict[str, list[float]], dict]:
    """Median step time of each variant per repeat (variants rotated), and what ddp_tuned decided."""
    from lit_parallel.commands.bench.common import rotated

    use_gpu = device.type == "cuda"
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    tuned_info: dict[str, Any] = {}
    for variant in rotated(VARIANTS, args.repeats):
        if variant == "plain_ddp":
            step_times = _plain_loop(args, data, device)
        else:
            step_times, info = _lightning_run(args, data, variant, use_gpu)
            if info:
                tuned_info = info
        times[variant].append(statistics.median(step_times[args.warmup :]))
    return times, tuned_info


def _report(
    args: argparse.Namespace,
    backend: str,
    times: dict[str, list[float]],
    bytes_per_step: dict[str, int | None],
    tuned_info: dict[str, Any],
) -> dict[str, Any]:
    from lit_parallel.commands.bench.common import median_ratio

    med = {v: statistics.median(times[v]) for v in VARIANTS}
    global_batch = args.batch_size * args.devices
    return {
        "config": {
            "devices": args.devices,
            "backend": backend,
            "params": sum(p.numel() for p in _make_model(args).parameters()),
            "batch_size": args.batch_size,
            "steps": args.steps,
            "repeats": args.repeats,
        },
        "variants": {
            v: {
                "median_step_s": med[v],
                "samples_per_s": global_batch / med[v],
                # ratios are taken within each repeat (the variants ran back to back), then the median
                "ratio_vs_lightning_ddp": median_ratio(times[v], times["lightning_ddp"]),
                "ratio_vs_plain": median_ratio(times[v], times["plain_ddp"]),
                "bytes_per_step": bytes_per_step[v],
            }
            for v in VARIANTS
        },
        "per_repeat": {v: [round(t, 5) for t in times[v]] for v in VARIANTS},
        "ddp_tuned": tuned_info,
    }


def _make_model(args):
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(args.depth - 1):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    layers.append(nn.Linear(args.width, 10))
    return nn.Sequential(*layers)


def _loader(args, data, sampler_rank=None):
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = DistributedSampler(data, num_replicas=dist.get_world_size(), rank=dist.get_rank(), seed=0)
    return DataLoader(data, batch_size=args.batch_size, sampler=sampler)


def _plain_loop(args, data, device) -> list[float]:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    model = _make_model(args).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    ends = [time.perf_counter()]
    for x, y in _loader(args, data):
        x, y = x.to(device), y.to(device)
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        ends.append(time.perf_counter())
    return [b - a for a, b in zip(ends, ends[1:])]


def _lightning_module(args):
    import lightning as L
    import torch

    class Bench(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = _make_model(args)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.model(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Bench()


def _lightning_run(args, data, variant, use_gpu) -> tuple[list[float], dict]:
    from lightning.pytorch.strategies import DDPStrategy

    from lit_parallel import TunedDDPStrategy
    from lit_parallel.commands.bench.common import StepProbe, bench_trainer

    timer = StepProbe(args.warmup, use_gpu)
    strategy = TunedDDPStrategy() if variant == "ddp_tuned" else DDPStrategy()
    trainer = bench_trainer(args, strategy, use_gpu, [timer])
    trainer.fit(_lightning_module(args), _loader(args, data))
    info = {}
    if variant == "ddp_tuned":
        plan = trainer.strategy.bucket_plan
        info = {"bucket_caps_mb": plan.cap_mb_list, "reason": plan.reason}
    return timer.step_times, info


def _count_bytes_lightning(args, data, use_gpu) -> int:
    """Bytes one rank all-reduces per optimizer step under ddp_tuned (Python all-reduce hook, counted)."""
    import lightning as L

    from lit_parallel import TunedDDPStrategy
    from lit_parallel.commands.bench.common import bench_trainer
    from lit_parallel.measure.collectives import CollectiveStats, count_collectives

    stats, per_step = CollectiveStats(), []

    class Count(L.Callback):
        def on_before_backward(self, trainer, pl_module, loss):
            stats.reset()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            per_step.append(stats.bytes["all_reduce"])

    strategy = TunedDDPStrategy(comm_hook="allreduce", find_unused_parameters=False)
    trainer = bench_trainer(args, strategy, use_gpu, [Count()], max_steps=2)
    with count_collectives(stats):
        trainer.fit(_lightning_module(args), _loader(args, data))
    return per_step[-1]


def _count_bytes_plain(args, data, device) -> int:
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    from lit_parallel.measure.collectives import count_collectives

    ddp = DistributedDataParallel(_make_model(args).to(device))
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    x, y = next(iter(_loader(args, data)))
    with count_collectives() as stats:
        torch.nn.functional.cross_entropy(ddp(x.to(device)), y.to(device)).backward()
    return stats.bytes["all_reduce"]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m lit_parallel.commands.bench.ddp")
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
