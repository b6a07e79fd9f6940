"""Preemption: on the requeue signal, the ranks agree at an optimizer-step boundary, save ``hpc_ckpt_N.ckpt``,
requeue the SLURM job and stop.

The ranks agree without the host ever waiting on the device: each boundary starts a non-blocking all-reduce
of the flag (and, on an accelerator, its copy into pinned host memory), and the next boundary reads the
result, which finished long before. A signal is therefore acted on one optimizer step later than a blocking
check would (every rank at the same step), and the check costs no device synchronisation per step.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from dataclasses import dataclass
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
        self._pending: _Flag | None = None  # the all-reduce started at the previous boundary

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
        self._pending = None  # every rank started it: it completes without being read
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
        """At an optimizer-step boundary: if any rank had the signal by the previous boundary, save, requeue and
        stop (every rank, at the same boundary); else start this boundary's all-reduce of the flag."""
        strategy = trainer.strategy
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            stop = self.requested  # one process: nothing to agree on, nothing to wait for
        else:
            stop = self._pending is not None and self._pending.read()
            self._pending = None if stop else _Flag.start(self.requested, strategy.root_device)
        if not stop:
            return
        self.requested = False
        path = strategy.broadcast(_compat.hpc_save_path(trainer, trainer.default_root_dir))
        trainer.save_checkpoint(path)
        checkpoints = getattr(getattr(strategy, "reliability", None), "checkpoints", None)
        if checkpoints is not None:  # the job may be killed once requeued: the checkpoint is written first
            checkpoints.writer.wait_for_writes()
            checkpoints.raise_failure()
        requeued = ""
        if strategy.is_global_zero and self.slurm:
            requeued = _requeue_slurm_job()
        _logging.info(
            f"preemption ({self.signum.name}): saved {path} at epoch {trainer.current_epoch}, after training"
            f" batch {batch}{requeued}; stopping"
        )
        trainer.should_stop = True


@dataclass
class _Flag:
    """One boundary's preemption flag, maximum over the ranks, on its way to the host."""

    work: Any  # the non-blocking all-reduce
    host: torch.Tensor  # where the host reads the result: the flag itself on the CPU, pinned memory otherwise
    copied: Any = None  # on an accelerator: the event recorded after the copy to ``host``

    @classmethod
    def start(cls, requested: bool, device: torch.device) -> _Flag:
        # torch.full fills on the device; torch.tensor([...], device=...) would copy from the host and wait
        flag = torch.full((1,), 1.0 if requested else 0.0, device=device)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True)
        if device.type == "cpu":
            return cls(work, flag)
        work.wait()  # on an accelerator the current stream waits for the all-reduce, the host does not
        host = torch.empty(1, pin_memory=True)
        host.copy_(flag, non_blocking=True)
        copied = torch.get_device_module(device).Event()
        copied.record()
        return cls(work, host, copied)

    def read(self) -> bool:
        """Whether any rank had the signal; by the next boundary the result is there, so this does not wait."""
        if self.copied is not None:
            self.copied.synchronize()
        else:
            self.work.wait()
        # host memory, read as such: no device is involved (``.item()`` would also be counted as a device sync)
        return self.host.tolist()[0] > 0


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
