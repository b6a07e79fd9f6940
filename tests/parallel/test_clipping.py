"""Gradient clipping keeps the norm on the gradients' device and hands collectives only tensors on their
process group's device (NCCL refuses CPU tensors; a CPU norm all-reduced over the pipeline group made
``pp_dp`` crash at its first clipped step on CUDA).

On CPU every tensor is on the CPU, so the device checks run on the meta device (a DeviceMesh of type "meta"
over a real 1-rank gloo group) with an NCCL-like all-reduce: it records the device of every tensor it is
handed and refuses one that is not on the group's device type, as NCCL does; on one rank an all-reduce is the
identity. The values are checked on real CPU tensors against torch's clipping.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lit_parallel.parallel.fsdp import clip_grad_norm_
from lit_parallel.parallel.pipeline.schedule import clip_grad_norm_across_stages


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


class NCCLLikeAllReduce:
    """``torch.distributed.all_reduce`` as NCCL treats devices, on one rank."""

    def __init__(self, device_type: str):
        self.device_type = device_type
        self.devices: list[torch.device] = []

    def __call__(self, tensor, op=None, group=None, async_op=False):
        self.devices.append(tensor.device)
        if tensor.device.type != self.device_type:
            raise ValueError(
                f"Tensors must be on the process group's device ({self.device_type}); got {tensor.device}"
            )


def _sharded_meta_parameters(n: int = 3):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = DeviceMesh("meta", [0], mesh_dim_names=("data_parallel",))
    params = []
    for i in range(n):
        placement = Shard(0) if i % 2 == 0 else Replicate()
        # a leaf DTensor, not an nn.Parameter: wrapping one dispatches ``detach``, whose sharding propagation
        # asks the "meta" device type for its device count on torch 2.14 (there is none)
        p = DTensor.from_local(torch.empty(4, 3, device="meta"), mesh, [placement])
        p.grad = DTensor.from_local(torch.empty(4, 3, device="meta"), mesh, [placement])
        params.append(p)
    return params


def test_the_norm_of_plain_gradients_is_returned_on_their_device():
    params = [nn.Parameter(torch.empty(4, 3, device="meta")) for _ in range(2)]
    for p in params:
        p.grad = torch.empty_like(p)
    total = clip_grad_norm_(params, 1.0)
    assert total.device.type == "meta" and total.dtype == torch.float32


def test_sharded_clipping_reduces_and_returns_on_the_mesh_device(one_rank, monkeypatch):
    all_reduce = NCCLLikeAllReduce("meta")
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    total = clip_grad_norm_(_sharded_meta_parameters(), 1.0)
    assert total.device.type == "meta"
    # one all-reduce: the sharded group's norm over its mesh dimension (the replicated group needs none)
    assert [d.type for d in all_reduce.devices] == ["meta"]


def test_pipeline_clipping_hands_the_pipeline_group_a_tensor_on_its_device(one_rank, monkeypatch):
    all_reduce = NCCLLikeAllReduce("meta")
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    total = clip_grad_norm_across_stages(_sharded_meta_parameters(), 1.0, one_rank)
    assert total.device.type == "meta"
    # the stage norm over the data-parallel shards, then over the pipeline ranks
    assert [d.type for d in all_reduce.devices] == ["meta", "meta"]


def test_pipeline_clipping_of_a_stage_without_gradients_communicates_on_the_given_device(
    one_rank, monkeypatch
):
    all_reduce = NCCLLikeAllReduce("meta")
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    params = [nn.Parameter(torch.ones(3))]  # no gradient on this rank's stages: the norm starts on the CPU
    total = clip_grad_norm_across_stages(params, 1.0, one_rank, device=torch.device("meta"))
    assert total.device.type == "meta" and [d.type for d in all_reduce.devices] == ["meta"]


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clipping_matches_torch_on_sharded_and_plain_gradients(one_rank, norm_type):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (1,))
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(4, 3, generator=g) * 3 for _ in range(3)]
    expected = [nn.Parameter(torch.zeros(4, 3)) for _ in grads]
    for p, grad in zip(expected, grads):
        p.grad = grad.clone()
    want = torch.nn.utils.clip_grad_norm_(expected, 0.5, norm_type)
    for clip in (
        lambda ps: clip_grad_norm_(ps, 0.5, norm_type),
        lambda ps: clip_grad_norm_across_stages(ps, 0.5, one_rank, norm_type),
    ):
        params = [nn.Parameter(DTensor.from_local(torch.zeros(4, 3), mesh, [Shard(0)])) for _ in grads[:2]]
        params.append(nn.Parameter(torch.zeros(4, 3)))
        for p, grad in zip(params, grads):
            p.grad = (
                DTensor.from_local(grad.clone(), mesh, [Shard(0)]) if isinstance(p, DTensor) else grad.clone()
            )
        total = clip(params)
        torch.testing.assert_close(total, want)
        for p, e in zip(params, expected):
            got = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            torch.testing.assert_close(got, e.grad)
