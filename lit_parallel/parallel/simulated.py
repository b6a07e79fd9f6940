"""A simulated process group: one process plays one rank of a world of any size, nothing is communicated.

torch's fake backend (``backend="fake"``) answers every collective at once without moving data, so the real
setup code — :class:`~lit_parallel.parallel.ParallelDims`' meshes, tensor parallelism, the pipeline split,
expert parallelism, ``fully_shard`` — runs in one process on a model built on the meta device, and leaves
each parameter with the placements and local shape it would have on that rank of the real cluster. This is
what ``lit-parallel advise --dry-run`` runs (:mod:`lit_parallel.planner.dry_run`).

While a simulated group is the default group, nothing is materialised from the meta device and nothing is
copied from rank 0 (:mod:`lit_parallel.parallel.materialize`): the model stays on meta, so a 70-billion
parameter model costs no memory.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from lit_parallel import _compat

BACKEND = "fake"


def is_simulated() -> bool:
    """Whether the default process group is a simulated one (:func:`simulated_world`)."""
    return dist.is_available() and dist.is_initialized() and dist.get_backend() == BACKEND


@contextmanager
def simulated_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """Make this process rank ``rank`` of a simulated world of ``world_size`` ranks for the ``with`` body.

    Raises:
        ValueError: ``world_size`` below 1, or ``rank`` outside ``[0, world_size)``.
        RuntimeError: a process group already exists in this process (a real one must not be replaced).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a whole number of ranks, at least 1")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r} must be one of the world's ranks, 0 to {world_size - 1}")
    if dist.is_initialized():
        raise RuntimeError(
            "a process group already exists in this process; a dry run simulates its own world and must"
            " run outside a launched job (call it from a plain `python` process, or destroy the group first)"
        )
    hook = sys.excepthook  # init_process_group wraps it to prefix tracebacks with the rank: put it back after
    dist.init_process_group(BACKEND, store=_compat.FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook
