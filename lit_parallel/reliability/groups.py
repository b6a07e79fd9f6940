"""Process groups: the strategy's timeout on every group, and destroying the groups the strategy created."""

from __future__ import annotations

import atexit
import contextlib
import gc
import itertools
import warnings
from datetime import timedelta
from typing import Any

import torch.distributed as dist

_OWNED_GROUPS: list[Any] = []
_RUNS = itertools.count()
# After a failed run destroyed its process group: the key-value store it rendezvoused on. torch keeps a
# store server per port alive in the process, with the old group's keys, so a new group on the same
# MASTER_PORT must use fresh keys (a new prefix) to rendezvous.
_RETRY: dict[str, Any] = {"store": None, "count": 0}


def _destroy_owned_group_at_exit() -> None:
    # Left to the interpreter's shutdown, gloo/NCCL objects are torn down in no particular order and a run
    # that succeeded sometimes aborts ("terminate called without an active exception"). Collect the dead
    # DDP/FSDP objects first, then destroy the group while Python is still fully alive.
    if _OWNED_GROUPS and dist.is_initialized():
        if dist.distributed_c10d._get_default_group() is _OWNED_GROUPS[-1]:
            gc.collect()
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    _OWNED_GROUPS.clear()


atexit.register(_destroy_owned_group_at_exit)


def _set_timeout_on_all_groups(timeout: timedelta) -> None:
    """The strategy's timeout on every process group of this rank (torch gives sub-groups its default)."""
    from torch.distributed.distributed_c10d import _set_pg_timeout, _world

    for group in list(_world.pg_map):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a group wrapped for debug_level='detail' cannot take it
            with contextlib.suppress(Exception):
                _set_pg_timeout(timeout, group)
