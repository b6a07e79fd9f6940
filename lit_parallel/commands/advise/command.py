"""`lit-parallel advise`: per-rank memory of every strategy for a model and a cluster, and which to use.

The figures are ZeRO's accounting (see :mod:`lit_parallel.planner.rules`); the recommendation comes
from the advisor's ordered rules, the same ones ``AutoStrategy`` ("auto_parallel") applies at setup.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from rich.markup import escape

from lit_parallel.formatting import format_bytes
from lit_parallel.planner.precision import PRECISION_ALIASES, canonical_precision
from lit_parallel.planner.rules import (
    CUDA_RESERVED_BYTES,
    DEFAULT_MEMORY_HEADROOM,
    PRECISIONS,
    Advice,
    advise,
)

EPILOG = """examples:
  lit-parallel advise --params 7B --devices 8 --memory-gb 80
  lit-parallel advise --params 70e9 --devices 8 --nodes 4 --memory-gb 80 --block-params 0.86e9
  lit-parallel advise --model my_pkg.model:GPT --model-kwargs '{"n_layer": 48}' --devices 8 --nodes 2

GB means 1e9 bytes. Mixed precision (bf16-mixed, 16-mixed) counts 2 + 2 + 12 bytes per parameter
(parameter, gradient, fp32 master weight + Adam's two states); 32-true counts 4 + 4 + 8."""


ZERO2_NOTE = (
    "ZeRO-2 is fsdp_blocks(reshard_after_forward=False): state sharded like ZeRO-3, and every parameter"
    " gathered in full from forward to backward (its params column counts both; DeepSpeed's ZeRO-2 keeps"
    " full parameters only)"
)

HOST_COPY_NOTE = (
    "async ckpt host copy: host memory (not device memory) that async_checkpoint=True keeps on rank 0, one copy"
    " of what the rank saves: its share of the weights in the optimizer's dtype (fp32 under mixed precision)"
    " and of AdamW's state, and every rank's RNG states; ddp_tuned: rank 0 only, it writes the single file"
)


def parse_count(text: str) -> int:
    """``"7e9"``, ``"7B"``, ``"350M"``, ``"1.3b"``, ``"125_000_000"`` -> a number of parameters."""
    s = str(text).strip().replace("_", "").replace(",", "")
    scale = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
    factor = 1.0
    if s and s[-1].lower() in scale:
        factor, s = scale[s[-1].lower()], s[:-1]
    try:
        value = float(s) * factor
    except ValueError:
        raise ValueError(
            f"{text!r} is not a number of parameters; write e.g. 7e9, 7B, 350M or 125000000"
        ) from None
    if not math.isfinite(value) or value < 1 or abs(value - round(value)) > 1e-6 * max(1.0, value):
        raise ValueError(f"{text!r} is not a positive whole number of parameters")
    return int(round(value))


def parse_shape(text: str | None) -> tuple[int, ...] | None:
    """``--input-shape 3,32,32`` -> ``(3, 32, 32)``."""
    if text is None:
        return None
    try:
        shape = tuple(int(x) for x in str(text).replace("x", ",").split(",") if x.strip())
    except ValueError:
        shape = ()
    if not shape or any(d < 1 for d in shape):
        raise ValueError(f"--input-shape {text!r} must be positive sizes separated by commas, e.g. 3,32,32")
    return shape


def parse_model_kwargs(text: str | None) -> dict[str, Any]:
    """``--model-kwargs '{"n_layer": 48}'`` -> a dict."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"--model-kwargs {text!r} is not JSON ({err}); write e.g. '{{\"n_layer\": 48}}'"
        ) from None
    if not isinstance(value, dict):
        raise ValueError(f"--model-kwargs {text!r} must be a JSON object, e.g. '{{\"n_layer\": 48}}'")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = EPILOG
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", metavar="N", help="number of parameters: 7e9, 7B, 350M, 125000000")
    what.add_argument(
        "--model",
        metavar="IMPORT.PATH:Class",
        help="an nn.Module (or LightningModule) class, built on the meta device (no memory used)",
    )
    p.add_argument("--model-kwargs", metavar="JSON", help="arguments for the class, e.g. '{\"n_layer\": 48}'")
    p.add_argument("--devices", type=int, default=None, help="devices per node (default: visible GPUs, or 1)")
    p.add_argument("--nodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument(
        "--memory-gb",
        type=float,
        default=None,
        help="memory of one device in GB (1e9 bytes); default: the first GPU's, or RAM / devices",
    )
    p.add_argument(
        "--memory-headroom",
        type=float,
        default=DEFAULT_MEMORY_HEADROOM,
        help=f"share of device memory a strategy must leave free to fit (default {DEFAULT_MEMORY_HEADROOM});"
        f" on a GPU a further {CUDA_RESERVED_BYTES / 1e9:g} GB per process is kept for the CUDA context and NCCL",
    )
    p.add_argument(
        "--device-type",
        choices=("cuda", "cpu"),
        default=None,
        help="the devices the advice is for (default: cuda; cpu with --verify): the peak is simulated as they"
        " allocate, the step time is timed on this machine's device of that type (none without one), and on"
        " cuda 1 GB per process is kept for the CUDA context and NCCL",
    )
    p.add_argument(
        "--precision",
        default="bf16-mixed",
        help=f"Trainer precision the accounting follows: {', '.join(PRECISIONS)} or Lightning's short"
        f" forms {', '.join(PRECISION_ALIASES)} (default bf16-mixed)",
    )
    p.add_argument(
        "--block-params",
        metavar="N",
        help="parameters of the largest transformer block (with --params; rule 2 needs it)",
    )
    p.add_argument(
        "--batch-size", type=int, default=None, help="per-rank micro-batch for the activation estimate"
    )
    p.add_argument("--seq-len", type=int, default=None, help="sequence length for the activation estimate")
    p.add_argument(
        "--input-shape",
        metavar="D1,D2,...",
        help="shape of one sample of float input, e.g. 3,32,32 for images (for a model without"
        " example_input_array that does not start with an embedding)",
    )
    _add_prediction_arguments(p)
    from lit_parallel.commands.advise.dry_run import add_arguments as add_dry_run_arguments

    add_dry_run_arguments(p)


def _add_prediction_arguments(p: argparse.ArgumentParser) -> None:
    """The peak-memory / step-time options (with ``--model``) and ``--json``."""
    p.add_argument(
        "--json",
        metavar="PATH",
        help="also write every figure as JSON (schema: docs/reference/cli.md, advise section)",
    )
    p.add_argument(
        "--busbw-gbps",
        type=float,
        default=None,
        help="all-reduce bus bandwidth of the cluster in GB/s (`lit-parallel doctor` prints it): adds"
        " communication to the predicted step time",
    )
    p.add_argument(
        "--latency-us",
        type=float,
        default=0.0,
        help="time of one small all-reduce on the cluster in microseconds (doctor's 4 KiB row): charged per"
        " collective call in the predicted step time",
    )
    p.add_argument(
        "--cluster",
        metavar="PATH",
        help="what `advise --verify --json PATH` measured on the cluster (bus bandwidth, latency, what each"
        " strategy adds per step, per FSDP group and per parameter tensor): prices the predicted step time;"
        " --busbw-gbps / --latency-us given as well win",
    )
    p.add_argument(
        "--no-step-time",
        dest="step_time",
        action="store_false",
        help="skip the step-time prediction (it times one block on this machine)",
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="run the model briefly on this machine (CPU, 32-true) and print predicted vs measured",
    )
    p.add_argument(
        "--verify-ranks",
        type=int,
        default=2,
        help="ranks of the real launch --verify makes (ddp_tuned, ZeRO-2, fsdp_blocks); 1: one process only",
    )


def run(args: argparse.Namespace) -> int:
    import torch

    if args.model and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # --model my_pkg.model:GPT from the project folder, as python -m does

    devices = args.devices = args.devices if args.devices is not None else max(1, torch.cuda.device_count())
    for name in ("batch_size", "seq_len"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')}={value} must be at least 1")
    if args.model_kwargs and not args.model:
        raise ValueError("--model-kwargs goes with --model IMPORT.PATH:Class")
    if args.params is not None and (
        args.batch_size is not None or args.seq_len is not None or args.input_shape
    ):
        raise ValueError(
            "--batch-size, --seq-len and --input-shape go with --model: activations are measured by tracing the model's"
            " forward, and --params gives only a parameter count (model state is counted, activations are"
            " not); pass --model IMPORT.PATH:Class, or drop them"
        )
    args.precision = canonical_precision(args.precision)
    args.input_shape = parse_shape(args.input_shape)
    if args.dry_run:
        from lit_parallel.commands.advise.dry_run import run as run_dry

        return run_dry(args, parse_model_kwargs(args.model_kwargs))
    _check_prediction_arguments(args)
    if args.model and args.block_params:
        raise ValueError("--block-params goes with --params; with --model the blocks are found in the model")
    advice = advise(
        params=parse_count(args.params) if args.params is not None else None,
        model=args.model,
        model_kwargs=parse_model_kwargs(args.model_kwargs),
        devices=devices,
        nodes=args.nodes,
        memory_gb=args.memory_gb,
        memory_headroom=args.memory_headroom,
        device_type=args.device_type,
        precision=args.precision,
        block_params=parse_count(args.block_params) if args.block_params else None,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
    )
    print_advice(advice)
    out = advice.as_dict()
    if args.model:
        out.update(_predict_and_verify(args, advice.expert_parallel_size))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


def _check_prediction_arguments(args: argparse.Namespace) -> None:
    if args.busbw_gbps is not None and not (0 < args.busbw_gbps < 1e5):
        raise ValueError(f"--busbw-gbps={args.busbw_gbps} must be a positive, finite bandwidth in GB/s")
    if not (0 <= args.latency_us < 1e7):
        raise ValueError(
            f"--latency-us={args.latency_us} must be a finite, non-negative number of microseconds"
        )
    if args.verify and not args.model:
        raise ValueError("--verify needs --model IMPORT.PATH:Class: it runs the model on this machine")
    if args.verify and args.device_type == "cuda":
        raise ValueError(
            "--verify runs the model on this machine's CPU, so its prediction is for CPU devices: drop"
            " --device-type cuda (or drop --verify for a CUDA prediction)"
        )
    if args.verify and args.precision != "32-true":
        raise ValueError(
            f"--verify runs on this machine's CPU in 32-true, not {args.precision}: add --precision 32-true"
        )
    if args.verify_ranks < 1:
        raise ValueError(f"--verify-ranks={args.verify_ranks} must be at least 1")
    args.cluster_costs, args.cluster_notes = None, []
    if getattr(args, "cluster", None):
        from lit_parallel.planner.time.calibration import load_cluster

        cluster = load_cluster(args.cluster)
        args.busbw_gbps = args.busbw_gbps if args.busbw_gbps is not None else cluster["busbw_gbps"]
        args.latency_us = args.latency_us if args.latency_us else cluster["latency_s"] * 1e6
        args.cluster_costs = cluster["costs"]
        measured, world = cluster["ranks"], args.devices * args.nodes
        if measured and measured != world:
            from lit_parallel.planner.time.calibration import for_ranks

            args.cluster_costs = for_ranks(cluster["costs"], measured, world)
            args.cluster_notes.append(
                f"--cluster was measured on {measured} ranks, this prediction is for {world}: its per-byte costs"
                f" are scaled by the ring's (n - 1) / n, its per-call costs kept as measured (measure on {world}"
                " ranks with `advise --verify --verify-ranks` for exact figures)"
            )
        if (args.device_type or "cuda") == "cuda":
            args.cluster_notes.append(
                "--cluster's costs were measured by `advise --verify`, which runs CPU processes on gloo: the"
                " communication of this CUDA prediction is priced as gloo's, not NCCL's"
            )


def _predict_and_verify(args: argparse.Namespace, expert_parallel: int = 1) -> dict[str, Any]:  # noqa: D401
    """Peak memory and step time of every strategy (``fsdp_blocks`` with the advisor's
    ``expert_parallel_size`` too, when above 1); with ``--verify``, predicted vs measured here."""
    from lit_parallel.commands.advise.compare import print_cluster, print_verification, verify
    from lit_parallel.commands.advise.report import predict, print_prediction
    from lit_parallel.commands.terminal import terminal_console
    from lit_parallel.parallel.example_inputs import NoExampleInput

    console = terminal_console()
    kwargs = parse_model_kwargs(args.model_kwargs)
    try:
        pred = predict(
            args.model,
            kwargs,
            precision=args.precision,
            devices=args.devices,
            nodes=args.nodes,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            device_type=args.device_type or ("cpu" if args.verify else "cuda"),
            step_time=args.step_time,
            busbw_gbps=args.busbw_gbps,
            latency_s=args.latency_us * 1e-6,
            input_shape=args.input_shape,
            costs=getattr(args, "cluster_costs", None),
            expert_parallel=expert_parallel,
        )
    except NoExampleInput as err:
        console.print(f"[yellow]note[/yellow]: no peak prediction: {escape(str(err))}")
        return {"prediction": None}
    pred.notes.extend(getattr(args, "cluster_notes", []))
    print_prediction(pred, console)
    out: dict[str, Any] = {"prediction": pred.as_dict()}
    if args.verify:
        rows, cluster = verify(args.model, kwargs, args, console)
        print_verification(rows, console)
        out["verification"] = rows
        if cluster:
            print_cluster(cluster, console)
            out["measured_cluster"] = cluster
    return out


def _gb(n: float | None) -> str:
    return "-" if n is None else format_bytes(n, decimal=True)


def _advice_table(a: Advice, width: int) -> Any:
    """The memory table of :func:`print_advice`: one row per strategy, the recommendation in bold."""
    from lit_parallel.commands.terminal import Column, fit_table

    act = a.activations
    columns = [
        Column("strategy"),
        Column("lit_parallel", wrap=True),
        Column("shards", wrap=True),
        *(Column(h, "right") for h in ("params", "grads", "optimizer", "model state")),
    ]
    if act is not None:
        columns += [Column("activations", "right"), Column("total", "right")]
    columns.append(Column(f"fits {format_bytes(a.usable_bytes, decimal=True)}", "center"))
    columns.append(Column("async ckpt host copy", "right"))
    rows = []
    for r in a.rows:
        cells = [
            r.name,
            escape(r.strategy or "-"),
            escape(r.sharding),
            _gb(r.param_bytes),
            _gb(r.grad_bytes),
            _gb(r.optimizer_bytes),
            _gb(r.state_bytes),
        ]
        if act is not None:
            cells += [_gb(r.activation_bytes), _gb(r.total_bytes)]
        cells.append("[green]yes[/green]" if r.fits else "[red]no[/red]")
        cells.append(_gb(r.host_copy_bytes))
        rows.append(cells)
    styles = ["bold" if r.strategy == a.choice else None for r in a.rows]
    return fit_table(
        columns,
        rows,
        width=width,
        title="memory per rank (decimal units: GB = 1e9 bytes)",
        row_styles=styles,
    )


def print_advice(a: Advice) -> None:
    from lit_parallel.commands.terminal import terminal_console

    console = terminal_console()
    what = f"{a.model.name}: " if a.model is not None else ""
    b = a.bytes
    console.print(
        f"[bold]lit-parallel advise[/bold]: {what}{a.params:,} parameters on {a.nodes} node(s) x {a.devices}"
        f" device(s) = {a.world_size} ranks; {format_bytes(a.memory_bytes, decimal=True)} per device ({a.memory_source};"
        f" {a.headroom_phrase()});"
        f" precision {a.precision}: {b.params} + {b.grads} + {b.optimizer} = {b.total} bytes per parameter"
    )
    if a.model is not None and a.model.block_description:
        console.print(f"blocks: {a.model.block_description}")
    act = a.activations
    if act is not None:
        console.print(
            f"activations: {format_bytes(act.total_bytes, decimal=True)} per rank for {act.input_description} (micro-batch"
            f" {act.batch_size}; largest block {format_bytes(act.largest_block_bytes, decimal=True)}), traced on the meta device"
        )
    console.print(_advice_table(a, console.width))
    console.print(ZERO2_NOTE)
    console.print(HOST_COPY_NOTE)
    console.print("[bold]rules[/bold] (in order; the first that holds decides):")
    for rule, holds, evidence in a.evaluations:
        mark = a.verdict(rule, holds)
        mark = {
            "yes": "[green]yes[/green]",
            "n/a": "[yellow]n/a[/yellow]",
            "last resort": "[red]last resort[/red]",
        }.get(mark, mark)
        console.print(f"  {rule.number}. {rule.strategy}: {mark}: {evidence}")
    rule_no = a.rule.number if a.rule else "?"
    strategy = f'"{a.recommendation}"'
    if a.strategy_arguments:  # a registry name takes no arguments: the class with them
        args = ", ".join(f"{k}={v!r}" for k, v in a.strategy_arguments.items())
        strategy = f"lp.TransformerFSDPStrategy({args})"
    console.print(
        f"[bold]recommendation: {escape(a.choice)}[/bold] (rule {rule_no}):"
        f" Trainer(strategy={escape(strategy)}, devices={a.devices}, num_nodes={a.nodes}); or"
        ' strategy="auto_parallel" to decide at setup'
    )
    for note in a.model.notes if a.model is not None else ():
        console.print(f"[yellow]note[/yellow]: {escape(note)}")
    for warning in a.warnings:
        console.print(f"[red]warning[/red]: {warning}")
