"""`lit-parallel bench callbacks`: what each diagnostic callback costs, in one run on the same model.

Every variant trains the same MLP (BatchNorm after each hidden layer) under the same strategy
(``--strategy``: Lightning's DDP by default, or ``ddp_tuned`` / ``fsdp_blocks``) with the same data, and validates it with a torchmetrics accuracy each epoch. Three costs are measured:

- per training step: median interval between consecutive ``on_train_batch_start`` within an epoch,
  after warm-up (hooks, taps, timers, periodic checks), as a ratio to the run without callbacks;
- per epoch: the time the variant's callbacks spend in ``on_train_epoch_end`` (the gathered checks),
  measured between a timer callback placed before them and one placed after them, also shown as a
  share of the epoch's training time;
- per validation step: median interval between validation batches, as a ratio;
- time inside the callbacks' own hooks per training step and per validation step (each hook of the
  measured callbacks is timed): a direct figure, much less noisy than differences of step times on a
  busy machine. The per-step hooks are ``on_train_batch_start/end``, ``on_before/after_backward`` and
  the validation batch hooks; epoch hooks are in the epoch-end column.

Repeats rotate the order of the variants, so drift on a busy machine hits all of them alike; ratios
are taken within each repeat, then the median over repeats is shown. SyncBatchNormConversion is
reported apart: its cost is the synchronization itself (two all-reduces per BatchNorm layer in forward
and in backward), the price of correct statistics rather than overhead of the callback.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from lit_parallel.commands.launch import add_worker_arguments

VARIANTS = (
    "none",
    "SetEpochCheck",
    "CrossRankMetrics",
    "PitfallReport",
    "all_three",
    "SyncBatchNormConversion",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", type=int, default=2, help="ranks (processes) to run (default 2)")
    p.add_argument("--accelerator", choices=("cpu", "gpu"), default="cpu", help="cpu (gloo) or gpu (nccl)")
    p.add_argument(
        "--strategy",
        choices=("ddp", "ddp_tuned", "fsdp_blocks"),
        default="ddp",
        help="strategy every variant runs under (default: Lightning's ddp)",
    )
    p.add_argument("--width", type=int, default=512, help="hidden width of the MLP (default 512)")
    p.add_argument(
        "--depth", type=int, default=4, help="hidden layers, each Linear+BatchNorm+ReLU (default 4)"
    )
    p.add_argument("--batch-size", type=int, default=256, help="per-rank batch size (default 256)")
    p.add_argument("--steps", type=int, default=20, help="training steps per epoch and rank (default 20)")
    p.add_argument("--epochs", type=int, default=3, help="epochs per run (default 3)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps at the start of each run (default 3)")
    p.add_argument("--repeats", type=int, default=3, help="repeats of every variant (default 3)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    add_worker_arguments(p)


def run(args: argparse.Namespace) -> int:
    if args.worker:
        return _worker(args)
    if min(args.repeats, args.steps, args.epochs) < 1 or args.warmup < 0 or args.warmup >= args.steps:
        raise ValueError("--repeats, --steps and --epochs must be at least 1, and 0 <= --warmup < --steps")
    from lit_parallel.commands.bench.common import launch_and_report

    forwarded = [
        f"--{name.replace('_', '-')}={getattr(args, name)}"
        for name in (
            "devices",
            "accelerator",
            "strategy",
            "width",
            "depth",
            "batch_size",
            "steps",
            "epochs",
            "warmup",
            "repeats",
        )
    ]
    return launch_and_report("lit_parallel.commands.bench.callbacks", args, forwarded, print_report)


def print_report(result: dict[str, Any]) -> None:
    from lit_parallel.commands.terminal import Column, fit_table, terminal_console

    cfg = result["config"]
    base = result["variants"]["none"]
    title = (
        f"bench callbacks: {cfg['params'] / 1e6:.2f}M-parameter MLP with BatchNorm, {cfg['devices']} ranks"
        f" ({cfg['backend']}, {cfg.get('strategy', 'ddp')}), batch {cfg['batch_size']}/rank, {cfg['epochs']} epochs x {cfg['steps']} steps,"
        f" median of {cfg['repeats']} repeats; baseline step {base['train_step_s'] * 1e3:.1f} ms,"
        f" validation step {base['val_step_s'] * 1e3:.1f} ms"
    )
    headers = (
        "train step (ms)",
        "step overhead",
        "hooks/step (us)",
        "hooks share",
        "epoch-end (ms)",
        "epoch-end share",
        "val step overhead",
        "val hooks/step (us)",
    )
    columns = [Column("callbacks", wrap=True), *(Column(h, "right") for h in headers)]
    rows = []
    for name in VARIANTS:
        v = result["variants"][name]
        label = name if name != "SyncBatchNormConversion" else "SyncBatchNormConversion (sync cost)"
        rows.append(
            [
                label,
                f"{v['train_step_s'] * 1e3:.2f}",
                f"{(v['train_step_ratio'] - 1) * 100:+.1f}%",
                f"{v['hook_s_per_step'] * 1e6:.0f}",
                f"{v['hook_s_per_step'] / base['train_step_s'] * 100:.2f}%",
                f"{v['epoch_end_s'] * 1e3:.2f}",
                f"{v['epoch_end_share'] * 100:.2f}%",
                f"{(v['val_step_ratio'] - 1) * 100:+.1f}%",
                f"{v['val_hook_s_per_step'] * 1e6:.0f}",
            ]
        )
    console = terminal_console()
    console.print(fit_table(columns, rows, width=console.width, title=title))


def _worker(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from lit_parallel.commands.bench.common import rotated
    from lit_parallel.commands.launch import init_ranks, write_result

    use_gpu = init_ranks(args.accelerator).type == "cuda"
    world = dist.get_world_size()
    train, val = _random_data(args, world)
    raw: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    for variant in rotated(VARIANTS, args.repeats):
        raw[variant].append(_one_run(args, variant, train, val, use_gpu))
    if dist.get_rank() == 0:
        config = {
            "devices": world,
            "backend": dist.get_backend(),
            "strategy": args.strategy,
            "params": sum(p.numel() for p in _module(args).parameters()),
            "batch_size": args.batch_size,
            "steps": args.steps,
            "epochs": args.epochs,
            "repeats": args.repeats,
        }
        write_result(args.result, {"config": config, "variants": _medians(raw), "per_repeat": raw})
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _random_data(args: argparse.Namespace, world: int) -> tuple[Any, Any]:
    """Random train and validation sets, the same on every rank."""
    import torch

    n_train = world * args.batch_size * args.steps
    # a validation set that does not divide the world size, so CrossRankMetrics has padding to remove
    n_val = world * args.batch_size * 8 - 1
    g = torch.Generator().manual_seed(0)
    train = torch.utils.data.TensorDataset(
        torch.randn(n_train, args.width, generator=g), torch.randint(0, 10, (n_train,), generator=g)
    )
    val = torch.utils.data.TensorDataset(
        torch.randn(n_val, args.width, generator=g), torch.randint(0, 10, (n_val,), generator=g)
    )
    return train, val


def _medians(raw: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per variant, the median over repeats of each time, and of its ratio to the run without callbacks."""
    variants = {}
    for v in VARIANTS:
        runs = raw[v]
        variants[v] = {
            "train_step_s": statistics.median(r["train_step_s"] for r in runs),
            "val_step_s": statistics.median(r["val_step_s"] for r in runs),
            "epoch_end_s": statistics.median(r["epoch_end_s"] for r in runs),
            "hook_s_per_step": statistics.median(r["hook_s_per_step"] for r in runs),
            "val_hook_s_per_step": statistics.median(r["val_hook_s_per_step"] for r in runs),
            "epoch_end_share": statistics.median(r["epoch_end_s"] / r["epoch_train_s"] for r in runs),
            "train_step_ratio": statistics.median(
                r["train_step_s"] / b["train_step_s"] for r, b in zip(runs, raw["none"])
            ),
            "val_step_ratio": statistics.median(
                r["val_step_s"] / b["val_step_s"] for r, b in zip(runs, raw["none"])
            ),
        }
    return variants


def _module(args: argparse.Namespace) -> Any:
    import lightning as L
    import torch
    from torchmetrics.classification import MulticlassAccuracy

    class Hidden(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(args.width, args.width)
            self.norm = torch.nn.BatchNorm1d(args.width)

        def forward(self, x):
            return torch.relu(self.norm(self.linear(x)))

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            layers = [Hidden() for _ in range(args.depth)]  # the blocks fsdp_blocks shards
            self.net = torch.nn.Sequential(*layers, torch.nn.Linear(args.width, 10))
            self.acc = MulticlassAccuracy(num_classes=10)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def validation_step(self, batch, batch_idx):
            x, y = batch
            logits = self.net(x)
            self.acc(logits, y)
            self.log("val_acc", self.acc)
            self.log("val_loss", torch.nn.functional.cross_entropy(logits, y), sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Net()


class _Timer:
    """Two callbacks around the measured ones: step intervals, validation intervals, epoch-end cost."""

    def __new__(cls, use_gpu: bool, warmup: int):
        import lightning as L
        import torch

        def now() -> float:
            if use_gpu:
                torch.cuda.synchronize()
            return time.perf_counter()

        class Before(L.Callback):
            def __init__(self):
                self.train: list[float] = []
                self.val: list[float] = []
                self.epoch_train: list[float] = []
                self._last: float | None = None
                self._last_val: float | None = None
                self._epoch_start = 0.0
                self._batches = 0
                self.epoch_end_start = 0.0

            def on_train_epoch_start(self, trainer, pl_module):
                self._last = None
                self._epoch_start = now()

            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                t = now()
                self._batches += 1
                if self._last is not None and self._batches > warmup:
                    self.train.append(t - self._last)
                self._last = t

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                self._last_batch_end = now()

            def on_validation_epoch_start(self, trainer, pl_module):
                self._last_val = None

            def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
                t = now()
                if self._last_val is not None and not trainer.sanity_checking:
                    self.val.append(t - self._last_val)
                self._last_val = t

            def on_train_epoch_end(self, trainer, pl_module):
                self.epoch_train.append(self._last_batch_end - self._epoch_start)
                self.epoch_end_start = now()

        class After(L.Callback):
            def __init__(self, before):
                self.before = before
                self.epoch_end: list[float] = []

            def on_train_epoch_end(self, trainer, pl_module):
                self.epoch_end.append(now() - self.before.epoch_end_start)

        before = Before()
        return before, After(before)


_TRAIN_STEP_HOOKS = ("on_train_batch_start", "on_train_batch_end", "on_before_backward", "on_after_backward")
_VAL_STEP_HOOKS = ("on_validation_batch_start", "on_validation_batch_end")


def _time_hooks(callback: Any, totals: dict[str, float]) -> None:
    """Accumulate the time spent in ``callback``'s per-step hooks (instance attributes shadow methods)."""
    for names, key in ((_TRAIN_STEP_HOOKS, "train"), (_VAL_STEP_HOOKS, "val")):
        for name in names:
            method = getattr(callback, name)

            def timed(*a: Any, _method: Any = method, _key: str = key, **k: Any) -> Any:
                t = time.perf_counter()
                try:
                    return _method(*a, **k)
                finally:
                    totals[_key] += time.perf_counter() - t

            setattr(callback, name, timed)


def _one_run(args: argparse.Namespace, variant: str, train: Any, val: Any, use_gpu: bool) -> dict[str, float]:
    import lightning as L
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    import lit_parallel as lp

    measured = {
        "none": [],
        "SetEpochCheck": [lp.SetEpochCheck()],
        "CrossRankMetrics": [lp.CrossRankMetrics()],
        "PitfallReport": [lp.PitfallReport(print_table=False)],
        "all_three": [lp.SetEpochCheck(), lp.CrossRankMetrics(), lp.PitfallReport(print_table=False)],
        "SyncBatchNormConversion": [lp.SyncBatchNormConversion()],
    }[variant]
    hook_time = {"train": 0.0, "val": 0.0}
    for callback in measured:
        _time_hooks(callback, hook_time)
    before, after = _Timer(use_gpu, args.warmup)
    trainer = L.Trainer(
        accelerator="gpu" if use_gpu else "cpu",
        devices=dist.get_world_size(),
        strategy=args.strategy,
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[before, *measured, after],
    )
    trainer.fit(
        _module(args),
        DataLoader(train, batch_size=args.batch_size, shuffle=True),
        DataLoader(val, batch_size=args.batch_size),
    )
    train_steps = args.epochs * args.steps
    val_steps = max(1, args.epochs * len(val) // (args.batch_size * dist.get_world_size()))
    return {
        "hook_s_per_step": hook_time["train"] / train_steps,
        "val_hook_s_per_step": hook_time["val"] / val_steps,
        "train_step_s": statistics.median(before.train),
        "val_step_s": statistics.median(before.val) if before.val else float("nan"),
        "epoch_end_s": statistics.median(after.epoch_end),
        "epoch_train_s": statistics.median(before.epoch_train),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m lit_parallel.commands.bench.callbacks")
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
