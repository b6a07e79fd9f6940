"""`lit-parallel lab`: the exercises distributed-training tutorials end with, run and plotted.

Each experiment is a module here with ``run(out, quick) -> [files]``; it launches CPU ranks (gloo), writes
CSV files and PNG plots into ``out``, and finishes in minutes on a laptop (``--quick``: the smallest
size, what the tests run). The documentation has a page per experiment (docs/lab/), with the plots this
command makes (``python docs/hooks/lab_plots.py`` rebuilds them).
"""

from __future__ import annotations

import argparse
import importlib
import time
from pathlib import Path

from lit_parallel.commands.extras import require_extra

# name -> (module, what it shows)
EXPERIMENTS = {
    "scaling": (
        "lit_parallel.commands.lab.scaling",
        "1, 2, 4 processes at equal global batch; the learning-rate scaling rule",
    ),
    "set-epoch": (
        "lit_parallel.commands.lab.set_epoch",
        "data order and loss with sampler.set_epoch called vs forgotten",
    ),
    "communication": (
        "lit_parallel.commands.lab.communication",
        "share of a DDP step spent in exposed communication vs batch, bucket size and compression",
    ),
    "memory": (
        "lit_parallel.commands.lab.memory",
        "per-rank memory of ddp_tuned, ZeRO-2, fsdp_blocks, tp_dp as the model grows, next to advise's prediction",
    ),
    "unused-parameters": (
        "lit_parallel.commands.lab.unused_parameters",
        "cost of find_unused_parameters=True vs ddp_tuned's probe decision",
    ),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("experiment", nargs="?", help=f"one of {', '.join(EXPERIMENTS)}, or 'all'")
    p.add_argument("--list", action="store_true", help="name every experiment and what it shows")
    p.add_argument(
        "--out", default="lab-results", help="folder for the CSV files and PNG plots (default lab-results)"
    )
    p.add_argument(
        "--quick", action="store_true", help="the smallest size of each experiment (about a minute each)"
    )


def run(args: argparse.Namespace) -> int:
    if args.list or not args.experiment:
        for name, (_, what) in EXPERIMENTS.items():
            print(f"{name:<18} {what}")
        print("\nrun one: lit-parallel lab NAME --out DIR; all: lit-parallel lab all --out DIR")
        return 0
    names = list(EXPERIMENTS) if args.experiment == "all" else [args.experiment]
    unknown = [n for n in names if n not in EXPERIMENTS]
    if unknown:
        raise ValueError(f"no experiment {unknown[0]!r}; choose one of {', '.join(EXPERIMENTS)} or 'all'")
    require_extra("bench", "the plots lit-parallel lab draws")  # before any rank starts or a file is written
    out = Path(args.out)
    shared: dict[str, dict] = {}
    if len(names) > 1:  # every 2-rank part in one launch (lab/combined.py): start-up is paid once
        from lit_parallel.commands.lab.common import launch

        start = time.perf_counter()
        argv = [f"--experiments={','.join(names)}", *(["--quick"] if args.quick else [])]
        shared = launch("lit_parallel.commands.lab.combined", 2, argv, timeout=3600)
        print(f"2-rank runs of {', '.join(names)}: {time.perf_counter() - start:.0f} s")
    for name in names:
        start = time.perf_counter()
        module = importlib.import_module(EXPERIMENTS[name][0])
        files = module.run(out, quick=args.quick, result=shared.get(name))
        print(f"{name}: {time.perf_counter() - start:.0f} s: " + ", ".join(str(f) for f in files))
    return 0
