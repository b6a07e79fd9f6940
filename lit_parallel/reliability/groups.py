"""Process groups: created with a long rendezvous, the strategy's timeout on every group, and destroying the
groups the strategy created."""

from __future__ import annotations

import atexit
import contextlib
import gc
import itertools
import os
import warnings
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

from lit_parallel import _compat

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
        if dist.group.WORLD is _OWNED_GROUPS[-1]:
            gc.collect()
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    _OWNED_GROUPS.clear()


atexit.register(_destroy_owned_group_at_exit)


def init_process_group(strategy: Any, timeout: timedelta | None) -> None:
    """Create the process group before Lightning would (it then finds it), with two differences: the
    rendezvous may take as long as torch's default allows (ranks start at different times; the strategy's
    ``timeout`` is for collectives and is set on every group afterwards), and after a failed run in this
    process it rendezvouses under fresh keys (see ``_RETRY``)."""
    strategy.set_world_ranks()
    backend = _compat.process_group_backend(strategy)
    rendezvous = max(timeout or default_pg_timeout, default_pg_timeout)
    if _RETRY["store"] is not None:
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"lit_parallel_retry_{_RETRY['count']}/", _RETRY["store"]),
            rank=strategy.global_rank,
            world_size=strategy.world_size,
            timeout=rendezvous,
        )
        return
    # as Lightning's: the device binds NCCL's communicator eagerly; None on CPU
    device_id = strategy.root_device if strategy.root_device.type != "cpu" else None
    kwargs: dict[str, Any] = {"timeout": rendezvous, "device_id": device_id}
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is not None:
        kwargs["store"] = _attempt_store(strategy, attempt, rendezvous)
        kwargs.update(rank=strategy.global_rank, world_size=strategy.world_size)
        dist.init_process_group(backend, **kwargs)
        return
    _compat.init_dist_connection(strategy.cluster_environment, backend, **kwargs)


def _attempt_store(strategy: Any, attempt: str, timeout: timedelta) -> Any:
    """Under torchrun: the rendezvous store with a prefix of its own per restart attempt.

    torchrun's agent hosts the store and keeps it across ``--max-restarts`` attempts, keys included. The
    restarted ranks would rendezvous under the same keys as the killed attempt's (every process group's
    name starts again from 0), and a rank that reads a key the dead attempt left behind connects to an
    address nobody listens on (gloo: ``connectFullMesh failed ... Connection refused``). Every group this
    strategy creates (the default group, the device mesh's sub-groups) lives under the default group's
    store, so one prefix per attempt separates them all.
    """
    env = strategy.cluster_environment
    os.environ["MASTER_ADDR"] = env.main_address
    os.environ["MASTER_PORT"] = str(env.main_port)
    store, _, _ = next(
        dist.rendezvous("env://", rank=strategy.global_rank, world_size=strategy.world_size, timeout=timeout)
    )
    return dist.PrefixStore(f"lit_parallel/attempt_{attempt}/", store)


def own_default_group() -> None:
    """Record the default group as created by a strategy (destroyed at exit, or after a failed run)."""
    group = dist.group.WORLD
    if group is not None and group not in _OWNED_GROUPS:
        _OWNED_GROUPS.append(group)


def destroy_after_failure() -> None:
    """A failed run leaves its process group unusable (a timed-out collective poisons it): destroy it so
    that a retry in this process creates a fresh one."""
    with contextlib.suppress(Exception):
        _RETRY["store"] = _compat.get_default_store()
        _RETRY["count"] += 1
        dist.destroy_process_group()
    _OWNED_GROUPS.clear()


def default_store() -> Any | None:
    """The default process group's key-value store (it outlives a broken group), or ``None``."""
    try:
        return _compat.get_default_store()
    except Exception:
        return None


def set_timeout_on_all_groups(timeout: timedelta) -> None:
    """The strategy's timeout on every process group of this rank (torch gives sub-groups its default)."""
    for group in _compat.all_process_groups():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a group wrapped for debug_level='detail' cannot take it
            with contextlib.suppress(Exception):
                _compat.set_pg_timeout(timeout, group)
