"""`lit-parallel lab memory`: per-rank memory of each strategy as the model grows, next to the planner.

A stack of residual MLP blocks (``BlockMLP``) of growing width trains for a few steps under
``ddp_tuned``, ZeRO-2 (``fsdp_blocks`` with ``reshard_after_forward=False``), ``fsdp_blocks``, ``hsdp``
(two replicas of one rank, as ``advise --verify`` runs it), ``tp_dp`` and ``pp_dp`` (two pipeline stages,
1F1B, 8 micro-batches) on two CPU ranks (one launch for everything); every rank's peak is measured by
live-storage accounting (:class:`~lit_parallel.measure.live_memory.LiveMemory`) and printed next to what
``lit-parallel advise`` predicts for the same model (for ``pp_dp``: its largest stage; for ``hsdp``: two
nodes of one device).
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lit_parallel.commands.lab.common import figure, launch, run_worker, save, write_csv
from lit_parallel.commands.launch import add_worker_arguments
from lit_parallel.measure.live_memory import CATEGORIES

STRATEGIES = ("ddp_tuned", "zero2", "fsdp_blocks", "hsdp", "tp_dp", "pp_dp")
BATCH = 16
WIDTHS = {True: (32, 128), False: (32, 64, 128, 256, 512)}  # --quick or not


class Block(nn.Module):
    """LayerNorm -> Linear -> GELU -> Linear, with a residual connection."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class BlockMLP(nn.Module):
    """``depth`` residual blocks of ``width`` and a 4-class head; input: ``(batch, width)`` floats."""

    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 4)
        self.example_input_array = torch.zeros(BATCH, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def compute(args: argparse.Namespace) -> dict[str, Any]:
    """In every rank: every width under every strategy; each peak is the largest rank's."""
    import torch.distributed as dist

    from lit_parallel.commands.advise.measure import (
        measure_pipeline_step,
        measure_step,
        peak_dict,
        strategy_object,
    )

    rows: list[dict[str, Any]] = []
    for width in map(int, args.widths.split(",")):
        for name in STRATEGIES:
            torch.manual_seed(0)
            model, x = BlockMLP(width), (torch.randn(BATCH, width),)
            try:
                if name == "pp_dp":  # the pipeline needs the pp_dp contract around the model
                    peak, _ = measure_pipeline_step(model, x, devices=2, repeats=1)
                else:
                    peak, _ = measure_step(model, x, strategy=strategy_object(name, 2), devices=2, repeats=1)
            except Exception as err:  # reported in the CSV, the others still measured
                rows.append({"width": width, "strategy": name, "error": f"{type(err).__name__}: {err}"})
                continue
            peaks: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(peaks, peak_dict(peak))
            rows.append({"width": width, "strategy": name, "measured": max(peaks, key=lambda p: p["total"])})
    return {"rows": rows}


def worker_args(quick: bool) -> list[str]:
    return [f"--widths={','.join(map(str, WIDTHS[quick]))}"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lit_parallel.commands.lab.memory")
    add_worker_arguments(p)
    p.add_argument("--widths", default="32,128")
    return p


@functools.lru_cache
def predicted(width: int) -> dict[str, float]:
    """``advise``'s per-rank peak of every strategy for ``BlockMLP(width)`` on 2 ranks (32-true, CPU); hsdp as
    2 nodes of 1 device (its two replicas of one rank)."""
    from lit_parallel.commands.advise.report import predict

    kw = {
        "precision": "32-true",
        "batch_size": BATCH,
        "seq_len": None,
        "device_type": "cpu",
        "step_time": False,
        "busbw_gbps": None,
    }
    path, kwargs = "lit_parallel.commands.lab.memory:BlockMLP", {"width": width}
    peaks = {s: p.total for s, p in predict(path, kwargs, devices=2, nodes=1, **kw).report.peaks.items()}
    peaks["hsdp"] = predict(path, kwargs, devices=1, nodes=2, **kw).report.peaks["hsdp"].total
    return peaks


def run(out: Path, quick: bool = False, result: dict[str, Any] | None = None) -> list[Path]:
    """Launch the ranks (unless ``result`` already holds what they computed), write CSV and PNG."""
    widths = WIDTHS[quick]
    res = (
        result
        if result is not None
        else launch("lit_parallel.commands.lab.memory", 2, worker_args(quick), timeout=1200)
    )
    rows = []
    for r in res["rows"]:
        pred = predicted(r["width"])[r["strategy"]]
        meas = r.get("measured", {}).get("total")
        rows.append(
            {
                "width": r["width"],
                "params": sum(p.numel() for p in BlockMLP(r["width"]).parameters()),
                "strategy": r["strategy"],
                "predicted_bytes": pred,
                "measured_bytes": meas if meas else "",
                "error": abs(pred - meas) / meas if meas else "",
                "note": r.get("error", ""),
                **{f"measured_{k}": r.get("measured", {}).get(k, "") for k in CATEGORIES},
            }
        )
    files = [write_csv(out / "memory.csv", rows)]
    fig, (ax,) = figure(1, width=6.5)
    for i, name in enumerate(STRATEGIES):
        pts = [r for r in rows if r["strategy"] == name and r["measured_bytes"] != ""]
        for what, style in (("measured", "o-"), ("predicted", "x--")):
            ax.plot(
                [r["params"] for r in pts],
                [r[f"{what}_bytes"] / 1e6 for r in pts],
                style,
                color=f"C{i}",
                label=f"{name} {what}",
            )
    ax.set(
        title=f"peak memory per rank, 2 ranks, batch {BATCH} (AdamW, fp32)",
        xlabel="parameters",
        ylabel="MB",
        xscale="log",
        yscale="log",
    )
    ax.legend(fontsize=7, ncol=2)
    files.append(save(fig, out / "memory.png"))
    (out / "memory.json").write_text(json.dumps({"widths": widths}))
    return files


if __name__ == "__main__":
    raise SystemExit(run_worker(compute, parser().parse_args()))
