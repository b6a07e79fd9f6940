"""The ``lit-parallel`` command.

Subcommands live in their own modules; this file only wires them: each benchmark is a module in
:mod:`lit_parallel.commands.bench` with ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from lit_parallel.commands.extras import MissingExtraError

# name -> (module, one-line help)
BENCHMARKS = {
    "ddp": ("lit_parallel.commands.bench.ddp", "ddp_tuned vs Lightning's ddp vs a plain PyTorch DDP loop"),
    "fsdp": (
        "lit_parallel.commands.bench.fsdp",
        "fsdp_blocks vs Lightning's ModelParallelStrategy (hand-written configure_model) vs ddp_tuned",
    ),
    "tp": (
        "lit_parallel.commands.bench.tp",
        "tp_dp (tensor + data parallel) vs fsdp_blocks on the same model",
    ),
    "pp": (
        "lit_parallel.commands.bench.pp",
        "pipeline bubble per rank vs (P-1)/(M+P-1), GPipe and 1F1B, timeline plot",
    ),
    "ep": (
        "lit_parallel.commands.bench.ep",
        "fsdp_blocks with vs without expert parallelism on an MoE model: bytes per collective, step time, plot",
    ),
    "checkpoint": (
        "lit_parallel.commands.bench.checkpoint",
        "training blocked per checkpoint save, synchronous vs async_checkpoint vs Lightning's AsyncCheckpointIO",
    ),
    "dry-run": (
        "lit_parallel.commands.bench.dry_run",
        "seconds advise --dry-run takes per strategy and cluster size (2 to 4096 ranks) on a Llama-70B shape",
    ),
    "callbacks": (
        "lit_parallel.commands.bench.callbacks",
        "cost of SetEpochCheck, CrossRankMetrics, PitfallReport and SyncBatchNormConversion per step and epoch",
    ),
    "all": (
        "lit_parallel.commands.bench",
        "the strategy benchmarks (ddp, fsdp, tp) in one go: one JSON file and PNG plots (matplotlib)",
    ),
}

COMMANDS = {
    "demo": (
        "lit_parallel.commands.demo",
        "short 2-process CPU training run with a summary of what was chosen",
    ),
    "consolidate": (
        "lit_parallel.commands.consolidate",
        "convert a sharded checkpoint into one full state_dict file",
    ),
    "doctor": (
        "lit_parallel.commands.doctor",
        "check this machine for distributed training: versions, all-reduce, bandwidth",
    ),
    "advise": (
        "lit_parallel.commands.advise.command",
        "per-rank peak memory and step time of every strategy for a model and cluster, and which to use",
    ),
    "lab": (
        "lit_parallel.commands.lab",
        "the tutorials' experiments (scaling, set-epoch, communication, memory, unused-parameters): CSV + PNG",
    ),
}


def _selected(argv: list[str]) -> tuple[str | None, str | None]:
    """The command (and benchmark) named in ``argv``: only their modules are imported."""
    words = [a for a in argv if not a.startswith("-")]
    command = words[0] if words else None
    return command, (words[1] if command == "bench" and len(words) > 1 else None)


def _add(sub, name: str, module: str, help_text: str, selected: bool) -> None:
    p = sub.add_parser(name, help=help_text, description=help_text)
    if selected:  # importing a command pulls in torch and Lightning: only for the one that runs
        mod = importlib.import_module(module)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser for ``argv`` (default ``sys.argv[1:]``), with the selected command's arguments."""
    command, benchmark = _selected(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="lit-parallel", description="Fast, correct multi-device training for PyTorch Lightning."
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"%(prog)s {importlib.import_module('lit_parallel').__version__}",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        _add(sub, name, module, help_text, name == command)
    bench = sub.add_parser("bench", help="benchmarks (median step time, bytes communicated, throughput)")
    bench_sub = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for name, (module, help_text) in BENCHMARKS.items():
        _add(bench_sub, name, module, help_text, command == "bench" and name == benchmark)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser(argv).parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except (ValueError, RuntimeError, OSError, MissingExtraError) as err:  # a clear message, not a traceback
        print(f"lit-parallel {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
