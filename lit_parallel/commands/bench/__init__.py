"""Benchmarks run by ``lit-parallel bench NAME``: programs that time, never tests.

``lit-parallel bench all`` (this module) runs the strategy benchmarks one after the other, writes their
results into one JSON file and draws PNG plots of step time, bytes per rank and bytes communicated
(matplotlib, the optional ``bench`` extra: ``pip install 'lit_parallel[bench]'``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import tempfile
from pathlib import Path
from typing import Any

from lit_parallel.commands.extras import require_extra

# name -> module; the strategy benchmarks run by default, "pp", "ep", "callbacks" and "checkpoint" on request
BENCHMARKS = {
    "ddp": "lit_parallel.commands.bench.ddp",
    "fsdp": "lit_parallel.commands.bench.fsdp",
    "tp": "lit_parallel.commands.bench.tp",
    "pp": "lit_parallel.commands.bench.pp",
    "ep": "lit_parallel.commands.bench.ep",
    "callbacks": "lit_parallel.commands.bench.callbacks",
    "checkpoint": "lit_parallel.commands.bench.checkpoint",
}
DEFAULT = ("ddp", "fsdp", "tp")

# Small models and one repeat: checks that everything runs (CI), not a measurement.
QUICK = {
    "ddp": ["--width=64", "--depth=3", "--steps=3", "--warmup=2", "--repeats=1"],
    "fsdp": ["--dim=64", "--layers=2", "--heads=4", "--vocab=128", "--seq=16", "--batch-size=2", "--steps=2"]
    + ["--warmup=2", "--repeats=1"],
    "tp": ["--dim=64", "--layers=2", "--heads=4", "--vocab=128", "--seq=16", "--global-batch=4", "--steps=2"]
    + ["--warmup=2", "--repeats=1"],
    "pp": ["--dim=32", "--layers=2", "--seq=8", "--batch-size=8", "--microbatches=2,4", "--steps=1"]
    + ["--warmup=1"],
    "ep": ["--hidden=32", "--intermediate=64", "--layers=2", "--vocab=128", "--seq=16", "--batch-size=2"]
    + ["--steps=1", "--warmup=2", "--repeats=1"],
    "callbacks": ["--width=64", "--batch-size=16", "--steps=4", "--epochs=1", "--warmup=1", "--repeats=1"],
    "checkpoint": ["--size-mb=1", "--saves=2", "--every=2", "--warmup=1"],
}

# plot -> (title, y label, [(result key, scale, what the key measures)]); the first key a variant has wins
PLOTS = {
    "step_time": (
        "median step time",
        "ms",
        [("median_step_s", 1e3, "step"), ("train_step_s", 1e3, "training step")],
    ),
    "bytes_per_rank": (
        "bytes per rank",
        "MB",
        [
            ("state_bytes", 1e-6, "parameters + gradients + optimizer state"),
            ("param_bytes", 1e-6, "parameters"),
        ],
    ),
    "bytes_communicated": (
        "bytes communicated per step and rank",
        "MB",
        [
            ("sent_bytes_per_step", 1e-6, "sent (ring collectives)"),
            ("bytes_per_step", 1e-6, "all-reduced"),
            ("payload_bytes_per_step", 1e-6, "payload: all-gather + reduce-scatter + all-to-all"),
        ],
    ),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--only",
        default=",".join(DEFAULT),
        help=f"comma-separated benchmarks among {', '.join(BENCHMARKS)} (default: {','.join(DEFAULT)})",
    )
    p.add_argument("--devices", type=int, default=2, help="ranks (processes) for every benchmark (default 2)")
    p.add_argument("--accelerator", choices=("cpu", "gpu"), default="cpu", help="cpu (gloo) or gpu (nccl)")
    p.add_argument("--out", default="bench-results", help="folder for bench.json and the plots")
    p.add_argument(
        "--quick",
        action="store_true",
        help="small models, one repeat: checks that everything runs (not timing)",
    )


def run(args: argparse.Namespace) -> int:
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown or not names:
        raise ValueError(
            f"--only={args.only!r}: unknown benchmark(s) {unknown}; choose from {', '.join(BENCHMARKS)}"
        )
    if args.devices < 1:
        raise ValueError(f"--devices={args.devices} must be at least 1")
    require_extra("bench", "the plots bench all draws")  # before any benchmark runs or a file is written
    if "ep" in names:
        require_extra("moe", "bench ep's Mixtral model")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for name in names:
        print(f"\n=== lit-parallel bench {name} ===", flush=True)
        try:
            results[name] = _run_one(name, args)
        except (RuntimeError, ValueError) as err:
            errors[name] = str(err)
            print(f"bench {name} failed: {err}")
    report = {
        "machine": {"python": platform.python_version(), "platform": platform.platform(), **_versions()},
        "settings": {"devices": args.devices, "accelerator": args.accelerator, "quick": args.quick},
        "benchmarks": results,
        "errors": errors,
    }
    path = out / "bench.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {path}")
    for file in plot(report, out):
        print(f"wrote {file}")
    return 1 if errors else 0


def _run_one(name: str, args: argparse.Namespace) -> dict[str, Any]:
    module = importlib.import_module(BENCHMARKS[name])
    parser = argparse.ArgumentParser(prog=f"lit-parallel bench {name}")
    module.add_arguments(parser)
    with tempfile.TemporaryDirectory(prefix="lit-parallel-bench-") as tmp:
        json_path = Path(tmp) / f"{name}.json"
        argv = [f"--devices={args.devices}", f"--accelerator={args.accelerator}", f"--json={json_path}"]
        if any(action.dest == "out" for action in parser._actions):  # its own plots: into bench all's folder
            argv.append(f"--out={args.out}")
        sub_args = parser.parse_args(argv + (QUICK[name] if args.quick else []))
        code = module.run(sub_args)
        if code:
            raise RuntimeError(f"exit code {code}")
        return json.loads(json_path.read_text())


def _versions() -> dict[str, str]:
    import lightning
    import torch

    return {"torch": torch.__version__, "lightning": lightning.__version__}


def _series(
    result: dict[str, Any], keys: list[tuple[str, float, str]]
) -> tuple[dict[str, float], str] | None:
    """``{variant: value}`` for the first key the variants report, and what it measures."""
    variants = result.get("variants", {})
    for key, scale, what in keys:
        values = {v: m[key] * scale for v, m in variants.items() if isinstance(m.get(key), (int, float))}
        if values:
            return values, what
    return None


def plot(report: dict[str, Any], out: Path) -> list[Path]:
    """One PNG per quantity, one panel per benchmark that reports it; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for stem, (title, unit, keys) in PLOTS.items():
        panels = [
            (name, series)
            for name, result in report["benchmarks"].items()
            if (series := _series(result, keys)) is not None
        ]
        if not panels:
            continue
        fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8), squeeze=False)
        for ax, (name, (values, what)) in zip(axes[0], panels):
            ax.bar(list(values), list(values.values()), color="#4c72b0")
            ax.set_title(f"bench {name}: {what}", fontsize=9)
            ax.set_ylabel(unit)
            ax.tick_params(axis="x", labelrotation=20, labelsize=8)
        settings = report["settings"]
        fig.suptitle(f"{title} ({settings['devices']} ranks, {settings['accelerator']})")
        fig.tight_layout()
        path = out / f"{stem}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
