"""The ``lit-parallel`` command.

Subcommands live in their own modules; this file only wires them: each benchmark is a module in
:mod:`lit_parallel.bench` with ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). Later issues add their benchmarks here.
BENCHMARKS = {
    "ddp": ("lit_parallel.bench.ddp", "ddp_tuned vs Lightning's ddp vs a plain PyTorch DDP loop"),
}

COMMANDS = {
    "demo": ("lit_parallel.demo", "short 2-process CPU training run with a summary of what was chosen"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lit-parallel", description="Fast, correct multi-device training for PyTorch Lightning."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod = importlib.import_module(module)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    bench = sub.add_parser("bench", help="benchmarks (median step time, bytes communicated, throughput)")
    bench_sub = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for name, (module, help_text) in BENCHMARKS.items():
        p = bench_sub.add_parser(name, help=help_text, description=help_text)
        mod = importlib.import_module(module)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except (ValueError, RuntimeError) as err:
        print(f"lit-parallel {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
