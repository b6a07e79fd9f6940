"""`lit-parallel demo`: a short multi-process CPU training run with ddp_tuned, and what it chose.

Data: scikit-learn's bundled handwritten digits (1,797 8x8 images, 10 classes; no download).
"""

from __future__ import annotations

import argparse
import time
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", type=int, default=2, help="CPU processes (default 2)")
    p.add_argument("--epochs", type=int, default=6, help="training epochs (default 6)")
    p.add_argument("--batch-size", type=int, default=32, help="per-process batch size (default 32)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.worker:
        return _worker(args)
    if args.devices < 1 or args.epochs < 1 or args.batch_size < 1:
        raise ValueError("--devices, --epochs and --batch-size must each be at least 1")
    _load_digits()  # fail here, before starting processes, if scikit-learn is missing
    from lit_parallel.launch import run_ranks

    print(
        f"lit-parallel demo: training on scikit-learn digits with strategy='ddp_tuned' on {args.devices} CPU ranks"
    )
    result = run_ranks(
        "lit_parallel.demo",
        args.devices,
        [f"--devices={args.devices}", f"--epochs={args.epochs}", f"--batch-size={args.batch_size}"],
    )
    print_summary(result)
    return 0


def print_summary(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="lit-parallel demo", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    rows = [
        ("strategy", f"{r['strategy']} on {r['world_size']} ranks ({r['backend']})"),
        ("data", f"digits: {r['train_samples']} train / {r['val_samples']} validation samples"),
        ("model", f"MLP, {r['params']:,} parameters"),
        ("bucket sizes", f"{r['bucket_caps_mb']} MiB (first, rest)"),
        ("why", r["bucket_reason"]),
        ("find_unused_parameters", f"{r['find_unused']} (decided by the first training step)"),
        ("throughput", f"{r['samples_per_s']:.0f} samples/s over {r['steps']} steps ({r['train_s']:.1f} s)"),
        ("final validation accuracy", f"{r['val_acc']:.4f}"),
    ]
    for k, v in rows:
        table.add_row(k, str(v))
    Console().print(table)


def _load_digits():
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise RuntimeError("the demo needs scikit-learn: pip install 'lit_parallel[demo]'") from err
    return load_digits()


def _worker(args: argparse.Namespace) -> int:
    import lightning as L
    import torch
    import torchmetrics
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lit_parallel import TunedDDPStrategy
    from lit_parallel.launch import write_result

    digits = _load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    n_val = 360  # divisible by common world sizes, so no padded duplicates reach the metric
    val_idx, train_idx = perm[:n_val], perm[n_val:]
    train = TensorDataset(x[train_idx], y[train_idx])
    val = TensorDataset(x[val_idx], y[val_idx])

    class DigitsMLP(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = nn.Sequential(
                nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10)
            )
            self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=10)

        def training_step(self, batch, batch_idx):
            xb, yb = batch
            loss = nn.functional.cross_entropy(self.model(xb), yb)
            self.log("train_loss", loss, prog_bar=True)
            return loss

        def validation_step(self, batch, batch_idx):
            xb, yb = batch
            self.val_acc(self.model(xb), yb)
            self.log("val_acc", self.val_acc, prog_bar=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    class Throughput(L.Callback):
        def __init__(self):
            self.start = 0.0
            self.samples = 0

        def on_train_start(self, trainer, pl_module):
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.samples += len(batch[0]) * trainer.world_size

    L.seed_everything(0, verbose=False)
    strategy = TunedDDPStrategy()
    timer = Throughput()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        callbacks=[timer],
    )
    model = DigitsMLP()
    trainer.fit(
        model, DataLoader(train, batch_size=args.batch_size), DataLoader(val, batch_size=args.batch_size)
    )
    train_s = time.perf_counter() - timer.start
    val_acc = trainer.callback_metrics["val_acc"].item()
    if trainer.global_rank == 0:
        plan = strategy.bucket_plan
        write_result(
            args.result,
            {
                "strategy": "ddp_tuned",
                "world_size": trainer.world_size,
                "backend": strategy.process_group_backend,
                "train_samples": len(train),
                "val_samples": len(val),
                "params": sum(p.numel() for p in model.parameters()),
                "bucket_caps_mb": [round(v, 3) for v in plan.cap_mb_list],
                "bucket_reason": plan.reason,
                "find_unused": not not strategy.unused_parameters,
                "samples_per_s": timer.samples / train_s,
                "steps": trainer.global_step,
                "train_s": train_s,
                "val_acc": val_acc,
            },
        )
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m lit_parallel.demo")
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
