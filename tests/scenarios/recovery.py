"""Scenarios: automatic recovery under ``torchrun --max-restarts`` and ``auto_resume``.

One torchrun launch of 2 ranks with ``--max-restarts=5``; the strategies create the process group (as in a
user's script). Every attempt runs the same program: for each strategy (ddp_tuned, fsdp_blocks, hsdp,
tp_dp, pp_dp) ``fit(ckpt_path="last")`` with ``ModelCheckpoint(every_n_train_steps=2, save_last=True)``. In attempt
``k`` rank 1 of strategy ``k`` is killed with SIGKILL at the start of step 3 (the last checkpoint is at step
2, in the middle of the first epoch); torchrun restarts every rank and the next attempt resumes strategy
``k`` from ``last.ckpt`` (the strategies before it find their finished run's ``last.ckpt`` and train
nothing). Each fit that trains writes its losses to a file, so the resumed attempt's losses survive to the
last attempt. The last attempt also runs each strategy uninterrupted (the reference) and the auto_resume
checks. Scenarios return plain data; the tests decide what is expected.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from tests.scenarios.fsdp import _full_on_rank0
from tests.scenarios.pipeline import PipeModel
from tests.scenarios.reliability import NoisyLlama, _seed, loader, make_strategy, trainer

STRATEGIES = ("ddp_tuned", "fsdp_blocks", "hsdp", "tp_dp", "pp_dp")
KILL_AT_STEP = 3
LAST_ATTEMPT = len(STRATEGIES)  # attempts 0..4 each kill one strategy; attempt 5 completes


def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class KillRank1(Callback):
    """SIGKILL (no exception, no clean-up) of rank 1 when step ``step`` starts."""

    def __init__(self, enabled: bool, step: int = KILL_AT_STEP):
        self.enabled, self.step = enabled, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.enabled and trainer.global_rank == 1 and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class PipelinedLlama(PipeModel):
    """The pp_dp contract (forward + pipeline_loss) on the reliability tests' (inputs, targets, index)
    batches; ``losses`` records the step loss the strategy reports, as ``NoisyLlama.losses`` does."""

    def __init__(self):
        super().__init__(name="llama")
        self.losses: list[float] = []

    def pipeline_split_batch(self, batch):
        return batch[0], batch[1]

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.losses.append(self.trainer.callback_metrics["train_loss"].item())


def _model(name: str):
    if name == "pp_dp":
        return PipelinedLlama()
    return NoisyLlama(per_rank_rng=name != "tp_dp")  # tensor-parallel ranks must draw the same dropout masks


def _recover_one(ctx, index: int, name: str, root: Path) -> dict:
    folder = root / name
    model = _model(name)
    _seed()
    callbacks = [
        KillRank1(enabled=_attempt() == index),
        ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_last=True),
    ]
    t = trainer(
        ctx, make_strategy(name), enable_checkpointing=True, default_root_dir=folder, callbacks=callbacks
    )
    t.fit(model, loader(), ckpt_path="last")
    if model.losses:  # this attempt trained: keep its losses for the last attempt
        torch.save(
            {"losses": model.losses, "attempt": _attempt(), "resumed_from": str(t.ckpt_path)},
            folder / f"trained_attempt{_attempt()}_rank{ctx.rank}.pt",
        )
    return {"model": _full_on_rank0(model), "global_step": t.global_step}


def _reference(ctx, name: str) -> dict:
    model = _model(name)
    _seed()
    trainer(ctx, make_strategy(name)).fit(model, loader())
    return {"model": _full_on_rank0(model), "losses": model.losses}


def recover_after_kill(ctx) -> dict:
    """Every attempt: each strategy resumes with ckpt_path="last"; the last attempt adds the references."""
    root = Path(ctx.args["dir"])
    out = {"attempt": _attempt()}
    for index, name in enumerate(STRATEGIES):
        out[name] = _recover_one(ctx, index, name, root)
        trained = sorted((root / name).glob(f"trained_attempt*_rank{ctx.rank}.pt"))
        out[name]["trained"] = [torch.load(f, weights_only=True) for f in trained]
        if _attempt() == LAST_ATTEMPT:
            out[name]["reference"] = _reference(ctx, name)
    return out


# --- auto_resume: newest complete checkpoint, a truncated newer one skipped ----------------------------


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _truncate_newest(folder: Path, sharded: bool) -> Path:
    """Cut the newest checkpoint (``step=4``) to half: a file's zip index, or one shard of a folder."""
    newest = folder / "epoch=0-step=4.ckpt"
    victim = sorted(newest.glob("*.distcp"))[0] if sharded else newest
    size = victim.stat().st_size
    with open(victim, "r+b") as f:
        f.truncate(size // 2)
    return newest


def _auto_resume_one(ctx, name: str, root: Path) -> dict:
    folder = root / f"auto_{name}"
    first = NoisyLlama()
    _seed()
    checkpoints = ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=-1)
    trainer(ctx, make_strategy(name), max_epochs=1, enable_checkpointing=True, callbacks=[checkpoints]).fit(
        first, loader()
    )
    if ctx.rank == 0:
        truncated = _truncate_newest(folder, sharded=name != "ddp_tuned")
    dist.barrier()
    records, logger = _Records(), logging.getLogger("lit_parallel")
    level = logger.level
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    try:
        model = NoisyLlama()
        _seed()
        # no ckpt_path: auto_resume searches default_root_dir (and every ModelCheckpoint folder)
        t = trainer(ctx, make_strategy(name, auto_resume=True), default_root_dir=folder)
        t.fit(model, loader())
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    out = {"model": _full_on_rank0(model), "losses": model.losses, "resumed_from": str(t.ckpt_path)}
    if ctx.rank == 0:
        out.update(truncated=str(truncated), log=records.messages)
    return out


def auto_resume_skips_a_truncated_checkpoint(ctx) -> dict:
    """ddp_tuned (single files) and fsdp_blocks (sharded folders): 1 epoch saving every 2 steps, the newest
    checkpoint truncated, then a 2-epoch fit with auto_resume=True and no ckpt_path. Last attempt only."""
    if _attempt() != LAST_ATTEMPT:
        return {}
    root = Path(ctx.args["dir"])
    return {name: _auto_resume_one(ctx, name, root) for name in ("ddp_tuned", "fsdp_blocks")}
