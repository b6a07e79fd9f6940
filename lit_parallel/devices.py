"""This rank's device, and joining the process group on it, for programs that start their own ranks.

A rank's device is its local rank modulo the devices it sees. Under torchrun on a node whose ranks all see
every GPU that is ``cuda:LOCAL_RANK``; when each rank sees only its own GPU (``CUDA_VISIBLE_DEVICES`` set per
rank, SLURM's ``--gpus-per-task=1``) it is ``cuda:0``, and ``cuda:LOCAL_RANK`` would not exist. The device is
made current *before* the NCCL process group starts, and handed to it as ``device_id``: NCCL binds its
communicator to the current device, and a group started first would sit on ``cuda:0`` in every rank.

(Lightning's strategies choose their own device; this is for ``lit-parallel doctor``, ``bench``, ``lab`` and
``advise``'s launches, and anything else that joins a process group torchrun set up.)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta

import torch

# where a launcher says which rank of the node this process is, in the order they are read
LOCAL_RANK_VARIABLES = ("LOCAL_RANK", "SLURM_LOCALID")


def local_rank(environ: Mapping[str, str] = os.environ) -> int:
    """This process's rank on its node: torchrun's ``LOCAL_RANK``, else SLURM's ``SLURM_LOCALID``, else 0."""
    for name in LOCAL_RANK_VARIABLES:
        value = environ.get(name)
        if value is None:
            continue
        try:
            rank = int(value)
        except ValueError:
            rank = -1
        if rank < 0:
            raise ValueError(
                f"{name}={value!r} is not a rank: the launcher sets it to this process's rank on its node,"
                " 0, 1, ...; unset it or launch with torchrun / srun"
            )
        return rank
    return 0


def local_device_index(rank: int, device_count: int) -> int:
    """The index of this rank's device among the ``device_count`` it sees: ``rank`` modulo the count (0 when
    it sees one device: its own)."""
    if device_count < 1:
        raise RuntimeError(
            f"local rank {rank} sees no CUDA device (torch.cuda.device_count() == 0, CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r}): run on a GPU node, or use the gloo"
            " backend (--accelerator cpu / --backend gloo)"
        )
    return rank % device_count


def local_cuda_device() -> torch.device:
    """This rank's CUDA device (:func:`local_rank` modulo the visible devices)."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return torch.device("cuda", local_device_index(local_rank(), count))


def init_process_group_on_device(backend: str, *, timeout: timedelta | None = None) -> torch.device:
    """Join the process group torchrun set up and return this rank's device.

    ``nccl`` (or a backend string naming it, ``"cpu:gloo,cuda:nccl"``): the rank's CUDA device
    (:func:`local_cuda_device`) is made current first and given to the group as ``device_id``. Otherwise
    the CPU. A process group already joined is kept (the device is still made current)."""
    import torch.distributed as dist

    cuda = "nccl" in backend
    device = local_cuda_device() if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        kwargs = {} if timeout is None else {"timeout": timeout}
        if cuda:
            kwargs["device_id"] = device
        dist.init_process_group(backend, **kwargs)
    return device
