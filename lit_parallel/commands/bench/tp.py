"""`lit-parallel bench tp`: tp_dp (tensor + data parallel) vs fsdp_blocks on the same model, in one run.

Every variant trains the same GPT-style transformer (fused qkv, GELU MLP; AdamW) on the same global
batches: ``fsdp_blocks`` shards every block over all ranks (each rank reads different samples);
``tp_dp`` splits every block over ``--tensor-parallel-size`` ranks (the ranks of a tensor-parallel group
read the same samples, so each data-parallel rank takes a larger share of the global batch);
``tp_dp_sp`` adds sequence parallelism.

Step time is the wall time between consecutive batch ends after warm-up steps; each repeat gives a
median, and the table shows the median over repeats, with the order of variants rotated between
repeats. Parameter bytes are what one rank holds after setup (local shards); bytes sent and collectives
are counted on one rank for the last warm-up step (forward, backward, optimizer step).
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from lit_parallel.commands.launch import add_worker_arguments

VARIANTS = ("tp_dp", "tp_dp_sp", "fsdp_blocks")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", type=int, default=2, help="ranks (processes) to run (default 2)")
    p.add_argument("--accelerator", choices=("cpu", "gpu"), default="cpu", help="cpu (gloo) or gpu (nccl)")
    p.add_argument(
        "--tensor-parallel-size", type=int, default=0, help="TP degree of tp_dp (default: --devices)"
    )
    p.add_argument("--dim", type=int, default=256, help="model width (default 256)")
    p.add_argument(
        "--layers", type=int, default=4, help="transformer blocks (default 4: about 3.7M parameters)"
    )
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--vocab", type=int, default=1024, help="vocabulary size (default 1024)")
    p.add_argument("--seq", type=int, default=64, help="sequence length (default 64)")
    p.add_argument(
        "--global-batch", type=int, default=16, help="sequences per optimizer step, all ranks (16)"
    )
    p.add_argument("--steps", type=int, default=10, help="timed steps per repeat (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per repeat, at least 2 (default 3)")
    p.add_argument("--repeats", type=int, default=3, help="repeats of every variant (default 3)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    add_worker_arguments(p)


def _check(args: argparse.Namespace) -> int:
    tp = args.tensor_parallel_size or args.devices
    if args.repeats < 1 or args.steps < 1 or args.warmup < 2:
        raise ValueError("--repeats and --steps must be at least 1, --warmup at least 2")
    if args.devices % tp:
        raise ValueError(f"--tensor-parallel-size={tp} must divide --devices={args.devices}")
    if args.heads % tp or args.dim % args.heads:
        raise ValueError(
            f"--heads={args.heads} must divide --dim={args.dim} and be divisible by the TP size {tp}"
        )
    if args.global_batch % args.devices:
        raise ValueError(f"--global-batch={args.global_batch} must be a multiple of --devices={args.devices}")
    if args.seq % tp:
        raise ValueError(f"--seq={args.seq} must be divisible by the TP size {tp} (sequence parallelism)")
    return tp


def run(args: argparse.Namespace) -> int:
    if args.worker:
        return _worker(args)
    tp = _check(args)
    from lit_parallel.commands.bench.common import launch_and_report

    keys = (
        "accelerator",
        "dim",
        "layers",
        "heads",
        "vocab",
        "seq",
        "global_batch",
        "steps",
        "warmup",
        "repeats",
    )
    forwarded = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in keys]
    forwarded += [f"--devices={args.devices}", f"--tensor-parallel-size={tp}"]
    return launch_and_report("lit_parallel.commands.bench.tp", args, forwarded, print_report)


def print_report(result: dict[str, Any]) -> None:
    from lit_parallel.commands.terminal import Column, fit_table, terminal_console
    from lit_parallel.formatting import format_bytes

    cfg = result["config"]
    title = (
        f"bench tp: {cfg['params'] / 1e6:.2f}M-parameter GPT ({cfg['layers']} blocks, dim {cfg['dim']},"
        f" {cfg['heads']} heads), {cfg['devices']} ranks ({cfg['backend']}), global batch"
        f" {cfg['global_batch']}x{cfg['seq']} tokens, AdamW, median of {cfg['repeats']} repeats x"
        f" {cfg['steps']} steps"
    )
    headers = ("step (ms)", "samples/s", "vs fsdp_blocks", "params/rank", "sent/step")
    columns = [Column("variant"), Column("mesh (dp x tp)"), *(Column(h, "right") for h in headers)]
    rows = []
    for name in VARIANTS:
        v = result["variants"][name]
        rows.append(
            [
                name,
                v["mesh"],
                f"{v['median_step_s'] * 1e3:.1f}",
                f"{v['samples_per_s']:.1f}",
                f"{v['ratio_vs_fsdp']:.3f}",
                format_bytes(v["param_bytes"]),
                format_bytes(v["sent_bytes_per_step"]),
            ]
        )
    console = terminal_console()
    console.print(fit_table(columns, rows, width=console.width, title=title))
    for name in VARIANTS:
        console.print(f"collectives per step, {name}: {result['variants'][name]['collectives']}")
    console.print(f"per-repeat medians (s): {result['per_repeat']}")


# ----------------------------------------------------------------------------------------- ranks


def _worker(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from lit_parallel.commands.bench.common import make_gpt, time_variants, token_dataset
    from lit_parallel.commands.launch import init_ranks, write_result

    use_gpu = init_ranks(args.accelerator).type == "cuda"
    backend = dist.get_backend()
    n = dist.get_world_size()
    data = token_dataset(args.vocab, args.seq, args.global_batch * (args.warmup + args.steps))
    times, measured = time_variants(
        VARIANTS, args.repeats, args.warmup, lambda variant: _lightning_run(args, data, variant, use_gpu)
    )
    if dist.get_rank() == 0:
        med = {v: statistics.median(times[v]) for v in VARIANTS}
        write_result(
            args.result,
            {
                "config": {
                    "devices": n,
                    "backend": backend,
                    "params": sum(p.numel() for p in make_gpt(args).parameters()),
                    "dim": args.dim,
                    "heads": args.heads,
                    "layers": args.layers,
                    "seq": args.seq,
                    "global_batch": args.global_batch,
                    "steps": args.steps,
                    "repeats": args.repeats,
                    "tensor_parallel_size": args.tensor_parallel_size,
                },
                "variants": {
                    v: {
                        "mesh": measured[v]["mesh"],
                        "median_step_s": med[v],
                        "samples_per_s": args.global_batch / med[v],
                        "ratio_vs_fsdp": med[v] / med["fsdp_blocks"],
                        "param_bytes": measured[v]["param_bytes"],
                        "sent_bytes_per_step": measured[v]["sent"],
                        "collectives": measured[v]["counts"],
                    }
                    for v in VARIANTS
                },
                "per_repeat": {v: [round(t, 5) for t in times[v]] for v in VARIANTS},
            },
        )
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _lightning_run(args, data, variant, use_gpu) -> tuple[list[float], dict]:
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from lit_parallel import TensorParallelStrategy, TransformerFSDPStrategy
    from lit_parallel.commands.bench.common import GPTBench, StepProbe, bench_trainer
    from lit_parallel.parallel import local_parameter_bytes

    n = dist.get_world_size()
    tp = args.tensor_parallel_size if variant != "fsdp_blocks" else 1
    if variant == "fsdp_blocks":
        strategy = TransformerFSDPStrategy()
    else:
        strategy = TensorParallelStrategy(tensor_parallel_size=tp, sequence_parallel=variant == "tp_dp_sp")
    probe = StepProbe(args.warmup, use_gpu)
    trainer = bench_trainer(args, strategy, use_gpu, [probe])
    module = GPTBench(args)
    # The same global batch for every variant: each data-parallel rank takes 1/dp of it (Lightning's
    # sampler shards over the data-parallel ranks only).
    trainer.fit(module, DataLoader(data, batch_size=args.global_batch // (n // tp)))
    steps = probe.step_times
    info = {
        "mesh": f"{n // tp} x {tp}",
        "param_bytes": sum(local_parameter_bytes(module).values()),
        "sent": probe.sent,
        "counts": probe.counts,
    }
    return steps, info


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m lit_parallel.commands.bench.tp")
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
