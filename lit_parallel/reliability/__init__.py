"""Reliability shared by every lit_parallel strategy: fail fast and loudly, never lose state, never silently
change the training.

:class:`ReliabilityMixin` sits in front of Lightning's strategy class in each strategy's bases
(``TunedDDPStrategy(ReliabilityMixin, DDPStrategy)``, ``TransformerFSDPStrategy(ReliabilityMixin,
ModelParallelStrategy)``; ``hsdp`` and ``tp_dp`` inherit it) and adds:

- **Failure reports.** When a rank fails, it publishes what it was doing through the process group's
  key-value store; every live rank's watchdog thread answers with its own progress and where its main
  thread is. A collective that timed out (or ranks that diverged) is reported as *which collective, on
  which ranks, and where the ranks that never arrived are* (e.g. a rank stuck in ``__getitem__``, or a rank
  that went past a batch without joining its backward collectives).
- **A watchdog for Lightning's launcher** (``python train.py`` with ``devices=N``): the launching process
  (rank 0) ends the other ranks when it fails, waits for them when it finishes, and stops the run within a
  fraction of a second when one of them dies; the other ranks exit when the launching process is gone. No
  process outlives a failed run.
- **Collective fingerprints** (``debug_level="detail"``): torch's check that every rank runs the same
  collective, set with ``torch.distributed.set_debug_level`` before the process group is created.
- **The strategy's timeout on every process group**, including the device mesh's sub-groups (torch gives
  those its 30-minute default) and a process group created before the strategy (torchrun, user code) when
  ``timeout`` is passed explicitly.
- **Exact resume**: every rank's torch, CUDA, numpy and Python RNG states are saved in each checkpoint in a
  ``weights_only``-loadable form and restored; a mid-epoch checkpoint continues with the next unseen batch
  (the sampler skips what the epoch already used) or is refused with the reason, never silently repeating
  or skipping batches.
- **Preemption**: on SLURM's requeue signal (``SIGUSR1``) the ranks agree at the next optimizer-step
  boundary, save a complete checkpoint ``hpc_ckpt_N.ckpt``, requeue the job and stop; the requeued job
  resumes from it (Lightning picks the newest ``hpc_ckpt_*`` on SLURM).
- **Checkpoint integrity**: files and folders are written under a temporary name and renamed into place when
  complete; loading checks completeness first and never executes pickled code (see
  :mod:`lit_parallel.checkpoint`).
- **Process group ownership**: a process group the strategy created is destroyed when the process exits (or
  right away when the run failed, so a retry in the same process starts clean); one that existed before
  (torchrun's, a test harness's, the user's) is left to its creator.
"""

from lit_parallel.reliability.mixin import ReliabilityMixin, _reaches_a_parameter
from lit_parallel.reliability.options import (
    DEBUG_LEVELS,
    LAUNCHER_PID_ENV,
    RNG_KEY,
    DebugLevel,
    PreemptionSignal,
    ReliabilityOptions,
)

__all__ = [
    "DEBUG_LEVELS",
    "LAUNCHER_PID_ENV",
    "RNG_KEY",
    "DebugLevel",
    "PreemptionSignal",
    "ReliabilityMixin",
    "ReliabilityOptions",
    "_reaches_a_parameter",
]
