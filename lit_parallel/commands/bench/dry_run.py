"""``lit-parallel bench dry-run``: how long ``advise --dry-run`` takes, per strategy and cluster size.

One process times :func:`lit_parallel.strategies.dry_run.dry_run` (every distinct rank position, no step)
for layouts from 2 to 4096 ranks on a model built on the meta device: by default a Llama-70B-shaped
``transformers`` model (80 layers, width 8192, 64 heads, 8 key/value heads, feed-forward 28672, vocabulary
128256). Each layout is timed ``--repeats`` times, rotating through the layouts; the table gives the median.
``--one-core`` pins the process to one CPU core first (the timing the documentation quotes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from lit_parallel.formatting import format_bytes

LLAMA_70B = dict(
    hidden_size=8192,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    intermediate_size=28672,
    vocab_size=128256,
)
TINY = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    intermediate_size=96,
    vocab_size=256,
)
MODELS = {"llama-70b": LLAMA_70B, "tiny": TINY}

# (strategy, arguments, devices per node, nodes)
LAYOUTS: list[tuple[str, dict[str, Any], int, int]] = [
    ("fsdp_blocks", {}, 2, 1),
    ("fsdp_blocks", {}, 8, 1),
    ("fsdp_blocks", {}, 8, 8),
    ("fsdp_blocks", {}, 8, 64),
    ("fsdp_blocks", {}, 8, 512),
    ("hsdp", {}, 8, 8),
    ("hsdp", {}, 8, 512),
    ("tp_dp", {"tensor_parallel_size": 8}, 8, 1),
    ("tp_dp", {"tensor_parallel_size": 8}, 8, 64),
    ("tp_dp", {"tensor_parallel_size": 8}, 8, 512),
    ("pp_dp", {"pipeline_parallel_size": 4, "tensor_parallel_size": 8, "microbatches": 8}, 8, 4),
    ("pp_dp", {"pipeline_parallel_size": 4, "tensor_parallel_size": 8, "microbatches": 8}, 8, 128),
    ("pp_dp", {"pipeline_parallel_size": 4, "tensor_parallel_size": 8, "microbatches": 8}, 8, 512),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", choices=tuple(MODELS), default="llama-70b", help="the model (default llama-70b)"
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="timings per layout; the median is reported (default 3)"
    )
    p.add_argument("--one-core", action="store_true", help="pin this process to one CPU core before timing")
    p.add_argument(
        "--max-world",
        type=int,
        default=4096,
        help="leave out layouts of more ranks than this (default 4096: all of them)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")


def _factory(config: dict[str, Any]):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    def build():
        with torch.device("meta"):
            return LlamaForCausalLM(LlamaConfig(**config))

    return build


def _one_core() -> int:
    import torch

    core = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    return core


def run(args: argparse.Namespace) -> int:
    from lit_parallel.strategies.dry_run import dry_run

    if args.repeats < 1:
        raise ValueError(f"--repeats={args.repeats} must be at least 1")
    if args.max_world < 2:
        raise ValueError(f"--max-world={args.max_world} must be at least 2")
    core = _one_core() if args.one_core else None
    factory = _factory(MODELS[args.model])
    layouts = [x for x in LAYOUTS if x[2] * x[3] <= args.max_world]
    times: dict[int, list[float]] = {i: [] for i in range(len(layouts))}
    results: dict[int, Any] = {}
    for _ in range(args.repeats):
        for i, (strategy, kwargs, devices, nodes) in enumerate(layouts):
            start = time.perf_counter()
            result = dry_run(factory, strategy, devices=devices, num_nodes=nodes, strategy_kwargs=kwargs)
            times[i].append(time.perf_counter() - start)
            if result.error is not None:
                raise RuntimeError(f"{strategy}{kwargs} on {devices * nodes} ranks failed: {result.error}")
            results[i] = result
    rows = []
    for i, (strategy, kwargs, devices, nodes) in enumerate(layouts):
        r = results[i]
        largest = r.largest
        rows.append(
            {
                "strategy": strategy,
                "kwargs": kwargs,
                "world_size": devices * nodes,
                "mesh": r.mesh,
                "positions": len(r.ranks),
                "median_s": statistics.median(times[i]),
                "times_s": times[i],
                "largest_rank_state_bytes": largest.state_bytes if largest is not None else None,
            }
        )
    print_report(rows, args.model, core)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"model": args.model, "one_core": core is not None, "rows": rows}, indent=2)
        )
    return 0


def print_report(rows: list[dict[str, Any]], model: str, core: int | None) -> None:
    from lit_parallel.commands.terminal import Column, fit_table, terminal_console

    console = terminal_console()
    where = f"one CPU core (core {core})" if core is not None else "all CPU cores"
    console.print(f"[bold]lit-parallel bench dry-run[/bold]: {model}, every distinct rank position, {where}")
    table = [
        [
            r["strategy"]
            + (f"({', '.join(f'{k}={v}' for k, v in r['kwargs'].items())})" if r["kwargs"] else ""),
            f"{r['world_size']:,}",
            str(r["positions"]),
            f"{r['median_s']:.2f}",
            f"{r['median_s'] / r['positions']:.2f}",
            format_bytes(r["largest_rank_state_bytes"] or 0, decimal=True),
        ]
        for r in rows
    ]
    columns = [Column("strategy", wrap=True)] + [
        Column(h, "right")
        for h in ("ranks", "positions", "median s", "s per position", "largest rank's state")
    ]
    console.print(
        fit_table(columns, table, width=console.width, title="dry-run time (median of the repeats)")
    )
