"""Reliability scenarios, run on real gloo ranks by tests/reliability/test_failures.py and test_stall.py.

Every strategy (ddp_tuned, fsdp_blocks, hsdp, tp_dp) trains the same tiny Llama (separate q/k/v and gate/up
projections, so tensor-parallel layouts carry over to other strategies) with AdamW, dropout on the logits
and numpy / Python noise on the loss, so an RNG state that is not restored changes the losses. Scenarios
return plain data; the tests decide what is expected.
"""

from __future__ import annotations

import os
import random
import signal
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, Dataset, Sampler

import lit_parallel as lp
from tests.scenarios.common import quiet_trainer
from tests.scenarios.fsdp import LitModel, _full_on_rank0, _opt_state_on_rank0, lm_dataset

BATCH = 2  # per rank
N_SAMPLES = 16  # 2 ranks x 4 batches x 2 samples: 4 training batches per epoch
EPOCHS = 2


def make_strategy(name: str, **kwargs) -> L.pytorch.strategies.Strategy:
    if name == "ddp_tuned":
        return lp.TunedDDPStrategy(**kwargs)
    if name == "fsdp_blocks":
        return lp.TransformerFSDPStrategy(**kwargs)
    if name == "hsdp":
        return lp.HybridShardStrategy(**{"shard_size": 1, **kwargs})  # 2 ranks: 2 replicas x 1 shard
    if name == "tp_dp":
        return lp.TensorParallelStrategy(**kwargs)
    if name == "pp_dp":  # 2 ranks: 2 stages of one data-parallel replica, a micro-batch per sample
        return lp.PipelineParallelStrategy(**{"pipeline_parallel_size": 2, "microbatches": BATCH, **kwargs})
    raise ValueError(name)


class NoisyLlama(LitModel):
    """Llama + dropout on the logits (torch RNG) + a loss factor from numpy's and Python's RNGs."""

    def __init__(self, per_rank_rng: bool = True, **kwargs):
        super().__init__(name="llama", optimizer="adamw", lr=1e-2, **kwargs)
        self.per_rank_rng = per_rank_rng
        self.hooks: dict = {}

    def setup(self, stage):
        # Every rank's RNG states differ (Lightning seeds them alike), so a checkpoint must keep each rank's
        # own. Runs before a checkpoint is restored, so the restore overwrites it.
        if self.per_rank_rng:
            for _ in range(self.global_rank):
                torch.rand(1), np.random.rand(), random.random()

    def training_step(self, batch, batch_idx):
        hook = self.hooks.get("training_step")
        if hook is not None:
            out = hook(self, batch, batch_idx)
            if out is not None:
                return out
        logits = F.dropout(self.model(batch[0]), p=0.1, training=True)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[1].flatten())
        loss = loss * (1.0 + 1e-2 * float(np.random.rand()) + 1e-2 * random.random())
        self.losses.append(loss.detach().float().item())
        return loss


def trainer(ctx, strategy, **kwargs) -> L.Trainer:
    return quiet_trainer(ctx, strategy, **{"max_epochs": EPOCHS, **kwargs})


def loader(n: int = N_SAMPLES, **kwargs) -> DataLoader:
    return DataLoader(lm_dataset(n=n), batch_size=BATCH, **kwargs)


def _seed() -> None:
    L.seed_everything(1234, verbose=False)


def _losses(model) -> torch.Tensor:
    return torch.tensor(model.losses, dtype=torch.float64)


# --- launch: resume, mid-epoch, preemption, integrity (torchrun, 2 ranks) --------------------------------


class SignalAt(Callback):
    """Sends ``signum`` to this process at the start of (epoch, batch) given per rank: SLURM signals every
    task, but each receives it at a different point of its step."""

    def __init__(self, signum: int, at: dict[int, tuple[int, int]]):
        self.signum, self.at = signum, at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.at.get(trainer.global_rank) == (trainer.current_epoch, batch_idx):
            os.kill(os.getpid(), self.signum)


def _slurm_environment(ctx, bin_dir: Path) -> dict:
    """What srun sets for this task, and a fake ``scontrol`` that records its arguments."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    scontrol = bin_dir / "scontrol"
    if ctx.rank == 0:
        scontrol.write_text(f'#!/bin/sh\necho "$@" >> "{bin_dir / "scontrol.log"}"\n')
        scontrol.chmod(0o755)
    return {
        "SLURM_NTASKS": str(ctx.world_size),
        "SLURM_NTASKS_PER_NODE": str(ctx.nprocs),
        "SLURM_NNODES": "1",
        "SLURM_PROCID": str(ctx.rank),
        "SLURM_LOCALID": str(int(os.environ.get("LOCAL_RANK", ctx.rank))),
        "SLURM_NODEID": "0",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "lit-parallel-test",
        "SLURM_NODELIST": "127.0.0.1",
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
    }


class _environ:
    def __init__(self, values: dict):
        self.values, self.saved = values, {}

    def __enter__(self):
        self.saved = {k: os.environ.get(k) for k in self.values}
        os.environ.update(self.values)

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _resume_cases(ctx, name: str) -> dict:
    """Uninterrupted run with checkpoints at epoch ends and every 3 steps; resumes from the end of epoch 0,
    from step 6 (mid-epoch: epoch 1 after 2 of 4 batches; tp_dp, whose 2 ranks read the same data, epoch 0
    after 6 of 8) and after a preemption signal at epoch 1, batch 0 (SLURM's environment, a fake scontrol)."""
    root = Path(ctx.args["dir"]) / name
    per_rank = name != "tp_dp"  # tensor-parallel ranks must draw the same dropout masks
    out: dict = {}

    def fit(model, ckpt_path=None, **kw):
        _seed()
        t = trainer(ctx, make_strategy(name), **kw)
        t.fit(model, loader(), ckpt_path=ckpt_path)
        return t

    full = NoisyLlama(per_rank_rng=per_rank)
    epoch_cb = ModelCheckpoint(
        dirpath=root / "epoch",
        filename="epoch{epoch}",
        auto_insert_metric_name=False,
        every_n_epochs=1,
        save_top_k=-1,
        save_on_train_epoch_end=True,
    )
    step_cb = ModelCheckpoint(
        dirpath=root / "step",
        filename="step{step}",
        auto_insert_metric_name=False,
        every_n_train_steps=3,
        save_top_k=-1,
    )
    t = fit(full, callbacks=[epoch_cb, step_cb], enable_checkpointing=True)
    out["full"] = {
        "losses": _losses(full),
        "params": _full_on_rank0(full),
        "batches_per_epoch": t.num_training_batches,
    }
    out["epoch_ckpt"] = str(root / "epoch" / "epoch0.ckpt")
    out["step_ckpt"] = str(root / "step" / "step6.ckpt")
    for label, path in (("from_epoch_end", out["epoch_ckpt"]), ("from_mid_epoch", out["step_ckpt"])):
        model = NoisyLlama(per_rank_rng=per_rank)
        fit(model, ckpt_path=path)
        out[label] = {"losses": _losses(model), "params": _full_on_rank0(model)}

    slurm_dir = root / "slurm"
    with _environ(_slurm_environment(ctx, root / "bin")):
        first = NoisyLlama(per_rank_rng=per_rank)
        signals = SignalAt(signal.SIGUSR1, {0: (1, 0), 1: (1, 1)})
        t = fit(first, default_root_dir=slurm_dir, callbacks=[signals])
        cluster = type(t.strategy.cluster_environment).__name__
        stopped_at = t.global_step
        second = NoisyLlama(per_rank_rng=per_rank)
        # the requeued job: no ckpt_path, Lightning finds hpc_ckpt_1.ckpt in default_root_dir
        fit(second, default_root_dir=slurm_dir)
        out["preempted"] = {
            "cluster": cluster,
            "stopped_at_step": stopped_at,
            "first": _losses(first),
            "second": _losses(second),
            "params": _full_on_rank0(second),
            "dir": str(slurm_dir),
            "scontrol_log": str(root / "bin" / "scontrol.log"),
        }
    return out


def resume_ddp_tuned(ctx) -> dict:
    return _resume_cases(ctx, "ddp_tuned")


def resume_fsdp_blocks(ctx) -> dict:
    return _resume_cases(ctx, "fsdp_blocks")


def resume_hsdp(ctx) -> dict:
    return _resume_cases(ctx, "hsdp")


def resume_tp_dp(ctx) -> dict:
    return _resume_cases(ctx, "tp_dp")


class EveryOtherSampler(Sampler):
    """A user's own sampler (no position to restore): this rank's half of the indices, in order."""

    def __init__(self, n: int, rank: int, world: int):
        self.indices = list(range(rank, n, world))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


def refusals(ctx) -> dict:
    """Mid-epoch checkpoints that cannot continue exactly, and incomplete checkpoints: each load must fail
    with an error naming the reason, before training a single batch."""
    root = Path(ctx.args["dir"]) / "refusals"
    out: dict = {}

    def attempt(label, name, ckpt_path, data, **kw):
        model = NoisyLlama()
        _seed()
        try:
            trainer(ctx, make_strategy(name), **kw).fit(model, data, ckpt_path=ckpt_path)
            out[label] = {"error": None, "trained": len(model.losses)}
        except Exception as err:  # noqa: BLE001
            out[label] = {"error": f"{type(err).__name__}: {err}", "trained": len(model.losses)}

    for name in ("ddp_tuned", "fsdp_blocks"):
        own = DataLoader(
            lm_dataset(n=N_SAMPLES),
            batch_size=BATCH,
            sampler=EveryOtherSampler(N_SAMPLES, ctx.rank, ctx.world_size),
        )
        step_cb = ModelCheckpoint(
            dirpath=root / name,
            filename="step{step}",
            auto_insert_metric_name=False,
            every_n_train_steps=3,
            save_top_k=-1,
        )
        _seed()
        trainer(
            ctx,
            make_strategy(name),
            use_distributed_sampler=False,
            callbacks=[step_cb],
            enable_checkpointing=True,
            max_epochs=1,
        ).fit(NoisyLlama(), own)
        attempt(f"{name}_own_sampler", name, root / name / "step3.ckpt", own, use_distributed_sampler=False)

    # a checkpoint saved inside a gradient accumulation window (batch 0 of a 2-batch window)
    class SaveAt(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 1 and batch_idx == 2:
                trainer.save_checkpoint(root / "window.ckpt")

    _seed()
    trainer(
        ctx, make_strategy("ddp_tuned"), accumulate_grad_batches=2, callbacks=[SaveAt()], max_epochs=1
    ).fit(NoisyLlama(), loader())
    attempt("in_accumulation_window", "ddp_tuned", root / "window.ckpt", loader(), accumulate_grad_batches=2)

    # incomplete checkpoints (what an interrupted save would look like without temp-then-rename)
    source = Path(ctx.args["dir"]) / "fsdp_blocks" / "epoch" / "epoch0.ckpt"
    broken = root / "no_shard.ckpt"
    truncated = root / "truncated.ckpt"
    if ctx.rank == 0:
        import shutil

        shutil.copytree(source, broken)
        (broken / "__1_0.distcp").unlink()
        full = Path(ctx.args["dir"]) / "ddp_tuned" / "epoch" / "epoch0.ckpt"
        truncated.write_bytes(full.read_bytes()[: full.stat().st_size // 2])
    dist.barrier()
    attempt("missing_shard", "fsdp_blocks", broken, loader())
    attempt("truncated_file", "ddp_tuned", truncated, loader())
    return out


def mark_end(ctx) -> dict:
    """The time the last scenario of a clean launch ends (what a clean run needs to shut down is measured
    from here)."""
    (Path(ctx.args["dir"]) / f"end_rank{ctx.rank}").write_text(f"{time.time():.6f}")
    return {}


# --- launch: hangs (torchrun, 2 ranks; each case on a fresh process group) ------------------------------

TIMEOUT_S = 4.0
_BASE_STORE = None


def _fresh_process_group(tag: str) -> None:
    """A new default process group on the launch's store: a timed-out collective leaves the old one unusable.
    Its own timeout is long, so what fires is the strategy's ``timeout`` (applied to existing groups)."""
    global _BASE_STORE
    if _BASE_STORE is None:
        _BASE_STORE = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"lp_case_{tag}/", _BASE_STORE),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )


def _hang_mark(ctx, tag: str) -> Path:
    """Where the rank that starts case ``tag``'s hang writes the moment it starts (``time.time()``)."""
    return Path(ctx.args.get("dir", ctx.outdir)) / f"{tag}_hang_started"


def _mark_now(path: Path) -> None:
    path.write_text(f"{time.time():.6f}")


def _wait_for(path: Path, limit: float) -> None:
    deadline = time.monotonic() + limit
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


class StuckDataset(Dataset):
    """Rank ``rank`` blocks in ``__getitem__`` at sample ``at`` until ``release`` exists (a stuck data pipeline)."""

    def __init__(self, base, rank: int, at: int, release: Path, limit: float, mark: Path | None = None):
        self.base, self.rank, self.at, self.release, self.limit, self.mark = (
            base,
            rank,
            at,
            release,
            limit,
            mark,
        )
        self.calls = 0

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        self.calls += 1
        if dist.get_rank() == self.rank and self.calls == self.at:
            if self.mark is not None:
                _mark_now(self.mark)
            _wait_for(self.release, self.limit)
        return self.base[i]


def _hang_case(ctx, tag: str, name: str, model, data, release: Path) -> dict:
    """Run one hang; the error is caught so the next case runs in the same processes. The result is also
    written to ``args["dir"]``: the launch's last case fails on purpose, which loses returned results.
    ``elapsed``: seconds from the start of ``fit`` to its error; ``since_hang``: from the moment the hang
    started (:func:`_hang_mark`, written by the rank that starts it) to this rank's error."""
    _fresh_process_group(tag)
    start = time.monotonic()
    err = None
    try:
        trainer(ctx, make_strategy(name, timeout=timedelta(seconds=TIMEOUT_S)), max_epochs=1).fit(model, data)
    except Exception as e:  # noqa: BLE001
        err = f"{type(e).__name__}: {e}"
    elapsed, ended = time.monotonic() - start, time.time()
    if ctx.rank == 0:
        release.write_text("go")
    _wait_for(release, 60)
    mark = _hang_mark(ctx, tag)  # written before the hang, so before the release
    since_hang = ended - float(mark.read_text()) if mark.exists() else None
    result = {"error": err, "elapsed": elapsed, "since_hang": since_hang}
    torch.save(result, Path(ctx.args["dir"]) / f"{tag}_rank{ctx.rank}.pt")
    return result


def hang_in_data_loading(ctx) -> dict:
    """ddp_tuned: rank 1 blocks while loading its third batch; rank 0 waits in backward's all-reduce."""
    release = Path(ctx.outdir) / "release_data"
    data = DataLoader(
        StuckDataset(
            lm_dataset(n=N_SAMPLES), 1, at=5, release=release, limit=60, mark=_hang_mark(ctx, "data")
        ),
        batch_size=BATCH,
    )
    return _hang_case(ctx, "data", "ddp_tuned", NoisyLlama(), data, release)


def skipped_backward(ctx) -> dict:
    """fsdp_blocks: on batch 1, rank 1 runs the forward pass but returns a loss computed from nothing (a
    rank-dependent branch that skips backward through the model)."""
    release = Path(ctx.outdir) / "release_skip"
    model = NoisyLlama()

    def skip(module, batch, batch_idx):
        if batch_idx == 1 and module.global_rank == 1:
            _mark_now(_hang_mark(ctx, "skip"))
            module.model(batch[0])
            return torch.zeros((), requires_grad=True)
        return None

    model.hooks["training_step"] = skip
    return _hang_case(ctx, "skip", "fsdp_blocks", model, loader(), release)


def collective_on_one_rank(ctx) -> dict:
    """hsdp (2 replicas): on batch 1 only rank 0 logs with sync_dist=True (an all-reduce rank 1 never joins);
    rank 1 goes on to backward, whose all-reduce runs on the replicate sub-group of the mesh."""
    release = Path(ctx.outdir) / "release_sync"
    model = NoisyLlama()

    def log_on_rank0(module, batch, batch_idx):
        if batch_idx == 1 and module.global_rank == 0:
            _mark_now(_hang_mark(ctx, "sync"))
            module.log("rank0_only", torch.tensor(1.0), sync_dist=True)
        return None

    model.hooks["training_step"] = log_on_rank0
    return _hang_case(ctx, "sync", "hsdp", model, loader(), release)


def stuck_in_training_step(ctx) -> dict:
    """tp_dp (tensor parallel over both ranks): rank 1 blocks inside training_step of batch 1; rank 0 waits
    in the first tensor-parallel collective of the forward pass."""
    release = Path(ctx.outdir) / "release_tp"
    model = NoisyLlama(per_rank_rng=False)

    def block(module, batch, batch_idx):
        if batch_idx == 1 and module.global_rank == 1:
            _mark_now(_hang_mark(ctx, "tp"))
            _wait_for(release, 60)
        return None

    model.hooks["training_step"] = block
    return _hang_case(ctx, "tp", "tp_dp", model, loader(), release)


def hang_until_exit(ctx) -> dict:
    """Last case, not caught: rank 1 blocks in data loading for good; every process must be gone within the
    timeout plus a few seconds (the launch ends)."""
    _fresh_process_group("exit")
    mark = Path(ctx.args["dir"]) / "hang_started"
    data = DataLoader(
        StuckDataset(lm_dataset(n=N_SAMPLES), 1, at=5, release=Path("/nonexistent"), limit=600, mark=mark),
        batch_size=BATCH,
    )
    trainer(ctx, make_strategy("ddp_tuned", timeout=timedelta(seconds=TIMEOUT_S)), max_epochs=1).fit(
        NoisyLlama(), data
    )
    return {}


# --- launch: Lightning's launcher, failures that the same processes recover from -------------------------


def _caught_fit(ctx, strategy, model, data, **kw) -> dict:
    start = time.monotonic()
    try:
        t = trainer(ctx, strategy, **kw)
        t.fit(model, data)
        return {"error": None, "elapsed": time.monotonic() - start, "world": t.world_size}
    except Exception as e:  # noqa: BLE001
        return {
            "error": f"{type(e).__name__}: {e}",
            "elapsed": time.monotonic() - start,
            "ended": time.time(),
        }


def recovery_under_lightning_launcher(ctx) -> dict:
    """``python train.py`` with devices=2: the strategy creates (and owns) the process group.

    1. hsdp with debug_level='detail': rank 1 runs an extra all-reduce on the replicate group -> torch's
       fingerprint check names the mismatch at once.
    2. fsdp_blocks with timeout=4 s: rank 1 blocks in training_step -> rank 0's collective times out.
    3. ddp_tuned trains normally in the same processes: each failed run destroyed its process group, so a
       fresh one is created.
    """
    out: dict = {}
    rank = int(os.environ.get("LOCAL_RANK", 0))
    model = NoisyLlama()

    def extra_allreduce(module, batch, batch_idx):
        if batch_idx == 1 and module.global_rank == 1:
            group = module.device_mesh["data_parallel_replicate"].get_group()
            dist.all_reduce(torch.ones(3), group=group)
        return None

    model.hooks["training_step"] = extra_allreduce
    strategy = make_strategy("hsdp", debug_level="detail", timeout=timedelta(seconds=TIMEOUT_S))
    out["mismatch"] = _caught_fit(ctx, strategy, model, loader(), max_epochs=1)
    out["mismatch"]["initialized_after"] = dist.is_initialized()

    release = Path(ctx.outdir) / "release_lightning"
    model = NoisyLlama()

    def block(module, batch, batch_idx):
        if batch_idx == 1 and module.global_rank == 1:
            _mark_now(_hang_mark(ctx, "lightning"))
            _wait_for(release, 60)
        return None

    model.hooks["training_step"] = block
    strategy = make_strategy("fsdp_blocks", timeout=timedelta(seconds=TIMEOUT_S))
    out["timeout"] = _caught_fit(ctx, strategy, model, loader(), max_epochs=1)
    out["timeout"]["initialized_after"] = dist.is_initialized()
    if rank == 0:
        release.write_text("go")
    _wait_for(release, 60)
    if "ended" in out["timeout"]:  # from the moment rank 1 started to block (written before the release)
        out["timeout"]["since_hang"] = out["timeout"]["ended"] - float(
            _hang_mark(ctx, "lightning").read_text()
        )
    # both ranks must have left the failed run before the next one rendezvouses
    (Path(ctx.outdir) / f"left_{rank}").write_text("x")
    for r in range(ctx.nprocs):
        _wait_for(Path(ctx.outdir) / f"left_{r}", 60)

    model = NoisyLlama()
    strategy = make_strategy("ddp_tuned")
    out["clean"] = _caught_fit(ctx, strategy, model, loader(), max_epochs=1)
    out["clean"]["losses"] = _losses(model)
    out["clean"]["owns"] = strategy.reliability.owns_process_group
    return out


# --- launches that fail on purpose ----------------------------------------------------------------------


def raise_during_checkpoint_save(ctx) -> dict:
    """fsdp_blocks on torchrun: epoch 0 ends with a complete checkpoint ``last.ckpt``; the resumed run's
    end-of-epoch save to the same path fails: rank 1 raises while writing its shard. The old checkpoint must
    stay whole and every process must exit promptly."""
    root = Path(ctx.args["dir"])

    def last():
        return ModelCheckpoint(
            dirpath=root,
            filename="last",
            every_n_epochs=1,
            save_on_train_epoch_end=True,
            enable_version_counter=False,
            save_top_k=-1,
        )

    model = NoisyLlama()
    _seed()
    trainer(
        ctx, make_strategy("fsdp_blocks"), max_epochs=1, callbacks=[last()], enable_checkpointing=True
    ).fit(model, loader())
    saved = _full_on_rank0(model)
    if ctx.rank == 0:
        torch.save(saved, root / "expected_model.pt")

    if ctx.rank == 1:
        # rank 1 fails in the middle of the new save: its shard is on disk, the save not yet committed. The
        # failure is raised in its own code path after the write (a signal at an arbitrary moment could land
        # inside torch.save's zip writer, whose own error on closing the file then replaces it)
        from torch.distributed.checkpoint import FileSystemWriter

        write_data = FileSystemWriter.write_data

        def write_then_fail(self, plan, planner):
            written = write_data(self, plan, planner)
            written.wait()
            (root / f"raised_{ctx.rank}").write_text(f"{time.time():.6f}")
            raise ValueError(f"failure injected on rank {ctx.rank} while writing its checkpoint shard")

        FileSystemWriter.write_data = write_then_fail
    trainer(
        ctx, make_strategy("fsdp_blocks"), max_epochs=2, callbacks=[last()], enable_checkpointing=True
    ).fit(NoisyLlama(), loader(), ckpt_path=root / "last.ckpt")
    return {}


def rank0_raises_while_rank1_is_stuck(ctx) -> dict:
    """ddp_tuned under Lightning's launcher: rank 1 blocks in data loading for two minutes and rank 0 raises
    (before its next collective). Without a watchdog rank 1 would outlive the failed run."""
    mark = Path(ctx.args["dir"]) / "rank1_stuck"
    data = DataLoader(
        StuckDataset(lm_dataset(n=N_SAMPLES), 1, at=3, release=Path("/nonexistent"), limit=120, mark=mark),
        batch_size=BATCH,
    )

    class FailOnRank0(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 1 and trainer.global_rank == 0:
                _wait_for(mark, 60)
                (Path(ctx.args["dir"]) / "rank0_raised").write_text(f"{time.time():.6f}")
                raise ValueError("failure injected on rank 0")

    trainer(ctx, make_strategy("ddp_tuned"), max_epochs=1, callbacks=[FailOnRank0()]).fit(NoisyLlama(), data)
    return {}


def rank0_killed_while_rank1_is_stuck(ctx) -> dict:
    """ddp_tuned under Lightning's launcher: rank 0 is killed (SIGKILL: no exception, no clean-up) while
    rank 1 is blocked in data loading for two minutes. Rank 1 must notice and exit."""
    mark = Path(ctx.args["dir"]) / "rank1_stuck"
    data = DataLoader(
        StuckDataset(lm_dataset(n=N_SAMPLES), 1, at=3, release=Path("/nonexistent"), limit=120, mark=mark),
        batch_size=BATCH,
    )

    class KillRank0(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 1 and trainer.global_rank == 0:
                _wait_for(mark, 60)
                (Path(ctx.args["dir"]) / "rank0_killed").write_text(f"{time.time():.6f}")
                os.kill(os.getpid(), signal.SIGKILL)

    trainer(ctx, make_strategy("ddp_tuned"), max_epochs=1, callbacks=[KillRank0()]).fit(NoisyLlama(), data)
    return {}


_SAVES: list[str] = []  # this process's torch.save calls (FailsInTrainEnd's spy)


class FailsInTrainEnd(NoisyLlama):
    """Rank 1 raises in ``on_train_end``, after an epoch-end checkpoint. A module-level class: ``ddp_spawn``
    pickles the Trainer and the model into its processes. In every rank, ``torch.save`` is counted from
    ``setup`` on; the counts are written to ``<dir>/saves_rank<r>`` at ``on_train_end``."""

    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = out

    def setup(self, stage):
        super().setup(stage)
        if not _SAVES:
            original = torch.save

            def counted(obj, f, *args, **kwargs):
                _SAVES.append(str(f))
                return original(obj, f, *args, **kwargs)

            _SAVES.append("spy installed")
            torch.save = counted

    def on_train_end(self):
        (Path(self.out) / f"saves_rank{self.global_rank}").write_text("\n".join(_SAVES[1:]))
        if self.global_rank == 1:
            raise ValueError("failure injected on rank 1 in on_train_end")


def rank1_raises_in_on_train_end(ctx) -> dict:
    """ddp_tuned, one epoch of 2 batches with an epoch-end checkpoint, then rank 1 raises in ``on_train_end``;
    ``args["start_method"]``: ``"popen"`` (torchrun, Lightning's ``ddp`` launcher) or ``"spawn"``."""
    out = Path(ctx.args["dir"])
    ckpt = ModelCheckpoint(
        dirpath=out / "ckpt",
        filename="epoch{epoch}",
        save_top_k=-1,
        save_on_train_epoch_end=True,
        auto_insert_metric_name=False,
    )
    strategy = make_strategy("ddp_tuned", start_method=ctx.args.get("start_method", "popen"))
    t = trainer(
        ctx, strategy, max_epochs=1, limit_train_batches=2, callbacks=[ckpt], enable_checkpointing=True
    )
    t.fit(FailsInTrainEnd(str(out)), loader())
    return {}


class ReadsAShardInTestStep(L.LightningModule):
    """Lightning's ``test_params_synced_during_nonfit`` model: a ``Linear(1, 1)`` built in ``setup`` (its own
    FSDP group under fsdp_blocks) whose weight ``test_step`` reads with ``.item()``: rank 1 holds none of it."""

    def setup(self, stage):
        self.layer = torch.nn.Linear(1, 1)

    def test_step(self, batch, batch_idx):
        return self.layer.weight.item()


def rank1_reads_an_empty_shard_in_test_step(ctx) -> dict:
    """fsdp_blocks, ``trainer.test`` only: rank 1's ``.item()`` of its empty shard raises in ``test_step``."""
    trainer(ctx, lp.TransformerFSDPStrategy()).test(ReadsAShardInTestStep(), [0])
    return {}


# --- launches: resharding 4 -> 3 ranks ------------------------------------------------------------------


def _train_and_save(ctx, name, strategy, path: Path) -> dict:
    model = NoisyLlama(per_rank_rng=False)
    _seed()
    t = trainer(ctx, strategy, max_epochs=1)
    t.fit(model, DataLoader(lm_dataset(n=32), batch_size=BATCH))
    t.save_checkpoint(path)
    return {
        "model": _full_on_rank0(model),
        "optimizer": _opt_state_on_rank0(model, t.optimizers[0]),
        "global_step": t.global_step,
    }


def reshard_save(ctx) -> dict:
    """On 4 ranks: fsdp_blocks, hsdp (2 x 2) and tp_dp (2 x 2) each train one epoch and save."""
    root = Path(ctx.args["dir"])
    return {
        "fsdp_blocks": _train_and_save(ctx, "fsdp_blocks", lp.TransformerFSDPStrategy(), root / "fsdp.ckpt"),
        "hsdp": _train_and_save(ctx, "hsdp", lp.HybridShardStrategy(shard_size=2), root / "hsdp.ckpt"),
        "tp_dp": _train_and_save(
            ctx, "tp_dp", lp.TensorParallelStrategy(tensor_parallel_size=2), root / "tp.ckpt"
        ),
    }


def _restore(ctx, strategy, path) -> dict:
    model = NoisyLlama(per_rank_rng=False)
    t = trainer(ctx, strategy, max_epochs=1)  # the checkpoint is at the end of epoch 0: nothing to train
    t.fit(model, DataLoader(lm_dataset(n=32), batch_size=BATCH), ckpt_path=path)
    return {
        "model": _full_on_rank0(model),
        "optimizer": _opt_state_on_rank0(model, t.optimizers[0]),
        "global_step": t.global_step,
        "trained": len(model.losses),
        "strategy": type(t.strategy).__name__,
        "world": t.world_size,
    }


def reshard_load(ctx) -> dict:
    """On 3 ranks: each 4-rank checkpoint restored into a different layout."""
    root = Path(ctx.args["dir"])
    return {
        "fsdp_to_fsdp": _restore(ctx, lp.TransformerFSDPStrategy(), root / "fsdp.ckpt"),
        "hsdp_to_hsdp_1x3": _restore(ctx, lp.HybridShardStrategy(shard_size=3), root / "hsdp.ckpt"),
        "hsdp_to_hsdp_3x1": _restore(ctx, lp.HybridShardStrategy(shard_size=1), root / "hsdp.ckpt"),
        "tp_to_fsdp": _restore(ctx, lp.TransformerFSDPStrategy(), root / "tp.ckpt"),
        "fsdp_to_ddp": _restore(ctx, lp.TunedDDPStrategy(), root / "fsdp_consolidated.ckpt"),
    }
