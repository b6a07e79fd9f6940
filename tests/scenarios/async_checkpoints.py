"""Scenarios: asynchronous checkpoints (``async_checkpoint=True``) under every strategy, and ``kill -9`` of a
rank during a background write.

One torchrun launch of 2 ranks with ``--max-restarts=5``, as tests/scenarios/recovery.py. Every attempt runs,
for each strategy (ddp_tuned, fsdp_blocks, hsdp, tp_dp, pp_dp), ``fit(ckpt_path="last")`` with
``async_checkpoint=True`` and ``ModelCheckpoint(every_n_train_steps=2, save_top_k=1, monitor="step")``: each
save deletes the one before it, and ``last.ckpt`` is a link (``save_last="link"``) for ddp_tuned, hsdp and
pp_dp, a second save of the same state (``save_last=True``) for fsdp_blocks and tp_dp. In attempt ``k`` the
background write of strategy ``k``'s ``step=4`` checkpoint kills its process with SIGKILL: under ddp_tuned
rank 0 (the one that writes the file) right before the commit, under the sharded strategies rank 1 right after
its shard is written. torchrun restarts every rank; the next attempt resumes strategy ``k`` from ``last.ckpt``,
which must still be the committed ``step=2`` checkpoint, whose deletion waited behind the killed write. The
last attempt adds, per strategy, the uninterrupted references: a synchronous run, an asynchronous run, and a
resume from the asynchronously written ``step=4`` checkpoint of that run.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import lit_parallel.checkpoint.write as checkpoint_write
from lit_parallel.checkpoint.background import BackgroundWriter
from tests.scenarios.fsdp import _full_on_rank0
from tests.scenarios.recovery import _attempt, _model
from tests.scenarios.reliability import _seed, loader, make_strategy, trainer

STRATEGIES = ("ddp_tuned", "fsdp_blocks", "hsdp", "tp_dp", "pp_dp")
LAST_ATTEMPT = len(STRATEGIES)
KILLED_SAVE = "step=4.ckpt"
LINKED = ("ddp_tuned", "hsdp", "pp_dp")
WRITER = BackgroundWriter().name  # the writer thread's name


def checkpoints_top1(folder: Path, name: str) -> ModelCheckpoint:
    """Every 2 steps, keeping the newest; ``last.ckpt`` a link (``LINKED``) or a second save of the state."""
    return ModelCheckpoint(
        dirpath=folder,
        filename="{step}",
        every_n_train_steps=2,
        save_top_k=1,
        monitor="step",
        mode="max",
        save_last="link" if name in LINKED else True,
    )


class _KillDuringWrite:
    """SIGKILL of this process inside the background write of ``KILLED_SAVE``: ``ddp_tuned``'s rank 0 right
    before its commit (the file is written under its temporary name), a sharded strategy's rank 1 right after
    its DCP shard is written (rank 0 has not written ``.metadata`` nor committed)."""

    def __init__(self, name: str, rank: int):
        self.name, self.rank = name, rank
        self.restore = []

    def __enter__(self):
        if self.name == "ddp_tuned" and self.rank == 0:
            commit = checkpoint_write.commit

            def commit_or_die(partial, destination, **kw):
                if threading.current_thread().name == WRITER and Path(destination).name == KILLED_SAVE:
                    os.kill(os.getpid(), signal.SIGKILL)
                return commit(partial, destination, **kw)

            checkpoint_write.commit = commit_or_die
            self.restore.append((checkpoint_write, "commit", commit))
        elif self.name != "ddp_tuned" and self.rank == 1:
            from torch.distributed.checkpoint import FileSystemWriter

            write_data = FileSystemWriter.write_data
            calls = {"n": 0}

            def write_then_die(writer, plan, planner):
                written = write_data(writer, plan, planner)
                if threading.current_thread().name == WRITER:
                    calls["n"] += 1
                    # the writes: step=2, last (fsdp_blocks, tp_dp: a second save), step=4
                    if calls["n"] == (2 if self.name in LINKED else 3):
                        written.wait()
                        os.kill(os.getpid(), signal.SIGKILL)
                return written

            FileSystemWriter.write_data = write_then_die
            self.restore.append((FileSystemWriter, "write_data", write_data))
        return self

    def __exit__(self, *exc):
        for owner, attribute, value in self.restore:
            setattr(owner, attribute, value)


def _state_of(folder: Path) -> dict:
    """What is in a strategy's checkpoint folder: names, where last.ckpt points, temporary leftovers."""
    last = folder / "last.ckpt"
    return {
        "names": sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")),
        "partials": sorted(p.name for p in folder.iterdir() if p.name.startswith(".lit_parallel_partial_")),
        "last_link": os.readlink(last) if last.is_symlink() else None,
    }


def _fit_one(ctx, index: int, name: str, root: Path) -> dict:
    folder = root / name
    before = _state_of(folder) if folder.exists() else None
    model = _model(name)
    _seed()
    t = trainer(
        ctx,
        make_strategy(name, async_checkpoint=True),
        enable_checkpointing=True,
        default_root_dir=folder,
        callbacks=[checkpoints_top1(folder, name)],
    )
    with _KillDuringWrite(name, ctx.rank) if _attempt() == index else _Nothing():
        t.fit(model, loader(), ckpt_path="last")
    if model.losses:  # this attempt trained: keep its record for the last attempt
        torch.save(
            {
                "losses": model.losses,
                "attempt": _attempt(),
                "resumed_from": str(t.ckpt_path),
                "folder_before": before,
            },
            folder / f"trained_attempt{_attempt()}_rank{ctx.rank}.pt",
        )
    return {"model": _full_on_rank0(model), "global_step": t.global_step, "folder": _state_of(folder)}


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def _references(ctx, name: str, root: Path) -> dict:
    """Uninterrupted: synchronous, asynchronous (saving as above), and a resume from the asynchronous run's
    step=4 checkpoint (kept by a second callback that keeps every save)."""
    out = {}
    sync = _model(name)
    _seed()
    trainer(ctx, make_strategy(name)).fit(sync, loader())
    out["sync"] = {"model": _full_on_rank0(sync), "losses": sync.losses}
    folder = root / f"{name}_reference"
    kept = root / f"{name}_every_save"
    every = ModelCheckpoint(dirpath=kept, filename="{step}", every_n_train_steps=2, save_top_k=-1)
    asynchronous = _model(name)
    _seed()
    t = trainer(
        ctx,
        make_strategy(name, async_checkpoint=True),
        enable_checkpointing=True,
        callbacks=[checkpoints_top1(folder, name), every],
    )
    t.fit(asynchronous, loader())
    checkpoints = t.strategy.reliability.checkpoints
    out["async"] = {
        "model": _full_on_rank0(asynchronous),
        "losses": asynchronous.losses,
        "folder": _state_of(folder),
        "every": sorted(p.name for p in kept.iterdir()),
        "pending_after_fit": checkpoints.writer.pending_writes(),
        "written": [Path(d).name for d, _ in checkpoints.writer.completed],
        # None on ddp_tuned's rank 1: only rank 0 writes the file, so only it holds a copy
        "host": None
        if checkpoints.host is None
        else {"nbytes": checkpoints.host.nbytes, "allocated_bytes": checkpoints.host.allocated_bytes},
    }
    resumed = _model(name)
    _seed()
    trainer(ctx, make_strategy(name)).fit(resumed, loader(), ckpt_path=kept / "step=4.ckpt")
    out["resumed"] = {"model": _full_on_rank0(resumed), "losses": resumed.losses}
    return out


def async_recover_after_kill(ctx) -> dict:
    root = Path(ctx.args["dir"])
    out = {"attempt": _attempt()}
    for index, name in enumerate(STRATEGIES):
        out[name] = _fit_one(ctx, index, name, root)
        trained = sorted((root / name).glob(f"trained_attempt*_rank{ctx.rank}.pt"))
        out[name]["trained"] = [torch.load(f, weights_only=False) for f in trained]
        if _attempt() == LAST_ATTEMPT:
            out[name]["reference"] = _references(ctx, name, root)
    return out
