"""Preemption: on the requeue signal, the ranks agree at an optimizer-step boundary, save ``hpc_ckpt_N.ckpt``,
requeue the SLURM job and stop."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lit_parallel import _compat, _logging

if TYPE_CHECKING:
    import lightning.pytorch as pl


class Preemption:
    """The signal handler: it only raises a flag, read at the next optimizer-step boundary."""

    def __init__(self, signum: signal.Signals, slurm: bool) -> None:
        self.signum = signum
        self.slurm = slurm
        self.requested = False
        self.retired = False
        self._previous: Any = None

    @classmethod
    def for_environment(cls, wanted: Any, env: Any) -> Preemption | None:
        """The handler for ``preemption_signal=wanted`` under cluster environment ``env`` (``None``: off)."""
        from lightning.fabric.plugins.environments import SLURMEnvironment

        # torchrun inside a SLURM job runs under TorchElasticEnvironment: the job is still SLURM's
        slurm = isinstance(env, SLURMEnvironment) or SLURMEnvironment.detect()
        if wanted == "auto":
            if isinstance(env, SLURMEnvironment):
                wanted = env.requeue_signal if env.auto_requeue else None
            else:
                wanted = signal.SIGUSR1 if slurm else None
        return None if wanted is None else cls(signal.Signals(wanted), slurm=slurm)

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(self.signum, self._handler)

    def uninstall(self) -> None:
        self.retired = True
        if (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(self.signum) == self._handler
        ):
            signal.signal(self.signum, self._previous if self._previous is not None else signal.SIG_DFL)

    def _handler(self, signum: int, frame: Any) -> None:
        if self.retired:  # left installed after its run: behave as the handler it replaced
            previous = self._previous if self._previous is not None else signal.SIG_DFL
            signal.signal(self.signum, previous)
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_DFL:
                os.kill(os.getpid(), signum)
            return
        # Only a flag: saving here, at an arbitrary point of a step, would interleave collectives.
        self.requested = True
        if callable(self._previous):
            self._previous(signum, frame)

    def check(self, trainer: pl.Trainer, batch: int) -> None:
        """At an optimizer-step boundary: if any rank got the signal, save, requeue and stop (every rank)."""
        strategy = trainer.strategy
        flag = torch.tensor([1.0 if self.requested else 0.0], device=strategy.root_device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() == 0:
            return
        self.requested = False
        path = strategy.broadcast(_compat.hpc_save_path(trainer, trainer.default_root_dir))
        trainer.save_checkpoint(path)
        requeued = ""
        if strategy.is_global_zero and self.slurm:
            requeued = _requeue_slurm_job()
        _logging.info(
            f"preemption ({self.signum.name}): saved {path} at epoch {trainer.current_epoch}, after training"
            f" batch {batch}{requeued}; stopping"
        )
        trainer.should_stop = True


def _requeue_slurm_job() -> str:
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job_id = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ["SLURM_JOB_ID"]
    if not re.fullmatch(r"[0-9_]+", job_id):
        raise ValueError(f"SLURM job id {job_id!r} is not numeric; refusing to pass it to scontrol")
    try:
        code = subprocess.call(["scontrol", "requeue", job_id])
    except FileNotFoundError:
        _logging.warning(f"preemption: scontrol not found; SLURM job {job_id} was not requeued")
        return f"; scontrol not found, job {job_id} NOT requeued"
    if code != 0:
        _logging.warning(f"preemption: `scontrol requeue {job_id}` failed with exit code {code}")
        return f"; requeueing job {job_id} failed (exit code {code})"
    return f"; requeued SLURM job {job_id}"
