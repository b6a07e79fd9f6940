"""Giving every rank the same full weights before they are split: materialise from the meta device, or copy
rank 0's.

:func:`materialize_blocks` walks a module in pre-order (as Lightning's materialisation does, so the same
``reset_parameters`` calls draw the same random numbers as initialising the whole model in one process) and
yields each transformer block as soon as its weights are ready, so that the caller can shard it before the
next one is materialised: no rank ever holds more than the parameters outside blocks plus one whole block.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def has_meta(module: nn.Module, recurse: bool = True) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device."""
    return any(t.is_meta for t in itertools.chain(module.parameters(recurse), module.buffers(recurse)))


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device this rank computes on for ``mesh``."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    handle = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, handle.current_device())


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def broadcast_from_rank0(tensors: Sequence[torch.Tensor]) -> None:
    """Make every rank's copy equal rank 0's (one flat broadcast per dtype/device)."""
    if not _distributed():
        return
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for (_, t_device), ts in sorted(groups.items(), key=lambda kv: str(kv[0])):
        flat = torch.cat([t.detach().reshape(-1) for t in ts])
        if t_device.type == "cpu" and dist.get_backend() == "nccl":
            flat = flat.cuda()
        dist.broadcast(flat, src=0)
        with torch.no_grad():
            for t, synced in zip(ts, torch.split(flat, [t.numel() for t in ts])):
                t.copy_(synced.view_as(t))


def local_states(module: nn.Module, recurse: bool) -> list[torch.Tensor]:
    """Parameters and buffers of ``module`` that are plain (not DTensor) tensors with storage."""
    from torch.distributed.tensor import DTensor

    return [
        t
        for t in itertools.chain(module.parameters(recurse), module.buffers(recurse))
        if not isinstance(t, DTensor) and not t.is_meta
    ]


@contextmanager
def rank0_rng(device: torch.device) -> Iterator[None]:
    """Every rank draws the random numbers rank 0 draws, so initialisation is identical across ranks."""
    if not _distributed():
        yield
        return
    states: list[Any] = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    dist.broadcast_object_list(states, src=0)
    torch.set_rng_state(states[0].cpu())
    if device.type == "cuda":
        torch.cuda.set_rng_state(states[1].cpu(), device)
    yield


def _reset(module: nn.Module, uninitialised: set[str]) -> None:
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()
    else:
        uninitialised.add(type(module).__name__)


def _materialize_tree(module: nn.Module, device: torch.device, uninitialised: set[str]) -> None:
    """to_empty + reset_parameters of every module of the subtree that has meta states of its own
    (pre-order, as Lightning does); modules already materialised keep their values."""
    was_meta = [sub for sub in module.modules() if has_meta(sub, recurse=False)]
    for sub in was_meta:
        sub.to_empty(device=device, recurse=False)
    for sub in was_meta:
        _reset(sub, uninitialised)


def _warn_uninitialised(uninitialised: set[str]) -> None:
    if uninitialised:
        warnings.warn(
            "Initialisation from the meta device is incomplete: these modules have parameters or buffers but"
            f" no reset_parameters() to initialise them, so they hold uninitialised memory:"
            f" {', '.join(sorted(uninitialised))}. Define reset_parameters() on them or load weights"
            " (load_full_state_dict) before training.",
            stacklevel=4,
        )


def materialize_blocks(
    module: nn.Module, blocks: Sequence[nn.Module], device: torch.device, *, sync_from_rank0: bool = True
) -> Iterator[nn.Module]:
    """Yield each of ``blocks`` (in module order) once its full weights are ready on every rank.

    A module (partly) on the meta device is materialised on ``device``: the parameters outside blocks first,
    then each block as the walk reaches it; each module's ``reset_parameters()`` initialises its own states
    (modules without one are listed in a warning), with rank 0's random generator state on every rank.
    A module that is not on the meta device gets rank 0's parameters and buffers when ``sync_from_rank0``
    (as DDP does), so ranks cannot start from different initialisations.
    """
    block_ids = {id(b) for b in blocks}
    inside = {id(m) for b in blocks for m in b.modules()}
    outside = [m for m in module.modules() if id(m) not in inside]
    meta = has_meta(module)
    outside_meta = {id(m) for m in outside if has_meta(m, recurse=False)}
    uninitialised: set[str] = set()
    with rank0_rng(device) if meta else nullcontext():
        if meta:
            # Parameters outside blocks are needed whole for a moment anyway (the root group shards them last).
            for m in outside:
                if id(m) in outside_meta:
                    m.to_empty(device=device, recurse=False)
        elif sync_from_rank0:
            broadcast_from_rank0([t for m in outside for t in local_states(m, recurse=False)])
        skip: set[int] = set()
        for m in module.modules():
            if id(m) in skip:
                continue
            if id(m) in block_ids:
                skip.update(id(sub) for sub in m.modules())
                if has_meta(m):
                    _materialize_tree(m, device, uninitialised)
                elif sync_from_rank0:
                    broadcast_from_rank0(local_states(m, recurse=True))
                yield m
            elif id(m) in outside_meta:
                _reset(m, uninitialised)
    _warn_uninitialised(uninitialised)
