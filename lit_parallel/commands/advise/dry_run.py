"""`lit-parallel advise --dry-run`: the strategies' real setup on a simulated cluster, and what each rank holds.

For a model (``--model``, built on the meta device) and a cluster shape (``--nodes`` x ``--devices``, any size),
each strategy's setup runs in this process as every distinct rank position of the cluster
(:func:`lit_parallel.strategies.dry_run.dry_run`). The report per strategy: the mesh, each position's
parameter, gradient and optimizer bytes read from the parameters' placements (the padding of uneven shards
included), the planner's formula for the largest rank next to it, what tensor parallelism split and what it
replicated, the pipeline stages, and the error the real setup would raise, with its fix.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

from rich.markup import escape

from lit_parallel.formatting import format_bytes

# a pipeline stage holding this many times the lightest one's state is reported as uneven
UNEVEN_STAGES = 1.5
STRATEGY_CHOICES = ("ddp_tuned", "fsdp_blocks", "hsdp", "tp_dp", "pp_dp", "auto_parallel")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The dry run's options (with ``--dry-run``)."""
    g = p.add_argument_group("dry run (--dry-run, with --model)")
    g.add_argument(
        "--dry-run",
        action="store_true",
        help="run each strategy's real setup on a simulated cluster of --nodes x --devices ranks (no GPU, no"
        " communication, the model on the meta device) and report what every rank holds",
    )
    g.add_argument(
        "--strategy",
        action="append",
        choices=STRATEGY_CHOICES,
        help="a strategy to dry-run (repeat for several; default: all; pp_dp needs --pipeline-parallel-size)",
    )
    g.add_argument(
        "--tensor-parallel-size", type=int, default=None, help="tp_dp's and pp_dp's tensor_parallel_size"
    )
    g.add_argument("--pipeline-parallel-size", type=int, default=None, help="pp_dp's pipeline_parallel_size")
    g.add_argument("--microbatches", type=int, default=None, help="pp_dp's microbatches (default 2 x stages)")
    g.add_argument(
        "--expert-parallel-size",
        type=int,
        default=None,
        help="expert_parallel_size of fsdp_blocks, tp_dp and pp_dp (a model with MoE layers)",
    )
    g.add_argument(
        "--step",
        action="store_true",
        help="also run one training step (AdamW) of the first rank on fake tensors (shapes only, no memory) and"
        " report its peak by category, torch's MemTracker counting, beside advise's prediction (micro-batch:"
        " --batch-size, --seq-len; not for pp_dp)",
    )
    g.add_argument(
        "--rank",
        type=int,
        action="append",
        dest="ranks",
        help="dry-run this global rank (repeat for several; default: every distinct position: each pipeline"
        " stage, the first and last rank of every other mesh dimension)",
    )


def strategy_kwargs(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Each strategy's arguments from the size options; a strategy that cannot run without one is left out."""
    tp, pp, ep = args.tensor_parallel_size, args.pipeline_parallel_size, args.expert_parallel_size
    for name, value in (
        ("--tensor-parallel-size", tp),
        ("--pipeline-parallel-size", pp),
        ("--microbatches", args.microbatches),
        ("--expert-parallel-size", ep),
    ):
        if value is not None and value < 1:
            raise ValueError(f"{name}={value} must be at least 1")
    ep_kw = {"expert_parallel_size": ep} if ep is not None else {}
    kwargs: dict[str, dict[str, Any]] = {
        "ddp_tuned": {},
        "fsdp_blocks": dict(ep_kw),
        "hsdp": {},
        "tp_dp": {**({"tensor_parallel_size": tp} if tp is not None else {}), **ep_kw},
        "auto_parallel": {},
    }
    if pp is not None:
        kwargs["pp_dp"] = {
            "pipeline_parallel_size": pp,
            "microbatches": args.microbatches or 2 * pp,
            **({"tensor_parallel_size": tp} if tp is not None else {}),
            **ep_kw,
        }
    return kwargs


def _factory(path: str, kwargs: dict[str, Any]):
    from lit_parallel.planner.model_summary import build_on_meta, load_model_class

    cls = load_model_class(path)
    return lambda: build_on_meta(cls, kwargs)


def _patterns(names: list[str]) -> str:
    """Parameter names with block indices folded (``model.layers.*.input_layernorm.weight``), with counts."""
    counts = Counter(re.sub(r"\.\d+\.", ".*.", n) for n in names)
    return ", ".join(f"{n} (x{c})" if c > 1 else n for n, c in counts.items())


def _formula(run: Any, module: Any, precision: str) -> Any:
    from lit_parallel.planner.memory.rank_state import predicted_state

    if run.error is not None or not run.ranks:
        return None
    try:
        return predicted_state(run.strategy, module, run.sizes, precision=precision, pipeline=run.kwargs)
    except Exception as err:  # noqa: BLE001 - reported beside the dry run, which stands on its own
        return f"{type(err).__name__}: {err}"


def _folded(error: str, keep: int = 6) -> str:
    """A long error (one line per layer) cut to its first ``keep`` lines and its last (the fix); whole in --json."""
    lines = error.splitlines()
    if len(lines) <= keep + 2:
        return error
    return "\n".join(
        [*lines[:keep], f"  ... ({len(lines) - keep - 1} more lines: --json has them all)", lines[-1]]
    )


def _label(run: Any) -> str:
    args = ", ".join(f"{k}={v!r}" for k, v in run.kwargs.items())
    return f"{run.strategy}({args})" if args else run.strategy


def _planner_peaks(args: argparse.Namespace, model_kwargs: dict[str, Any]):
    """advise's predicted peak per strategy for the same micro-batch (CUDA devices), as a function of a run."""
    from lit_parallel.commands.advise.report import predict

    pred = predict(
        args.model,
        model_kwargs,
        precision=args.precision,
        devices=args.devices,
        nodes=args.nodes,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        device_type="cuda",
        step_time=False,
        busbw_gbps=None,
    )
    peaks = pred.report.peaks

    def of(run: Any) -> Any:
        # the planner's rows are for fsdp_blocks/hsdp over the cluster and tp_dp over the devices of a node
        if run.strategy == "ddp_tuned":
            return peaks.get("ddp_tuned")
        if run.strategy == "tp_dp" and run.sizes.get("tensor_parallel") != args.devices:
            return None
        if run.sizes.get("expert_parallel", 1) > 1 or run.strategy not in peaks:
            return None
        return peaks[run.strategy]

    return of


def _print_step(console: Any, run: Any, entry: dict[str, Any], planner: Any) -> None:
    step = run.step
    if step is None:
        console.print(f"  [yellow]step[/yellow]: {escape(run.step_note or 'not measured')}")
        return
    cats = ", ".join(f"{k} {format_bytes(v, decimal=True)}" for k, v in step.by_category.items() if v)
    counter = (
        "torch's MemTracker"
        if step.counter == "MemTracker"
        else "lit_parallel's LiveMemory (no MemTracker here)"
    )
    console.print(
        f"  one step of rank {run.ranks[0].rank} on fake tensors ({escape(step.input_description)}), {counter}:"
        f" peak {format_bytes(step.total, decimal=True)} ({cats}); lit_parallel's LiveMemory:"
        f" {format_bytes(step.live_memory, decimal=True)}"
    )
    if planner is not None:
        gap = (step.total - planner.total) / planner.total if planner.total else 0.0
        console.print(
            f"  advise's prediction for the same step: {format_bytes(planner.total, decimal=True)} ({planner.phase});"
            f" the dry run is {gap:+.1%} from it"
        )
        entry["planner_peak_bytes"] = planner.total
    if run.step_note:
        console.print(f"  [dim]{escape(run.step_note)}[/dim]")


def run(args: argparse.Namespace, model_kwargs: dict[str, Any]) -> int:
    """``advise --dry-run``: every chosen strategy dry-run, printed (and written with ``--json``)."""
    from lit_parallel.commands.terminal import terminal_console
    from lit_parallel.strategies.dry_run import dry_run

    if not args.model:
        raise ValueError(
            "--dry-run needs --model IMPORT.PATH:Class: it runs the strategies' setup on that model"
        )
    if args.verify:
        raise ValueError(
            "--dry-run and --verify are two runs: --verify trains here, --dry-run simulates a cluster"
        )
    console = terminal_console()
    factory = _factory(args.model, model_kwargs)
    module = factory()
    world = args.devices * args.nodes
    kwargs = strategy_kwargs(args)
    names = args.strategy or list(STRATEGY_CHOICES)
    params = sum(p.numel() for p in dict.fromkeys(module.parameters()))
    console.print(
        f"[bold]lit-parallel advise --dry-run[/bold]: {escape(type(module).__name__)} ({params:,} parameters) on"
        f" {args.nodes} node(s) x {args.devices} device(s) = {world} simulated ranks; precision {args.precision};"
        " each strategy's own setup on the meta device, no communication"
    )
    out: list[dict[str, Any]] = []
    predicted = _planner_peaks(args, model_kwargs) if args.step else None
    for name in names:
        if name not in kwargs:
            console.print(f"[yellow]{name}: skipped[/yellow]: give --pipeline-parallel-size to dry-run pp_dp")
            continue
        run_ = dry_run(
            factory,
            name,
            devices=args.devices,
            num_nodes=args.nodes,
            precision=args.precision,
            strategy_kwargs=kwargs[name],
            ranks=args.ranks or "positions",
            memory_gb=args.memory_gb or 80.0,
            step=args.step,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
        )
        entry = {**run_.as_dict(), "label": _label(run_)}
        out.append(entry)
        title = f"{'auto_parallel -> ' if name == 'auto_parallel' else ''}{_label(run_)}"
        console.print(f"\n[bold]{escape(title)}[/bold]" + (f": {escape(run_.mesh)}" if run_.mesh else ""))
        if run_.decision:
            console.print(f"  {escape(run_.decision)}")
        if run_.error:
            console.print(f"  [red]setup fails[/red]: {escape(_folded(run_.error))}")
            continue
        _print_ranks(console, run_)
        _print_formula(console, run_, _formula(run_, module, args.precision), entry)
        if run_.sizes.get("tensor_parallel", 1) > 1:
            _print_tensor_parallel(console, run_, entry)
        if run_.sizes.get("pipeline_parallel", 1) > 1:
            _print_stages(console, run_, entry)
        if predicted is not None:
            _print_step(console, run_, entry, predicted(run_))
        for line in run_.log:
            console.print(f"[dim]  {escape(line)}[/dim]")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"dry_run": {"model": args.model, "world_size": world, "runs": out}}, indent=2)
        )
    return 0


def _print_ranks(console: Any, run: Any) -> None:
    """The table of each rank position's state."""
    from lit_parallel.commands.terminal import Column, fit_table

    rows = [
        [
            str(r.rank),
            ", ".join(f"{k}={v}" for k, v in r.coordinates.items()) or "-",
            *(
                format_bytes(x, decimal=True)
                for x in (r.param_bytes, r.grad_bytes, r.optimizer_bytes, r.state_bytes)
            ),
            f"{r.padding_elements:,}",
        ]
        for r in run.ranks
    ]
    columns = [Column("rank", "right"), Column("position", wrap=True)]
    columns += [
        Column(h, "right") for h in ("params", "grads", "optimizer", "model state", "padding (elements)")
    ]
    title = f"{len(run.ranks)} rank(s), dry-run in {run.seconds:.1f} s"
    console.print(fit_table(columns, rows, width=console.width, title=title))


def _print_formula(console: Any, run: Any, formula: Any, entry: dict[str, Any]) -> None:
    """The planner's formula for the largest rank, next to what the dry run found (``formula``: a
    :class:`~lit_parallel.planner.memory.rank_state.StateFormula`, or why there is none)."""
    if isinstance(formula, str):
        console.print(f"  [yellow]no formula[/yellow]: {escape(formula)}")
        return
    if formula is None:
        return
    largest = run.largest.state_bytes
    same = formula.state_bytes == largest
    gap = format_bytes(abs(formula.state_bytes - largest), decimal=True)
    verdict = "[green]equal[/green]" if same else f"[red]differs by {gap}[/red]"
    console.print(
        f"  planner's formula for the largest rank: {format_bytes(formula.state_bytes, decimal=True)}"
        f" (ZeRO's accounting: params {format_bytes(formula.param_bytes, decimal=True)}, grads"
        f" {format_bytes(formula.grad_bytes, decimal=True)}, optimizer"
        f" {format_bytes(formula.optimizer_bytes, decimal=True)}): {verdict}"
    )
    entry["formula"] = {
        "param_bytes": formula.param_bytes,
        "grad_bytes": formula.grad_bytes,
        "optimizer_bytes": formula.optimizer_bytes,
        "state_bytes": formula.state_bytes,
        "equal": same,
    }


def _print_tensor_parallel(console: Any, run: Any, entry: dict[str, Any]) -> None:
    """What tensor parallelism split and what it replicated, on the rank holding the most."""
    split, replicated = run.largest.split_and_replicated("tensor_parallel")
    console.print(f"  tensor parallel splits {len(split)} parameter(s): {escape(_patterns(split))}")
    console.print(f"  and replicates {len(replicated)}: {escape(_patterns(replicated)) or '-'}")
    entry["tensor_parallel"] = {"split": split, "replicated": replicated}
    if not split:
        console.print(
            f"  [red]tensor parallelism splits no parameter[/red]: each of the {run.sizes['tensor_parallel']}"
            " tensor-parallel ranks holds a whole replica (the plan found no layer to split: see its note"
            " below); pass block_types= naming the model's block class, or plan={...}"
        )


def _print_stages(console: Any, run: Any, entry: dict[str, Any]) -> None:
    """The pipeline stage holding the most, and whether the stages are uneven."""
    stages: dict[int, int] = {}
    for r in run.ranks:
        stage = r.coordinates.get("pipeline_parallel", 0)
        stages[stage] = max(stages.get(stage, 0), r.state_bytes)
    heavy = max(stages, key=lambda s: stages[s])
    lightest = min(stages.values())
    console.print(
        f"  largest pipeline stage: {heavy} ({format_bytes(stages[heavy], decimal=True)} per rank,"
        f" x{stages[heavy] / lightest:.2f} the lightest)"
    )
    if stages[heavy] >= UNEVEN_STAGES * lightest:
        console.print(
            "  [yellow]uneven stages[/yellow]: the slowest stage sets the pace of every step; give"
            " split=\\[...] (the blocks where stages 2, 3, ... start) or a pipeline_parallel_size that divides"
            " the blocks"
        )
    entry["largest_stage"] = {
        "stage": heavy,
        "state_bytes": stages[heavy],
        "ratio_to_lightest": stages[heavy] / lightest,
    }
