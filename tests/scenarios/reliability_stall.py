"""Scenarios: stall reports, signals, and what a strategy leaves
behind after ``fit``. Run on real gloo ranks by tests/reliability/test_stall.py.

Slow phases sleep :data:`SLOW_S`, more than twice :data:`STALL_S` (the ``stall_timeout`` of these runs), on
one rank while the other waits for it in a collective. Time stamps (``time.time()``) are written to
``args["dir"]`` for the tests to measure how long the processes outlive a stall or a signal.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

from lit_parallel.reliability import LAUNCHER_PID_ENV
from tests.scenarios.fsdp import lm_dataset
from tests.scenarios.reliability import BATCH, NoisyLlama, make_strategy, trainer

STALL_S = 2.0
SLOW_S = 5.0
N_SAMPLES = 24  # 2 ranks x 6 batches x 2 samples


def _stamp(ctx, name: str) -> None:
    (Path(ctx.args["dir"]) / name).write_text(f"{time.time():.6f}")


def _ours() -> list[str]:
    """The names of this process's live lit_parallel threads."""
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("lit_parallel"))


def _record_abort(ctx) -> None:
    """A spy around the compatibility layer's abort (the real one runs): the exit that ends this rank writes
    ``aborted_rank<r>`` (how many groups it aborted, whether torch.distributed was uninitialised after)."""
    from lit_parallel import _compat

    real = _compat.abort_process_groups

    def spy():
        seen = {"groups": len(_compat.all_process_groups())}
        real()
        seen["initialized_after"] = dist.is_initialized()
        (Path(ctx.args["dir"]) / f"aborted_rank{ctx.rank}").write_text(json.dumps(seen))

    _compat.abort_process_groups = spy


class SlowLlama(NoisyLlama):
    """Sleeps where ``slow`` says, on rank 1: ``"first_step"``, ``"validation"``, ``"forever"`` (training
    step 3 of the fit, after a time stamp), ``"recompile"`` (torch.compile compiles a function again for a
    new shape in training step 4, past the warm-up steps, between forward and backward: for ``SLOW_S`` on
    rank 1; quickly on rank 0, which then waits for rank 1 in the gradient all-reduce)."""

    def __init__(self, ctx, slow: set[str]):
        super().__init__()
        self.ctx, self.slow = ctx, slow
        self.compiled_shapes: list[int] = []

        def backend(gm, example_inputs):
            self.compiled_shapes.append(int(example_inputs[0].shape[0]))
            if ctx.rank == 1 and len(self.compiled_shapes) > 1:
                time.sleep(SLOW_S)  # a real compilation: dynamo's compile callbacks run around it
            return gm.forward

        self.double = torch.compile(lambda x: x * 2, backend=backend, dynamic=False)

    def on_before_backward(self, loss):
        # inside the timed step, outside DDP's forward (where dynamo would split the graph into buckets)
        if "recompile" in self.slow:
            self.double(torch.ones(3 if self.trainer.fit_loop.batch_idx >= 4 else 4))  # smaller from step 4

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and batch_idx == 0 and "first_step" in self.slow:
            time.sleep(SLOW_S)
        if self.global_rank == 1 and batch_idx == 3 and "forever" in self.slow:
            _stamp(self.ctx, "stall_started")
            time.sleep(3600)  # STALL HERE
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        if self.global_rank == 1 and batch_idx == 0 and "validation" in self.slow:
            time.sleep(SLOW_S)
        return super().validation_step(batch, batch_idx)


class SlowAt(Dataset):
    """Rank 1 sleeps while loading sample ``at`` (a slow data pipeline)."""

    def __init__(self, base, at: int):
        self.base, self.at, self.calls = base, at, 0

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        self.calls += 1
        if int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", 0))) == 1 and self.calls == self.at:
            time.sleep(SLOW_S)
        return self.base[i]


class SlowSave(Callback):
    """Rank 1 takes ``SLOW_S`` longer to write its part of each checkpoint."""

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if trainer.global_rank == 1:
            time.sleep(SLOW_S)


class ThreadsDuringFit(Callback):
    """The lit_parallel threads alive in the middle of the fit (training batch 2)."""

    def __init__(self):
        self.seen: list[str] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 2:
            self.seen = _ours()


def _fit(ctx, name: str, model, data, val=None, callbacks=(), **kw) -> dict:
    during = ThreadsDuringFit()
    t = trainer(
        ctx, make_strategy(name, stall_timeout=STALL_S), max_epochs=1, callbacks=[during, *callbacks], **kw
    )
    t.fit(model, data, val)
    return {
        "during": during.seen,
        "after": _ours(),
        "env": os.environ.get(LAUNCHER_PID_ENV),
        "losses": len(model.losses),
        "compiled_shapes": model.compiled_shapes,
    }


def three_fits_without_false_stalls(ctx) -> dict:
    """Lightning's launcher, 2 ranks; three fits in the same processes with ``stall_timeout=STALL_S``, each with
    slow phases that are not stalls: (1) ddp_tuned, a slow first step, a slow recompilation in step 4 and a
    slow validation; (2) ddp_tuned, a slow checkpoint save and slow data loading; (3) fsdp_blocks, slow data
    loading."""
    out: dict = {"before": _ours(), "env_before": os.environ.get(LAUNCHER_PID_ENV)}
    val = DataLoader(lm_dataset(n=4), batch_size=BATCH)
    out["fit1"] = _fit(
        ctx,
        "ddp_tuned",
        SlowLlama(ctx, {"first_step", "recompile", "validation"}),
        _loader(),
        val,
        limit_val_batches=1,
    )
    ckpt = ModelCheckpoint(dirpath=Path(ctx.args["dir"]) / "ckpt", every_n_train_steps=3, save_top_k=-1)
    out["fit2"] = _fit(
        ctx,
        "ddp_tuned",
        SlowLlama(ctx, set()),
        _loader(at=9),
        callbacks=[SlowSave(), ckpt],
        enable_checkpointing=True,
    )
    out["fit3"] = _fit(ctx, "fsdp_blocks", SlowLlama(ctx, set()), _loader(at=7))
    # the launch fails on purpose later, which loses returned results
    torch.save(out, Path(ctx.args["dir"]) / f"fits_rank{ctx.rank}.pt")
    return out


def _loader(at: int | None = None) -> DataLoader:
    base = lm_dataset(n=N_SAMPLES)
    return DataLoader(base if at is None else SlowAt(base, at), batch_size=BATCH)


def stall_then_exit(ctx) -> dict:
    """Last scenario of the launch: rank 1 sleeps for good in training step 3 (ddp_tuned, stall_timeout=STALL_S)."""
    _record_abort(ctx)
    trainer(ctx, make_strategy("ddp_tuned", stall_timeout=STALL_S), max_epochs=1).fit(
        SlowLlama(ctx, {"forever"}), _loader()
    )
    return {}


def _signal_when_stuck(ctx, signum: int, pid: int) -> None:
    """On rank 0: once rank 1 sleeps in training_step and rank 0 has waited for it in a collective for a
    second, send ``signum`` to ``pid``."""

    def send():
        mark = Path(ctx.args["dir"]) / "stall_started"
        while not mark.exists():
            time.sleep(0.05)
        time.sleep(1.0)
        _stamp(ctx, "signal_sent")
        os.kill(pid, signum)

    threading.Thread(target=send, daemon=True).start()


def signal_while_blocked(ctx) -> dict:
    """Rank 1 sleeps for good in training step 3, rank 0 waits in a collective; rank 0 sends
    ``args["signal"]`` to the launching process (Lightning's launcher: itself; torchrun: the agent)."""
    signum = signal.Signals[ctx.args["signal"]]
    _record_abort(ctx)
    if ctx.rank == 0:
        _signal_when_stuck(ctx, signum, os.getppid() if ctx.torchrun else os.getpid())
    trainer(ctx, make_strategy("ddp_tuned", stall_timeout=None), max_epochs=1).fit(
        SlowLlama(ctx, {"forever"}), _loader()
    )
    return {"unreachable": torch.tensor(1)}
