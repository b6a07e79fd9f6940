"""`lit-parallel demo`: a short multi-process CPU training run, then a summary of what was chosen.

Data: scikit-learn's bundled handwritten digits (1,797 8x8 images, 10 classes; no download). Model: an
input layer, three residual MLP blocks and a classifier, so that every strategy has something to do:
``ddp_tuned`` measures its bucket sizes, ``fsdp_blocks`` finds and shards the blocks, ``auto_parallel``
decides between them. The run uses lit_parallel's callbacks: exact validation accuracy across ranks
(``CrossRankMetrics``), data-sharding checks (``SetEpochCheck``) and the pitfall report.
"""

from __future__ import annotations

import argparse
import time
import warnings
from typing import Any

from lit_parallel.commands.extras import require_extra
from lit_parallel.commands.launch import add_worker_arguments

STRATEGIES = ("ddp_tuned", "fsdp_blocks", "auto_parallel")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", type=int, default=2, help="CPU processes (default 2)")
    p.add_argument("--epochs", type=int, default=6, help="training epochs (default 6)")
    p.add_argument("--batch-size", type=int, default=32, help="per-process batch size (default 32)")
    p.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default="ddp_tuned",
        help="ddp_tuned (default), fsdp_blocks or auto_parallel (decides by the advisor's rules)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the summary as JSON")
    add_worker_arguments(p)


def run(args: argparse.Namespace) -> int:
    if args.worker:
        return _worker(args)
    if args.devices < 1 or args.epochs < 1 or args.batch_size < 1:
        raise ValueError("--devices, --epochs and --batch-size must each be at least 1")
    require_extra("demo", "the demo's data set (scikit-learn's digits)")  # before any process starts
    from lit_parallel.commands.launch import run_ranks

    print(
        f"lit-parallel demo: training on scikit-learn digits with strategy={args.strategy!r} on {args.devices}"
        " CPU ranks"
    )
    result = run_ranks(
        "lit_parallel.commands.demo",
        args.devices,
        [
            f"--devices={args.devices}",
            f"--epochs={args.epochs}",
            f"--batch-size={args.batch_size}",
            f"--strategy={args.strategy}",
        ],
    )
    print_summary(result)
    if args.json:
        import json
        from pathlib import Path

        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def print_summary(r: dict[str, Any]) -> None:
    from rich.markup import escape

    from lit_parallel.commands.terminal import Column, fit_table, terminal_console
    from lit_parallel.formatting import format_bytes

    strategy = f"{r['strategy']} on {r['world_size']} ranks ({r['backend']})"
    if r.get("auto"):
        strategy += f"; chosen by auto_parallel, {r['auto']}"
    rows = [
        ("strategy", strategy),
        ("data", f"digits: {r['train_samples']} train / {r['val_samples']} validation samples"),
        ("model", f"{r['model']}, {r['params']:,} parameters"),
        ("blocks wrapped", r["blocks"]),
    ]
    if r["bucket_caps_mb"] is not None:
        rows += [
            ("bucket sizes", f"{r['bucket_caps_mb']} MiB (first, rest): {r['bucket_reason']}"),
            ("find_unused_parameters", f"{r['find_unused']} (decided by the first training step)"),
        ]
    else:
        rows.append(("bucket sizes", "none: FSDP communicates per block (all-gather, reduce-scatter)"))
    rows += [
        ("throughput", f"{r['samples_per_s']:.0f} samples/s over {r['steps']} steps ({r['train_s']:.1f} s)"),
        (
            "memory per rank",
            f"{format_bytes(r['state_bytes'])} parameters + gradients + optimizer state (measured, largest rank);"
            f" ZeRO formula {format_bytes(r['zero_bytes'])}",
        ),
        ("final validation accuracy", f"{r['val_acc']:.4f} (exact over all ranks: CrossRankMetrics)"),
        (
            "pitfalls",
            "; ".join(r["pitfalls"]) if r["pitfalls"] else "none found (SetEpochCheck, PitfallReport)",
        ),
    ]
    console = terminal_console()
    cells = [[f"[bold]{k}[/bold]", escape(str(v))] for k, v in rows]
    columns = [Column("what"), Column("value", wrap=True)]
    console.print(
        fit_table(columns, cells, width=console.width, title="lit-parallel demo", show_header=False)
    )


def _datasets() -> tuple[Any, Any]:
    """Train and validation splits of the digits, the same on every rank (fixed permutation)."""
    import torch
    from sklearn.datasets import load_digits  # the demo extra: run() has checked that it is installed
    from torch.utils.data import TensorDataset

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    n_val = 360
    val_idx, train_idx = perm[:n_val], perm[n_val:]
    return TensorDataset(x[train_idx], y[train_idx]), TensorDataset(x[val_idx], y[val_idx])


def _digits_net(width: int = 128, depth: int = 3) -> Any:
    """The demo's LightningModule: input layer, ``depth`` residual MLP blocks (what FSDP wraps), classifier."""
    import lightning as L
    import torch
    import torchmetrics
    from torch import nn

    class ResidualBlock(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.up = nn.Linear(width, 2 * width)
            self.down = nn.Linear(2 * width, width)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h + self.down(torch.relu(self.up(self.norm(h))))

    class DigitsNet(L.LightningModule):
        def __init__(self, width: int, depth: int) -> None:
            super().__init__()
            self.inp = nn.Linear(64, width)
            self.blocks = nn.ModuleList(ResidualBlock(width) for _ in range(depth))
            self.head = nn.Linear(width, 10)
            self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=10)

        def forward(self, xb: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.inp(xb))
            for block in self.blocks:
                h = block(h)
            return self.head(h)

        def training_step(self, batch, batch_idx):
            xb, yb = batch
            loss = nn.functional.cross_entropy(self(xb), yb)
            self.log("train_loss", loss, prog_bar=True)
            return loss

        def validation_step(self, batch, batch_idx):
            xb, yb = batch
            self.val_acc(self(xb), yb)
            self.log("val_acc", self.val_acc, prog_bar=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    return DigitsNet(width, depth)


def _observers(pitfalls: Any) -> tuple[Any, Any]:
    """Two callbacks: ``Measure`` (throughput, training state per rank) and ``Problems`` (every pitfall
    the report found in any epoch)."""
    import lightning as L

    from lit_parallel.parallel.memory import training_state_bytes

    class Measure(L.Callback):
        """Throughput, and the training state this rank holds at the second optimizer step."""

        def __init__(self) -> None:
            self.start = 0.0
            self.samples = 0
            self.state_bytes = 0

        def on_train_start(self, trainer, pl_module):
            self.start = time.perf_counter()

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if trainer.global_step == 1:  # gradients and momentum both exist now
                self.state_bytes = training_state_bytes(pl_module, optimizer)["total"]

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.samples += len(batch[0]) * trainer.world_size

    class Problems(L.Callback):
        """Every problem the pitfall report found in any epoch (its table holds the last epoch's)."""

        def __init__(self, report: Any) -> None:
            self.report = report
            self.found: dict[str, str] = {}

        def on_train_epoch_end(self, trainer, pl_module):  # runs after the report's own check
            for f in self.report.findings:
                if f.status == "problem":
                    self.found.setdefault(f.check, f"{f.check} (epoch {trainer.current_epoch}): {f.evidence}")

    return Measure(), Problems(pitfalls)


def _worker(args: argparse.Namespace) -> int:
    import lightning as L
    from torch.utils.data import DataLoader

    import lit_parallel as lp
    from lit_parallel.commands.launch import write_result

    # the summary's "pitfalls" row lists every finding: the live warnings would say each one twice
    warnings.filterwarnings("ignore", category=lp.ParallelTrainingWarning)
    train, val = _datasets()
    L.seed_everything(0, verbose=False)
    strategy = {
        "ddp_tuned": lp.TunedDDPStrategy,
        "fsdp_blocks": lp.TransformerFSDPStrategy,
        "auto_parallel": lp.AutoStrategy,
    }[args.strategy]()
    pitfalls = lp.PitfallReport(print_table=False)
    measure, problems = _observers(pitfalls)
    set_epoch = lp.SetEpochCheck()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        callbacks=[measure, lp.CrossRankMetrics(), set_epoch, pitfalls, problems],
    )
    model = _digits_net()
    params = sum(p.numel() for p in model.parameters())
    trainer.fit(
        model,
        DataLoader(train, batch_size=args.batch_size, shuffle=True),
        DataLoader(val, batch_size=args.batch_size),
    )
    train_s = time.perf_counter() - measure.start
    found = list(problems.found.values()) + list(set_epoch.findings)
    result = _result(
        args, trainer, measure, train_s, params=params, model=model, data=(train, val), pitfalls=found
    )
    if trainer.global_rank == 0:
        write_result(args.result, result)
    return 0


def _blocks_wrapped(strategy: Any) -> str:
    import lit_parallel as lp

    if isinstance(strategy, lp.TransformerFSDPStrategy) and strategy.plan is not None:
        plan = strategy.plan.blocks
        kinds = ", ".join(c.__name__ for c in plan.block_types)
        return (
            f"{plan.num_blocks} x {kinds} found automatically, each sharded with FSDP2"
            f" ({plan.block_fraction:.0%} of the parameters), then the rest as one group"
        )
    return "none: DDP keeps a full replica of the model on every rank"


def _result(
    args: argparse.Namespace,
    trainer: Any,
    measure: Any,
    train_s: float,
    *,
    params: int,
    model: Any,
    data: tuple[Any, Any],
    pitfalls: list[str],
) -> dict[str, Any]:
    """What the summary shows, measured on this rank (memory: the largest rank's, via an all-reduce)."""
    import torch
    import torch.distributed as dist

    import lit_parallel as lp
    from lit_parallel.parallel.memory import estimate_memory

    state = torch.tensor([float(measure.state_bytes)])
    if dist.is_initialized():
        dist.all_reduce(state, op=dist.ReduceOp.MAX)
    s = trainer.strategy  # the chosen strategy, also under auto_parallel
    sharded = isinstance(s, lp.TransformerFSDPStrategy)
    zero = estimate_memory(
        params, strategy="fsdp" if sharded else "ddp", world_size=trainer.world_size, optimizer="sgd_momentum"
    )
    advice = getattr(s, "advice", None)
    plan = getattr(s, "bucket_plan", None)
    return {
        "strategy": advice.recommendation if advice is not None else args.strategy,
        "auto": f"rule {advice.rule.number}: {advice.evaluations[-1][2]}" if advice is not None else None,
        "world_size": trainer.world_size,
        "backend": s.process_group_backend if hasattr(s, "process_group_backend") else "gloo",
        "train_samples": len(data[0]),
        "val_samples": len(data[1]),
        "model": f"input layer, {len(model.blocks)} residual MLP blocks, classifier",
        "params": params,
        "blocks": _blocks_wrapped(s),
        "bucket_caps_mb": [round(v, 3) for v in plan.cap_mb_list] if plan is not None else None,
        "bucket_reason": plan.reason if plan is not None else None,
        "find_unused": bool(s.unused_parameters) if plan is not None else None,
        "samples_per_s": measure.samples / train_s,
        "steps": trainer.global_step,
        "train_s": train_s,
        "state_bytes": state.item(),
        "zero_bytes": zero.total_bytes,
        "val_acc": trainer.callback_metrics["val_acc"].item(),
        "pitfalls": pitfalls,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m lit_parallel.commands.demo")
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
