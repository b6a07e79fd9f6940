"""`lit-parallel bench checkpoint`: how long a checkpoint save holds training, synchronous vs in the background.

For every strategy asked for (``--strategies``), the same GPT (the model of ``bench fsdp``, its width chosen so
that parameters plus AdamW state come to about ``--size-mb``) trains on the ranks and saves ``--saves``
checkpoints ``--every`` steps apart, by ``trainer.save_checkpoint`` in ``on_train_batch_end`` (where
``ModelCheckpoint`` saves), once per mode:

- ``sync``: ``async_checkpoint=False``: the save returns when the checkpoint is written and committed;
- ``async``: ``async_checkpoint=True``: the save returns once the state is copied to host memory, and the
  rank's writer thread writes and commits it while training goes on;
- ``lightning_async`` (next to ``ddp_tuned`` only): Lightning's ``AsyncCheckpointIO`` as the
  ``checkpoint_io`` of Lightning's own ``ddp`` (``ddp_tuned`` commits a file when its inner save returns, before
  this thread wrote it): it clones the tensors and writes them in a thread of its own.

Measured, per save: the time training is blocked (the wall time of ``trainer.save_checkpoint`` on each rank,
the slowest rank's), and for background writes the write's own time (``writer.completed``, the slowest
rank's). Per step: its time (batch start to batch end, the slowest rank's) and whether a rank had a write
pending at its start; the slowdown is the median step during a write over the median step with no write
pending, in the same run. The cost of a save is its blocked time plus what the steps overlapping writes lost:
their number per save times the median step during a write less the median step without one. Figures are
medians over the saves after the first (the first allocates the host copy; it is reported apart). After each
run every checkpoint is verified complete (:func:`~lit_parallel.checkpoint.load.verify_checkpoint`), then
removed.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from lit_parallel.commands.extras import require_extra
from lit_parallel.commands.launch import add_worker_arguments

STRATEGIES = ("ddp_tuned", "fsdp_blocks", "hsdp", "tp_dp", "pp_dp")
MODES = ("sync", "async", "lightning_async")
MODE_LABELS = {
    "sync": "synchronous",
    "async": "async_checkpoint=True",
    "lightning_async": "Lightning's ddp + AsyncCheckpointIO",
}
MODE_CELLS = {"sync": "sync", "async": "async", "lightning_async": "Lightning ddp + AsyncCheckpointIO"}

# the model: LAYERS blocks of the bench GPT, its width a multiple of WIDTH_STEP (HEADS divide it, and so does
# the tensor-parallel size 2), a small vocabulary and short sequences: most of the bytes are in the blocks
LAYERS, HEADS, VOCAB, SEQ, BATCH, WIDTH_STEP = 4, 4, 256, 16, 2, 32


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", type=int, default=2, help="ranks (processes) to run, even (default 2)")
    p.add_argument("--accelerator", choices=("cpu", "gpu"), default="cpu", help="cpu (gloo) or gpu (nccl)")
    p.add_argument(
        "--strategies",
        default=",".join(STRATEGIES),
        help=f"comma-separated strategies among {', '.join(STRATEGIES)} (default: all)",
    )
    p.add_argument(
        "--size-mb",
        type=float,
        default=300.0,
        help="parameters + AdamW state of the whole model, in MB (default 300: about 25M parameters)",
    )
    p.add_argument("--saves", type=int, default=5, help="checkpoints saved per run, at least 2 (default 5)")
    p.add_argument("--every", type=int, default=8, help="training steps between two saves (default 8)")
    p.add_argument("--warmup", type=int, default=3, help="training steps before the first save (default 3)")
    p.add_argument(
        "--checkpoint-dir",
        help="where the checkpoints are written (a temporary folder is made in it and removed; default: the"
        " system's temporary folder)",
    )
    p.add_argument(
        "--out", default="bench-checkpoint", help="folder for checkpoint_bench.png (default bench-checkpoint)"
    )
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    add_worker_arguments(p)


_FORWARDED = ("accelerator", "strategies", "size_mb", "saves", "every", "warmup", "out")


def check_arguments(args: argparse.Namespace) -> list[str]:
    """The strategies ``args`` ask for, after checking every argument."""
    names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in names if s not in STRATEGIES]
    if unknown or not names:
        raise ValueError(
            f"--strategies={args.strategies!r}: unknown strategy(s) {unknown}; choose from {', '.join(STRATEGIES)}"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"--strategies={args.strategies!r} names a strategy twice; name each once")
    if args.devices < 2 or args.devices % 2:
        raise ValueError(
            f"--devices={args.devices} must be even and at least 2 (tp_dp and pp_dp split over 2 ranks, hsdp"
            " replicates over them)"
        )
    if args.saves < 2 or args.every < 1 or args.warmup < 1:
        raise ValueError(
            f"--saves={args.saves}, --every={args.every}, --warmup={args.warmup}: at least 2 saves (the first is"
            " reported apart: it allocates the host copy), at least 1 step between saves and before the first"
        )
    if not args.size_mb > 0:
        raise ValueError(f"--size-mb={args.size_mb} must be positive")
    if args.checkpoint_dir is not None and not Path(args.checkpoint_dir).is_dir():
        raise ValueError(
            f"--checkpoint-dir={args.checkpoint_dir!r} is not a folder; create it or name another"
        )
    return names


def run(args: argparse.Namespace) -> int:
    if args.worker:
        return _worker(args)
    check_arguments(args)
    require_extra("bench", "the plot bench checkpoint draws")  # before any rank starts
    from lit_parallel.commands.bench.common import launch_and_report

    if args.json and args.out == "bench-checkpoint":
        args.out = str(Path(args.json).resolve().parent)  # the plot next to the JSON
    forwarded = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in _FORWARDED]
    forwarded += [f"--devices={args.devices}"]
    if args.checkpoint_dir is not None:
        forwarded.append(f"--checkpoint-dir={Path(args.checkpoint_dir).resolve()}")
    return launch_and_report("lit_parallel.commands.bench.checkpoint", args, forwarded, print_report)


# ----------------------------------------------------------------------------------------- model


def gpt_parameters(width: int) -> int:
    """Parameters of the bench GPT (:func:`~lit_parallel.commands.bench.common.make_gpt`) of this width with
    this module's LAYERS, VOCAB and SEQ: embeddings, blocks (two LayerNorms, qkv and output projections, a 4x
    MLP, with biases), final LayerNorm, head without bias."""
    block = 12 * width * width + 13 * width
    return 2 * VOCAB * width + SEQ * width + LAYERS * block + 2 * width


def state_bytes(width: int) -> int:
    """fp32 parameters and AdamW's two moments (12 bytes per parameter; the step counters left out)."""
    return 12 * gpt_parameters(width)


def width_for(size_mb: float) -> int:
    """The multiple of WIDTH_STEP whose :func:`state_bytes` is closest to ``size_mb`` MB."""
    target = size_mb * 1e6
    width = WIDTH_STEP
    while state_bytes(width + WIDTH_STEP) <= target:
        width += WIDTH_STEP
    above = width + WIDTH_STEP
    return above if abs(state_bytes(above) - target) < abs(state_bytes(width) - target) else width


def _model_args(width: int) -> argparse.Namespace:
    """The arguments :func:`~lit_parallel.commands.bench.common.make_gpt` takes, for this width."""
    return argparse.Namespace(vocab=VOCAB, seq=SEQ, dim=width, heads=HEADS, layers=LAYERS)


def _lightning_module(size_mb: float) -> Any:
    import torch
    import torch.nn.functional as F

    from lit_parallel.commands.bench.common import GPTBench

    class CheckpointBench(GPTBench):
        """The bench GPT with next-token cross-entropy and AdamW, and the hooks pp_dp pipelines."""

        def forward(self, x):
            return self.model(x)

        def pipeline_loss(self, output, targets):
            return F.cross_entropy(output.flatten(0, 1), targets.flatten())

    torch.manual_seed(0)
    return CheckpointBench(_model_args(width_for(size_mb)))


def _strategy(name: str, mode: str, checkpoint_io: Any = None) -> Any:
    from lit_parallel import (
        HybridShardStrategy,
        PipelineParallelStrategy,
        TensorParallelStrategy,
        TransformerFSDPStrategy,
        TunedDDPStrategy,
    )

    background = mode == "async"
    if mode == "lightning_async":
        # Lightning's own ddp: the lit_parallel strategies refuse AsyncCheckpointIO (it returns before the file
        # is written, so the file could not be renamed into place only once complete)
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(checkpoint_io=checkpoint_io)
    if name == "ddp_tuned":
        return TunedDDPStrategy(async_checkpoint=background)
    if name == "fsdp_blocks":
        return TransformerFSDPStrategy(async_checkpoint=background)
    if name == "hsdp":  # replicas of one shard each: on one node, what differs from fsdp_blocks
        return HybridShardStrategy(shard_size=1, async_checkpoint=background)
    if name == "tp_dp":
        return TensorParallelStrategy(tensor_parallel_size=2, async_checkpoint=background)
    if name == "pp_dp":
        return PipelineParallelStrategy(pipeline_parallel_size=2, microbatches=2, async_checkpoint=background)
    raise ValueError(f"strategy {name!r} is not one of {', '.join(STRATEGIES)}")


def layout(name: str, devices: int) -> str:
    """How the strategy spreads the model over ``devices`` ranks in this benchmark."""
    return {
        "ddp_tuned": f"{devices} replicas",
        "fsdp_blocks": f"sharded over {devices}",
        "hsdp": f"{devices} replicas x 1 shard",
        "tp_dp": f"tp 2 x dp {devices // 2}",
        "pp_dp": f"pp 2 x dp {devices // 2}",
    }[name]


def modes_of(name: str) -> tuple[str, ...]:
    return MODES if name == "ddp_tuned" else MODES[:2]


# ----------------------------------------------------------------------------------------- ranks


def _worker(args: argparse.Namespace) -> int:
    import os
    import shutil
    import tempfile

    import lightning
    import torch
    import torch.distributed as dist

    from lit_parallel.commands.launch import init_ranks, write_result

    use_gpu = init_ranks(args.accelerator).type == "cuda"
    n, rank = dist.get_world_size(), dist.get_rank()
    load_before = os.getloadavg()
    names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    root = [
        tempfile.mkdtemp(prefix="lit-parallel-bench-checkpoint-", dir=args.checkpoint_dir)
        if rank == 0
        else None
    ]
    dist.broadcast_object_list(root, src=0)
    runs: dict[str, dict[str, list[dict]]] = {}
    try:
        for name in names:
            runs[name] = {}
            for mode in modes_of(name):
                if rank == 0:
                    print(f"bench checkpoint: {name}, {MODE_LABELS[mode]}", flush=True)
                runs[name][mode] = _one_run(args, name, mode, Path(root[0]) / f"{name}-{mode}", use_gpu)
    except BaseException:  # no collective here: a failed rank exits and torchrun stops the others
        if rank == 0:
            shutil.rmtree(root[0], ignore_errors=True)
        raise
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root[0], ignore_errors=True)
    if rank == 0:
        width = width_for(args.size_mb)
        config = {
            "devices": n,
            "backend": dist.get_backend(),
            "accelerator": args.accelerator,
            "device": torch.cuda.get_device_name() if use_gpu else "cpu",
            "torch": torch.__version__,
            "lightning": lightning.__version__,
            "size_mb": args.size_mb,
            "width": width,
            "layers": LAYERS,
            "params": gpt_parameters(width),
            "state_bytes": state_bytes(width),
            "batch_size": BATCH,
            "seq": SEQ,
            "saves": args.saves,
            "every": args.every,
            "warmup": args.warmup,
            "checkpoint_dir": args.checkpoint_dir or tempfile.gettempdir(),
            # the machine's 1-minute load average before and after: other work competing for the cores
            "load_average": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        }
        result = report(config, runs)
        result["plots"] = [str(plot(result, Path(args.out)))]
        write_result(args.result, result)
    dist.barrier()
    dist.destroy_process_group()
    return 0


class _LightningWrites:
    """What Lightning's AsyncCheckpointIO has in flight (queued or writing) and how long each write took."""

    def __init__(self) -> None:
        import threading

        self.lock = threading.Lock()
        self.in_flight = 0
        self.completed: list[tuple[str, float]] = []

    def checkpoint_io(self) -> Any:
        import time

        from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

        writes = self

        class TimedTorchCheckpointIO(TorchCheckpointIO):
            def save_checkpoint(self, checkpoint, path, storage_options=None):
                started = time.monotonic()
                try:
                    super().save_checkpoint(checkpoint, path, storage_options=storage_options)
                finally:
                    with writes.lock:
                        writes.in_flight -= 1
                        writes.completed.append((str(path), time.monotonic() - started))

        class CountedAsyncCheckpointIO(AsyncCheckpointIO):
            def save_checkpoint(self, *args, **kwargs):
                with writes.lock:
                    writes.in_flight += 1
                super().save_checkpoint(*args, **kwargs)

        return CountedAsyncCheckpointIO(TimedTorchCheckpointIO())

    def count(self) -> int:
        with self.lock:
            return self.in_flight


def _saver(args: argparse.Namespace, folder: Path, mode: str, use_gpu: bool, lightning_writes: Any) -> Any:
    """The callback that times every step and saves (and times) the checkpoints."""
    import time

    import lightning as L
    import torch

    def sync() -> None:
        if use_gpu:
            torch.cuda.synchronize()

    def in_flight(trainer) -> int:
        """Writes queued or running on this rank."""
        if mode == "lightning_async":
            return lightning_writes.count()
        checkpoints = trainer.strategy.reliability.checkpoints
        return 0 if checkpoints is None else len(checkpoints.writer.pending_writes())

    class SaveTimer(L.Callback):
        def __init__(self) -> None:
            self.steps: list[tuple[float, bool, bool]] = []  # (seconds, write pending at start, ... at end)
            self.saves: list[tuple[float, bool]] = []  # (seconds blocked, a write was pending before it)
            self.paths: list[str] = []
            self.most_in_flight = 0  # the most writes queued or running at once, each with its own copy
            self._started = 0.0
            self._pending_at_start = False

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            sync()
            self._pending_at_start = in_flight(trainer) > 0
            self._started = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            sync()
            ended = time.perf_counter()
            self.steps.append((ended - self._started, self._pending_at_start, in_flight(trainer) > 0))
            done = trainer.global_step
            if (
                done >= args.warmup
                and (done - args.warmup) % args.every == 0
                and len(self.saves) < args.saves
            ):
                path = folder / f"save-{len(self.saves)}.ckpt"
                before = in_flight(trainer) > 0
                started = time.perf_counter()
                trainer.save_checkpoint(path)
                sync()
                self.saves.append((time.perf_counter() - started, before))
                self.paths.append(str(path))
                self.most_in_flight = max(self.most_in_flight, in_flight(trainer))

    return SaveTimer()


def _one_run(args: argparse.Namespace, name: str, mode: str, folder: Path, use_gpu: bool) -> list[dict]:
    """One training run of ``name`` in ``mode``: every rank's measurements (on every rank)."""
    import shutil

    import lightning as L
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from lit_parallel.checkpoint.load import verify_checkpoint
    from lit_parallel.commands.bench.common import token_dataset

    n, rank = dist.get_world_size(), dist.get_rank()
    lightning_writes = _LightningWrites() if mode == "lightning_async" else None
    checkpoint_io = lightning_writes.checkpoint_io() if lightning_writes is not None else None
    strategy = _strategy(name, mode, checkpoint_io)
    timer = _saver(args, folder, mode, use_gpu, lightning_writes)
    steps = args.warmup + args.saves * args.every
    trainer = L.Trainer(
        accelerator="gpu" if use_gpu else "cpu",
        devices=n,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
    )
    data = token_dataset(VOCAB, SEQ, n * BATCH * steps)
    trainer.fit(_lightning_module(args.size_mb), DataLoader(data, batch_size=BATCH))
    if mode == "async":
        checkpoints = strategy.reliability.checkpoints
        writes = [s for _, s in checkpoints.writer.completed]
        host = checkpoints.host.nbytes if checkpoints.host is not None else 0
        allocated = checkpoints.host.allocated_bytes if checkpoints.host is not None else 0
    elif mode == "lightning_async":
        writes, host, allocated = [s for _, s in lightning_writes.completed], None, None
    else:
        writes, host, allocated = [], None, None
    mine = {
        "steps": timer.steps,
        "saves": timer.saves,
        "writes": writes,
        "host_bytes": host,
        "host_allocated_bytes": allocated,
        "most_in_flight": timer.most_in_flight,
    }
    ranks: list[Any] = [None] * n
    dist.all_gather_object(ranks, mine)
    if rank == 0:  # fit returned: every write finished; each checkpoint must be complete
        ranks[0]["verified"] = [verify_checkpoint(p) for p in timer.paths]
        ranks[0]["checkpoint_bytes"] = _size_on_disk(Path(timer.paths[-1]))
        shutil.rmtree(folder, ignore_errors=True)
    dist.barrier()
    del trainer, strategy
    if use_gpu:
        torch.cuda.empty_cache()
    return ranks


def _size_on_disk(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# ----------------------------------------------------------------------------------------- the report


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(ranks: list[dict], mode: str) -> dict[str, Any]:
    """One run's figures from every rank's measurements: per save the slowest rank's blocked time and write
    time, per step the slowest rank's time and whether any rank had a write pending."""
    saves = len(ranks[0]["saves"])
    blocked = [max(r["saves"][i][0] for r in ranks) for i in range(saves)]
    waited = sum(any(r["saves"][i][1] for r in ranks) for i in range(saves))
    writers = [r["writes"] for r in ranks if r["writes"]]
    write_s = [max(w[i] for w in writers) for i in range(min(map(len, writers)))] if writers else []
    during, clear = [], []
    for i in range(len(ranks[0]["steps"])):
        seconds = max(r["steps"][i][0] for r in ranks)
        if any(r["steps"][i][1] for r in ranks):
            during.append(seconds)
        elif not any(r["steps"][i][2] for r in ranks):
            clear.append(seconds)
    step_during, step_clear = _median(during), _median(clear)
    # training time a save costs: the time it blocks, plus what the steps overlapping its write lost
    extra = 0.0 if step_during is None or step_clear is None else step_during - step_clear
    out: dict[str, Any] = {
        "blocked_s": statistics.median(blocked[1:]),
        "first_blocked_s": blocked[0],
        "blocked_per_save_s": blocked,
        "saves_that_waited_for_a_write": waited,
        "most_writes_in_flight": max(r["most_in_flight"] for r in ranks),
        "write_s": _median(write_s[1:]) if len(write_s) > 1 else _median(write_s),
        "write_per_save_s": write_s,
        "step_s": step_clear,
        "steps_no_write": len(clear),
        "steps_during_write": len(during),
        "step_during_write_s": step_during,
        "slowdown": step_during / step_clear if step_during is not None and step_clear else None,
        "cost_per_save_s": statistics.median(blocked[1:]) + len(during) / saves * extra,
        "verified": ranks[0].get("verified", []),
        "checkpoint_bytes": ranks[0].get("checkpoint_bytes"),
    }
    if mode == "async":
        out["host_bytes_per_rank"] = [r["host_bytes"] for r in ranks]
        out["host_allocated_bytes_per_rank"] = [r["host_allocated_bytes"] for r in ranks]
    return out


def report(config: dict[str, Any], runs: dict[str, dict[str, list[dict]]]) -> dict[str, Any]:
    """The result: per strategy and mode, :func:`summarize` of its run, and the blocked-time ratios."""
    strategies: dict[str, Any] = {}
    for name, by_mode in runs.items():
        modes = {mode: summarize(ranks, mode) for mode, ranks in by_mode.items()}
        sync = modes["sync"]["blocked_s"]
        ratios = {f"{mode}_vs_sync": m["blocked_s"] / sync for mode, m in modes.items() if mode != "sync"}
        strategies[name] = {
            "layout": layout(name, config["devices"]),
            "modes": modes,
            "blocked_ratio": ratios,
        }
    return {"config": config, "strategies": strategies}


def print_report(result: dict[str, Any]) -> None:
    from lit_parallel.commands.terminal import Column, fit_table, terminal_console
    from lit_parallel.formatting import format_bytes

    cfg = result["config"]
    title = (
        f"bench checkpoint: {cfg['params'] / 1e6:.1f}M-parameter GPT,"
        f" {format_bytes(cfg['state_bytes'], decimal=True)} of"
        f" parameters + AdamW state, {cfg['devices']} ranks ({cfg['backend']}), {cfg['saves']} saves"
        f" {cfg['every']} steps apart; medians over the saves after the first"
    )
    headers = ("blocked/save (ms)", "vs sync", "first save (ms)", "write (ms)", "host copy/rank", "step (ms)")
    columns = [Column("strategy"), Column("mode"), *(Column(h, "right") for h in headers)]
    columns += [Column("during a write", "right"), Column("cost/save (ms)", "right")]
    rows = []
    for name, s in result["strategies"].items():
        for mode, m in s["modes"].items():
            ratio = s["blocked_ratio"].get(f"{mode}_vs_sync", 1.0)
            host = m.get("host_bytes_per_rank")
            rows.append(
                [
                    name,
                    MODE_CELLS[mode],
                    f"{m['blocked_s'] * 1e3:.1f}",
                    f"{ratio:.3f}",
                    f"{m['first_blocked_s'] * 1e3:.1f}",
                    "-" if m["write_s"] is None else f"{m['write_s'] * 1e3:.1f}",
                    "-" if not host else format_bytes(max(host), decimal=True),
                    "-" if m["step_s"] is None else f"{m['step_s'] * 1e3:.1f}",
                    "-" if m["slowdown"] is None else f"x{m['slowdown']:.2f}",
                    f"{m['cost_per_save_s'] * 1e3:.1f}",
                ]
            )
    console = terminal_console()
    console.print(fit_table(columns, rows, width=console.width, title=title))
    console.print(
        "blocked: trainer.save_checkpoint's wall time, slowest rank; write: the background write, slowest rank;"
        " step: median step with no write pending; during a write: median step while one is pending, over it;"
        " cost: blocked + what the steps overlapping a write lost, per save"
    )
    for path in result.get("plots", []):
        print(f"wrote {path}")


# ----------------------------------------------------------------------------------------- plot


def plot(result: dict[str, Any], out: Path) -> Path:
    """``checkpoint_bench.png``: blocked time per save by strategy and mode (the background write's time
    beside it), and the step time with and without a write pending."""
    import matplotlib  # the bench extra: run() has checked that it is installed

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    cfg = result["config"]
    names = list(result["strategies"])
    colors = {"sync": "#4c72b0", "async": "#55a868", "lightning_async": "#dd8452"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.4), gridspec_kw={"width_ratios": [1.6, 1]})
    bar = 0.26
    for i, name in enumerate(names):
        modes = result["strategies"][name]["modes"]
        for j, mode in enumerate(MODES):
            if mode not in modes:
                continue
            m, x = modes[mode], i + (j - 1) * bar
            left.bar(x, m["blocked_s"], bar, color=colors[mode], label=MODE_LABELS[mode] if i == 0 else None)
            if m["write_s"] is not None:
                left.bar(
                    x,
                    m["write_s"],
                    bar,
                    fill=False,
                    edgecolor=colors[mode],
                    hatch="//",
                    linewidth=0.8,
                    label="its background write (hatched)" if mode == "async" and i == 0 else None,
                )
            if mode != "sync":
                ratio = result["strategies"][name]["blocked_ratio"][f"{mode}_vs_sync"]
                _label(left, f"{ratio:.0%}", (x, m["blocked_s"]))
    left.set_xticks(range(len(names)), names, fontsize=8)
    left.set_ylabel("seconds per save")
    left.set_title("training blocked per save (label: share of the synchronous save)", fontsize=9)
    left.legend(fontsize=7)
    for i, name in enumerate(names):
        m = result["strategies"][name]["modes"]["async"]
        if m["step_s"] is not None:
            right.bar(
                i - 0.2, m["step_s"] * 1e3, 0.4, color="#8c8c8c", label="no write pending" if i == 0 else None
            )
        if m["step_during_write_s"] is not None:
            right.bar(
                i + 0.2,
                m["step_during_write_s"] * 1e3,
                0.4,
                color="#55a868",
                label="a write pending" if i == 0 else None,
            )
            if m["slowdown"] is not None:
                _label(right, f"x{m['slowdown']:.2f}", (i + 0.2, m["step_during_write_s"] * 1e3))
    right.set_xticks(range(len(names)), names, fontsize=8)
    right.set_ylabel("ms")
    right.set_title("median step, async_checkpoint=True runs", fontsize=9)
    right.legend(fontsize=7)
    fig.suptitle(
        f"bench checkpoint: {cfg['params'] / 1e6:.1f}M-parameter GPT, {cfg['state_bytes'] / 1e6:.0f} MB of"
        f" parameters + AdamW state, {cfg['devices']} ranks ({cfg['backend']}, {cfg['device']}),"
        f" torch {cfg['torch']}",
        fontsize=10,
    )
    fig.tight_layout()
    path = out / "checkpoint_bench.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _label(ax: Any, text: str, xy: tuple[float, float]) -> None:
    """A small label just above a bar."""
    ax.annotate(text, xy, ha="center", va="bottom", fontsize=7, xytext=(0, 2), textcoords="offset points")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m lit_parallel.commands.bench.checkpoint")
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
