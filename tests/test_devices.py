"""A rank's device: its local rank modulo the devices it sees, made current before NCCL starts.

The CUDA cases run without a GPU: the visible device count and the two torch calls that need CUDA
(``set_device``, the NCCL ``init_process_group``) are replaced; that is argument handling and NCCL-only
behaviour. The gloo path joins a real one-rank process group.
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

from lit_parallel import devices
from lit_parallel.devices import (
    init_process_group_on_device,
    local_cuda_device,
    local_device_index,
    local_rank,
)


@pytest.mark.parametrize(
    ("environ", "rank"),
    [
        ({"LOCAL_RANK": "3"}, 3),
        ({"SLURM_LOCALID": "5"}, 5),  # srun without torchrun
        ({"LOCAL_RANK": "2", "SLURM_LOCALID": "5"}, 2),  # torchrun inside an allocation: torchrun's
        ({}, 0),
    ],
)
def test_local_rank_is_read_from_torchrun_then_slurm(environ, rank):
    assert local_rank(environ) == rank


@pytest.mark.parametrize("value", ["x", "-1", "1.5"])
def test_a_local_rank_that_is_not_a_rank_is_refused_naming_it(value):
    with pytest.raises(ValueError, match=rf"LOCAL_RANK='{value}' is not a rank"):
        local_rank({"LOCAL_RANK": value})


@pytest.mark.parametrize(
    ("rank", "count", "index"),
    [(3, 8, 3), (3, 1, 0), (0, 1, 0), (5, 4, 1), (7, 2, 1)],
)
def test_the_device_index_is_the_local_rank_modulo_the_visible_devices(rank, count, index):
    assert local_device_index(rank, count) == index


def test_no_visible_device_is_an_error_with_the_fix():
    with pytest.raises(RuntimeError, match="sees no CUDA device.*use the gloo backend"):
        local_device_index(0, 0)


def _visible(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.mark.parametrize(("count", "expected"), [(8, "cuda:3"), (1, "cuda:0"), (2, "cuda:1")])
def test_local_rank_3_runs_on_its_own_gpu_however_many_it_sees(monkeypatch, count, expected):
    # 8: every rank of the node sees every GPU; 1: CUDA_VISIBLE_DEVICES per rank (SLURM --gpus-per-task=1),
    # where cuda:3 does not exist; 2: --gpus-per-task=2
    _visible(monkeypatch, count)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert local_cuda_device() == torch.device(expected)


def test_nccl_makes_the_device_current_before_the_group_starts_and_binds_the_group_to_it(monkeypatch):
    _visible(monkeypatch, 1)
    monkeypatch.setenv("LOCAL_RANK", "6")
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    device = init_process_group_on_device("nccl")
    assert device == torch.device("cuda", 0)
    assert calls == [("set_device", device), ("nccl", {"device_id": device})]


def test_gloo_joins_the_group_on_the_cpu_without_asking_for_cuda(monkeypatch):
    monkeypatch.setattr(devices, "local_cuda_device", lambda: pytest.fail("gloo needs no CUDA device"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in (
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", str(port)),
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
    ):
        monkeypatch.setenv(name, value)
    try:
        assert init_process_group_on_device("gloo") == torch.device("cpu")
        assert dist.get_backend() == "gloo" and dist.get_world_size() == 1
        assert init_process_group_on_device("gloo") == torch.device("cpu")  # joined already: kept
    finally:
        dist.destroy_process_group()
