"""Process groups: created with a long rendezvous, the strategy's timeout on every group (and reading the
timeout a group really has), destroying the groups the strategy created, and aborting every communicator
before the process ends itself (:func:`exit_process`)."""

from __future__ import annotations

import atexit
import contextlib
import gc
import itertools
import os
import sys
import threading
import warnings
from datetime import timedelta
from typing import Any, NoReturn

import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

from lit_parallel import _compat

_OWNED_GROUPS: list[Any] = []
_RUNS = itertools.count()
# After a failed run destroyed its process group: the key-value store it rendezvoused on. torch keeps a
# store server per port alive in the process, with the old group's keys, so a new group on the same
# MASTER_PORT must use fresh keys (a new prefix) to rendezvous.
_RETRY: dict[str, Any] = {"store": None, "count": 0}
# How long aborting the communicators may take before the process exits anyway (ncclCommAbort normally takes
# well under a second; a driver in a bad state can make it hang).
ABORT_WAIT_S = 10.0
_EXITING = threading.Lock()


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
    """A failed run leaves its process group unusable (a timed-out collective poisons it): abort it so that a
    retry in this process creates a fresh one. Aborted, not destroyed: on NCCL, destroying a group whose
    collective timed out may wait for that collective (see :func:`abort_communicators`)."""
    with contextlib.suppress(Exception):
        _RETRY["store"] = _compat.get_default_store()
        _RETRY["count"] += 1
    problem = abort_communicators()
    if problem is not None:
        _write_stderr(f"lit_parallel: after the failure, {problem}")
    if dist.is_initialized():  # the abort did not get through: at least forget the group
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    _OWNED_GROUPS.clear()


def abort_communicators(wait_s: float | None = None) -> str | None:
    """Abort every process group of this rank (``torch.distributed``'s abort: NCCL communicators end at once,
    and the peers' collectives with this rank fail instead of waiting out the timeout), waiting at most
    ``wait_s`` (default :data:`ABORT_WAIT_S`) so that an abort cannot hang; what went wrong, or ``None``."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    wait_s = ABORT_WAIT_S if wait_s is None else wait_s
    failed: list[BaseException] = []

    def abort() -> None:
        try:
            _compat.abort_process_groups()
        except BaseException as err:  # reported below; the exit must not depend on it
            failed.append(err)

    thread = threading.Thread(target=abort, name="lit_parallel-abort", daemon=True)
    thread.start()
    thread.join(wait_s)
    if thread.is_alive():
        return f"aborting the process group did not finish within {wait_s:g} s; exiting without it"
    if failed:
        return f"aborting the process group failed ({type(failed[0]).__name__}: {failed[0]})"
    return None


def exit_process(code: int) -> NoReturn:
    """End this process now with status ``code`` (``os._exit``: no Python shutdown, which a thread blocked in
    a collective would hang), after aborting its communicators (:func:`abort_communicators`). The first
    caller exits; a second one (a signal during a stall's exit) waits for it, then exits too."""
    if _EXITING.acquire(timeout=ABORT_WAIT_S + 5.0):
        rank = "?"
        with contextlib.suppress(Exception):
            rank = str(dist.get_rank())
        problem = abort_communicators()
        if problem is not None:
            _write_stderr(f"lit_parallel: rank {rank} (pid {os.getpid()}): {problem}")
    os._exit(code)


def _write_stderr(text: str) -> None:
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    with contextlib.suppress(OSError):
        os.write(2, (text + "\n").encode())


def collective_timeout_s(fallback: timedelta | None) -> float:
    """The shortest collective timeout among this rank's process groups (what a waiting collective really
    gets); ``fallback`` (or torch's default) where no group's timeout can be read."""
    found = []
    if dist.is_available() and dist.is_initialized():
        for group in _compat.all_process_groups():
            with contextlib.suppress(Exception):
                timeout = _compat.group_timeout(group)
                if isinstance(timeout, timedelta) and timeout > timedelta(0):
                    found.append(timeout.total_seconds())
    if found:
        return min(found)
    return (fallback or default_pg_timeout).total_seconds()


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
