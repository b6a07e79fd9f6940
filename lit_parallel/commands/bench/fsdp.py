"""`lit-parallel bench fsdp`: fsdp_blocks vs Lightning's ModelParallelStrategy vs ddp_tuned, in one run.

Every variant trains the same GPT-style transformer (AdamW) on the same data with the same sampler and
batch size:

- ``fsdp_blocks``: ``TransformerFSDPStrategy()``, no model code (blocks found automatically)
- ``lightning_mp``: Lightning's ``ModelParallelStrategy`` with the ``configure_model`` a user writes by
  hand (``fully_shard`` per block, then the model; FSDP2's defaults)
- ``ddp_tuned``: ``TunedDDPStrategy()`` (nothing sharded: the reference for bytes per rank)

Step time is the wall time between consecutive batch ends after warm-up steps; each repeat gives a
median and the table shows the median over repeats, with the order of variants rotated between repeats.
Bytes per rank are the parameters, gradients and AdamW state a rank holds after training (local shards),
compared with ZeRO's 16P/N; bytes communicated are what one rank sends per optimizer step with ring
collectives, counted on the last warm-up step.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from lit_parallel.commands.launch import add_worker_arguments

VARIANTS = ("fsdp_blocks", "lightning_mp", "ddp_tuned")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", type=int, default=2, help="ranks (processes) to run (default 2)")
    p.add_argument("--accelerator", choices=("cpu", "gpu"), default="cpu", help="cpu (gloo) or gpu (nccl)")
    p.add_argument("--dim", type=int, default=256, help="model width (default 256)")
    p.add_argument(
        "--layers", type=int, default=4, help="transformer blocks (default 4: about 3.7M parameters)"
    )
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--vocab", type=int, default=1024, help="vocabulary size (default 1024)")
    p.add_argument("--seq", type=int, default=64, help="sequence length (default 64)")
    p.add_argument("--batch-size", type=int, default=8, help="per-rank batch size (default 8)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per repeat (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per repeat, at least 2 (default 3)")
    p.add_argument("--repeats", type=int, default=3, help="repeats of every variant (default 3)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    add_worker_arguments(p)


def run(args: argparse.Namespace) -> int:
    if args.worker:
        return _worker(args)
    if args.repeats < 1 or args.steps < 1 or args.warmup < 2:
        raise ValueError("--repeats and --steps must be at least 1, --warmup at least 2")
    if args.dim % args.heads:
        raise ValueError(f"--dim={args.dim} must be a multiple of --heads={args.heads}")
    from lit_parallel.commands.bench.common import launch_and_report

    forwarded = [
        f"--{k.replace('_', '-')}={getattr(args, k)}"
        for k in ("accelerator", "dim", "layers", "heads", "vocab", "seq", "batch_size", "steps", "warmup")
    ]
    forwarded += [f"--repeats={args.repeats}", f"--devices={args.devices}"]
    return launch_and_report("lit_parallel.commands.bench.fsdp", args, forwarded, print_report)


def print_report(result: dict[str, Any]) -> None:
    from lit_parallel.commands.terminal import Column, fit_table, terminal_console
    from lit_parallel.formatting import format_bytes

    cfg = result["config"]
    title = (
        f"bench fsdp: {cfg['params'] / 1e6:.2f}M-parameter GPT ({cfg['layers']} blocks, dim {cfg['dim']}),"
        f" {cfg['devices']} ranks ({cfg['backend']}), batch {cfg['batch_size']}x{cfg['seq']} tokens/rank,"
        f" AdamW, median of {cfg['repeats']} repeats x {cfg['steps']} steps"
    )
    headers = (
        "step (ms)",
        "samples/s",
        "vs lightning_mp",
        "state bytes/rank",
        "vs 16P/N",
        "sent/step",
        "vs ddp",
    )
    columns = [Column("variant"), *(Column(h, "right") for h in headers)]
    rows = []
    for name in VARIANTS:
        v = result["variants"][name]
        rows.append(
            [
                name,
                f"{v['median_step_s'] * 1e3:.1f}",
                f"{v['samples_per_s']:.1f}",
                f"{v['ratio_vs_lightning_mp']:.3f}",
                format_bytes(v["state_bytes"]),
                f"{v['state_vs_zero3']:.3f}",
                format_bytes(v["sent_bytes_per_step"]),
                f"{v['sent_vs_ddp']:.3f}",
            ]
        )
    console = terminal_console()
    console.print(fit_table(columns, rows, width=console.width, title=title))
    console.print(
        f"16P/N = {format_bytes(cfg['zero3_bytes'])}; collectives per step: {result['collectives']}"
    )
    console.print(f"per-repeat medians (s): {result['per_repeat']}")


# ----------------------------------------------------------------------------------------- model


def _lightning_module(args, hand_sharded: bool):
    from lit_parallel.commands.bench.common import GPTBench

    class HandSharded(GPTBench):
        def configure_model(self):
            # What a user writes for Lightning's ModelParallelStrategy.
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for block in self.model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

    return HandSharded(args) if hand_sharded else GPTBench(args)


# ----------------------------------------------------------------------------------------- ranks


def _worker(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from lit_parallel.commands.bench.common import make_gpt, time_variants, token_dataset
    from lit_parallel.commands.launch import init_ranks, write_result

    use_gpu = init_ranks(args.accelerator).type == "cuda"
    backend = dist.get_backend()
    n = dist.get_world_size()
    data = token_dataset(args.vocab, args.seq, n * args.batch_size * (args.warmup + args.steps))
    times, measured = time_variants(
        VARIANTS, args.repeats, args.warmup, lambda variant: _lightning_run(args, data, variant, use_gpu)
    )
    if dist.get_rank() == 0:
        params = sum(p.numel() for p in make_gpt(args).parameters())
        zero3 = 16 * params / n
        med = {v: statistics.median(times[v]) for v in VARIANTS}
        ddp_sent = measured["ddp_tuned"]["sent"]
        write_result(
            args.result,
            {
                "config": {
                    "devices": n,
                    "backend": backend,
                    "params": params,
                    "dim": args.dim,
                    "layers": args.layers,
                    "seq": args.seq,
                    "batch_size": args.batch_size,
                    "steps": args.steps,
                    "repeats": args.repeats,
                    "zero3_bytes": zero3,
                },
                "variants": {
                    v: {
                        "median_step_s": med[v],
                        "samples_per_s": args.batch_size * n / med[v],
                        "ratio_vs_lightning_mp": med[v] / med["lightning_mp"],
                        "state_bytes": measured[v]["state"]["total"],
                        "state_vs_zero3": measured[v]["state"]["total"] / zero3,
                        "sent_bytes_per_step": measured[v]["sent"],
                        "sent_vs_ddp": measured[v]["sent"] / ddp_sent if ddp_sent else float("nan"),
                    }
                    for v in VARIANTS
                },
                "collectives": {v: measured[v]["counts"] for v in VARIANTS},
                "per_repeat": {v: [round(t, 5) for t in times[v]] for v in VARIANTS},
            },
        )
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _lightning_run(args, data, variant, use_gpu) -> tuple[list[float], dict]:
    import torch.distributed as dist
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.utils.data import DataLoader, DistributedSampler

    from lit_parallel import TransformerFSDPStrategy, TunedDDPStrategy
    from lit_parallel.commands.bench.common import StepProbe, bench_trainer
    from lit_parallel.parallel.memory import training_state_bytes

    n = dist.get_world_size()
    if variant == "fsdp_blocks":
        strategy = TransformerFSDPStrategy()
    elif variant == "lightning_mp":
        strategy = ModelParallelStrategy(data_parallel_size=n, tensor_parallel_size=1)
    else:
        strategy = TunedDDPStrategy()
    probe = StepProbe(args.warmup, use_gpu)
    trainer = bench_trainer(args, strategy, use_gpu, [probe])
    module = _lightning_module(args, hand_sharded=variant == "lightning_mp")
    sampler = DistributedSampler(data, num_replicas=n, rank=dist.get_rank(), seed=0)
    trainer.fit(module, DataLoader(data, batch_size=args.batch_size, sampler=sampler))
    state = training_state_bytes(module, trainer.optimizers[0])
    steps = probe.step_times
    return steps, {"state": state, "sent": probe.sent, "counts": probe.counts}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m lit_parallel.commands.bench.fsdp")
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
