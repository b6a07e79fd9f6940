"""`lit-parallel lab unused-parameters`: what ``find_unused_parameters=True`` costs, and what the probe decides.

Two models train on two CPU ranks: one uses every parameter, one has a branch that never runs in
training. Each trains under Lightning's ``DDPStrategy`` with ``find_unused_parameters=True`` (the setting
people turn on "to be safe") and ``False`` (same bucket size, so that only the search differs), and
under ``ddp_tuned``, whose first step is a probe that finds out whether any parameter goes without a
gradient and turns the search on only then. The plot shows the median step time of each; the CSV also
says whether the search was on. ``False`` on the model with an unused branch stops at the second step,
so it has no time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lit_parallel.commands.lab.common import FEATURES, figure, launch, run_worker, save, write_csv
from lit_parallel.commands.launch import add_worker_arguments

MODELS = ("all parameters used", "one branch unused")
BUCKET_MB = 0.25  # what ddp_tuned measures as best for these small models on gloo (it logs its choice)
STRATEGIES = ("DDP, find_unused_parameters=True", "DDP, find_unused_parameters=False", "ddp_tuned (probe)")


class DeepMLP(nn.Module):
    """Many small layers (a long autograd graph for the unused-parameter search to walk)."""

    def __init__(self, unused_branch: bool, depth: int = 48, width: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 4)
        self.aux = nn.Linear(width, 4) if unused_branch else None  # e.g. a head used only in evaluation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.inp(x))
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def _module(unused: bool):
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = DeepMLP(unused)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Module()


def _timer():
    from lightning.pytorch import Callback

    class Timer(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.detection = False

        def on_train_batch_start(self, *args):
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step > 2:  # after the probe and the re-wrap
                self.times.append(time.perf_counter() - self.start)
                # what the DDP wrapper runs with (Lightning unwraps it when training ends)
                self.detection = bool(trainer.strategy.model.find_unused_parameters)

    return Timer()


def _run(unused: bool, strategy_name: str, steps: int) -> dict[str, float | str]:
    import logging

    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    import lit_parallel as lp

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    if strategy_name == STRATEGIES[2]:
        strategy = lp.TunedDDPStrategy()
    else:  # the bucket size ddp_tuned chooses, so that only the search differs
        strategy = DDPStrategy(find_unused_parameters=strategy_name == STRATEGIES[0], bucket_cap_mb=BUCKET_MB)
    timer = _timer()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
        use_distributed_sampler=False,
    )
    data = [(torch.randn(8, FEATURES), torch.randint(0, 4, (8,))) for _ in range(steps)]
    trainer.fit(_module(unused), torch.utils.data.DataLoader(data, batch_size=None))
    return {"step_s": statistics.median(timer.times), "find_unused_parameters": timer.detection}


def compute(args: argparse.Namespace) -> dict[str, Any]:
    """In every rank: both models under each strategy."""
    rows = []
    for model in MODELS:
        for strategy in STRATEGIES:
            if model == MODELS[1] and strategy == STRATEGIES[1]:  # DDP stops at step 2: nothing to time
                rows.append(
                    {"model": model, "strategy": strategy, "step_s": "", "find_unused_parameters": False}
                )
                continue
            rows.append(
                {"model": model, "strategy": strategy, **_run(model == MODELS[1], strategy, args.steps)}
            )
    return {"rows": rows}


def worker_args(quick: bool) -> list[str]:
    return [f"--steps={8 if quick else 40}"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lit_parallel.commands.lab.unused_parameters")
    add_worker_arguments(p)
    p.add_argument("--steps", type=int, default=8)
    return p


def run(out: Path, quick: bool = False, result: dict[str, Any] | None = None) -> list[Path]:
    """Launch the ranks (unless ``result`` already holds what they computed), write CSV and PNG."""
    res = (
        result
        if result is not None
        else launch("lit_parallel.commands.lab.unused_parameters", 2, worker_args(quick))
    )
    rows = res["rows"]
    files = [write_csv(out / "unused_parameters.csv", rows)]
    fig, (ax,) = figure(1, width=6.5)
    width = 0.27
    for i, strategy in enumerate(STRATEGIES):
        steps = [
            next(r["step_s"] for r in rows if r["model"] == m and r["strategy"] == strategy) for m in MODELS
        ]
        vals = [0.0 if v == "" else v * 1e3 for v in steps]  # "": DDP stops at step 2
        bars = ax.bar([j + (i - 1) * width for j in range(len(MODELS))], vals, width, label=strategy)
        for bar, m in zip(bars, MODELS):
            on = next(
                r["find_unused_parameters"] for r in rows if r["model"] == m and r["strategy"] == strategy
            )
            text = "fails" if bar.get_height() == 0 else ("search on" if on else "search off")
            ax.annotate(
                text,
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=7,
            )
    ax.set(
        title="DDP step time, 2 ranks (median)", ylabel="ms", xticks=range(len(MODELS)), xticklabels=MODELS
    )
    ax.legend(fontsize=8)
    files.append(save(fig, out / "unused_parameters.png"))
    return files


if __name__ == "__main__":
    raise SystemExit(run_worker(compute, parser().parse_args()))
