"""Reliability shared by every lit_parallel strategy: fail fast and loudly, never lose state, never silently
change the training.

Each strategy holds one :class:`Reliability` object (``strategy.reliability``), built in its ``__init__``
from its :class:`ReliabilityOptions` (``debug_level``, ``watchdog``, ``preemption_signal``, ``stall_timeout``)
and its collective ``timeout``: ``Reliability(options, timeout)``. The features are composed from Lightning's
public extension points, each in one place:

- the strategy's own hooks call the object, one line each (written once for every strategy, in
  :mod:`lit_parallel.strategies.reliable`): ``_configure_launcher`` (the watched launcher,
  :mod:`~lit_parallel.reliability.launcher`), the process-group set-up (``setup_distributed``, or
  ``_setup_distributed`` for ``ModelParallelStrategy``-based strategies), ``on_exception`` (the failure
  report), ``barrier`` (RNG states at the end of a restore), ``process_dataloader`` (mid-epoch resume) and
  ``teardown``;
- a ``CheckpointIO`` wrapping the strategy's (:class:`~lit_parallel.reliability.checkpoints.ReliableCheckpointIO`)
  writes single files safely and verifies them before a ``weights_only`` load; sharded (DCP) checkpoints
  are saved and loaded by functions of :mod:`~lit_parallel.reliability.checkpoints` that the sharded
  strategies' ``save_checkpoint`` / ``load_checkpoint`` call;
- a callback the strategy adds to its Trainer (:class:`~lit_parallel.reliability.core.ReliabilityCallback`)
  marks progress, checks that each loss reaches the model, checks for preemption at optimizer-step
  boundaries, and stores and takes over every rank's RNG states.

The features:

- **Failure reports.** When a rank fails, it publishes what it was doing through the process group's
  key-value store; every live rank's watchdog thread answers with its own progress and where its main
  thread is. A collective that timed out (or ranks that diverged) is reported as *which collective, on
  which ranks, and where the ranks that never arrived are* (e.g. a rank stuck in ``__getitem__``, or a rank
  that went past a batch without joining its backward collectives).
- **Stall reports** (:mod:`~lit_parallel.reliability.stall`): when no rank completes a training step for
  ``stall_timeout``, one report says where every rank is and every rank exits with status 124; data
  loading, validation, saves, torch.compile's compilations and the first steps of a fit are not timed.
  Every stall limit ends before the collective timeout (less 10 %, at least 30 s), so that the report comes
  before NCCL's watchdog would end the process.
- **Signals** (:mod:`~lit_parallel.reliability.signals`): ``SIGINT`` / ``SIGTERM`` end every rank within
  seconds, even while blocked in a collective, with exit status 128 + the signal number.
- **Exits abort the communicators**: every path on which a rank ends itself (``os._exit``) first aborts its
  process groups, within a bounded time (:func:`~lit_parallel.reliability.groups.exit_process`), so that
  NCCL peers fail at once instead of waiting out the timeout.
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
  :mod:`lit_parallel.checkpoint.load`).
- **Process group ownership**: a process group the strategy created is destroyed when the process exits (or
  right away when the run failed, so a retry in the same process starts clean); one that existed before
  (torchrun's, a test harness's, the user's) is left to its creator.
"""

from lit_parallel.reliability.core import Reliability, ReliabilityCallback, _reaches_a_parameter
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
    "Reliability",
    "ReliabilityCallback",
    "ReliabilityOptions",
    "_reaches_a_parameter",
]
