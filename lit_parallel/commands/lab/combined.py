"""`lab all`: every experiment's 2-rank part in one launch, so that start-up is paid once.

The ranks run each named experiment's ``compute`` in turn (the plain-PyTorch ones first, then those
that start a Lightning Trainer, which reuses the process group); rank 0 writes all results, and the
parent hands each experiment its part (``run(out, quick, result=...)``).
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

from lit_parallel.commands.lab.common import run_worker
from lit_parallel.commands.launch import add_worker_arguments

# the order the ranks run them in; scaling's part is its 2-rank run
ORDER = ("set-epoch", "communication", "scaling", "memory", "unused-parameters")


def compute(args: argparse.Namespace) -> dict[str, Any]:
    from lit_parallel.commands.lab import EXPERIMENTS

    results = {}
    for name in sorted(args.experiments.split(","), key=ORDER.index):
        module = importlib.import_module(EXPERIMENTS[name][0])
        results[name] = module.compute(module.parser().parse_args(module.worker_args(args.quick)))
    return results


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lit_parallel.commands.lab.combined")
    add_worker_arguments(p)
    p.add_argument("--experiments", default=",".join(ORDER))
    p.add_argument("--quick", action="store_true")
    return p


if __name__ == "__main__":
    raise SystemExit(run_worker(compute, parser().parse_args()))
