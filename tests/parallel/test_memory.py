"""ZeRO formulas for bytes per rank and bytes communicated, and the collective accounting."""

from __future__ import annotations

import pytest
import torch

from lit_parallel.parallel import (
    Collective,
    CommCounter,
    estimate_comm_bytes,
    estimate_memory,
    training_state_bytes,
)

P = 1_000_000


@pytest.mark.parametrize(
    ("strategy", "params", "grads", "optim"),
    [
        ("ddp", 4 * P, 4 * P, 8 * P),  # nothing sharded: 16P
        ("zero1", 4 * P, 4 * P, 8 * P / 4),
        ("zero2", 4 * P, 4 * P / 4, 8 * P / 4),
        ("zero3", 4 * P / 4, 4 * P / 4, 8 * P / 4),  # 16P / N
        ("fsdp", 4 * P / 4, 4 * P / 4, 8 * P / 4),
    ],
)
def test_zero_memory_formulas_with_adamw_in_fp32(strategy, params, grads, optim):
    est = estimate_memory(P, strategy=strategy, world_size=4)
    assert (est.param_bytes, est.grad_bytes, est.optimizer_bytes) == (params, grads, optim)


def test_hsdp_shards_over_the_replica_and_dtypes_and_optimizers_count():
    assert estimate_memory(P, strategy="hsdp", world_size=8, shard_size=2).total_bytes == 16 * P / 2
    assert (
        estimate_memory(P, strategy="fsdp", world_size=2, param_dtype=torch.bfloat16).total_bytes == 8 * P / 2
    )
    assert estimate_memory(P, strategy="ddp", optimizer="sgd").total_bytes == 8 * P
    assert estimate_memory(P, strategy="ddp", optimizer="sgd_momentum").total_bytes == 12 * P
    with pytest.raises(ValueError, match="strategy='zero4' is not one of"):
        estimate_memory(P, strategy="zero4")
    with pytest.raises(ValueError, match="needs shard_size"):
        estimate_memory(P, strategy="hsdp", world_size=4)


def test_communication_formulas_zero3_is_1_5x_ddp_and_zero2_1x():
    ddp = estimate_comm_bytes(P, strategy="ddp", world_size=8)
    assert ddp == 2 * 7 / 8 * 4 * P
    assert estimate_comm_bytes(P, strategy="fsdp", world_size=8) / ddp == pytest.approx(1.5)
    assert estimate_comm_bytes(
        P, strategy="fsdp", world_size=8, reshard_after_forward=False
    ) / ddp == pytest.approx(1.0)
    # hsdp 2 x 4: ZeRO-3 inside the replica of 4, plus an all-reduce of the 1/4 gradient shard over 2
    hsdp = estimate_comm_bytes(P, strategy="hsdp", world_size=8, shard_size=4)
    assert hsdp == pytest.approx(3 / 4 * 3 * 4 * P + 2 * 1 / 2 * 4 * P / 4)
    # a root group of a tenth of the parameters stays gathered into backward: gathered 1.9 times, not 2
    root = P // 10
    assert estimate_comm_bytes(P, strategy="fsdp", world_size=8, root_params=root) == pytest.approx(
        7 / 8 * 4 * (2 * P - root + P)
    )
    assert estimate_comm_bytes(
        P, strategy="fsdp", world_size=8, root_params=root, reshard_after_forward=False
    ) / ddp == pytest.approx(1.0)
    with pytest.raises(ValueError, match=r"root_params=-1 must be between 0 and num_params="):
        estimate_comm_bytes(P, strategy="fsdp", world_size=8, root_params=-1)


def test_ring_bytes_of_one_collective():
    assert Collective("all_reduce", 1000, 4).sent_bytes == 2 * 3 / 4 * 1000
    assert Collective("all_gather", 1000, 4).sent_bytes == 3 / 4 * 1000
    assert Collective("reduce_scatter", 1000, 2).sent_bytes == 500
    assert Collective("all_reduce", 1000, 1).sent_bytes == 0


def test_counter_sees_nothing_without_collectives_and_training_state_bytes_counts_plain_tensors():
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    with CommCounter() as counter:
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
    assert counter.records == [] and counter.sent_bytes() == 0
    state = training_state_bytes(model, opt)
    assert state["params"] == state["grads"] == 4 * 10
    assert state["optimizer"] == 2 * 4 * 10 + 2 * 4  # exp_avg, exp_avg_sq, and a float32 step per tensor
