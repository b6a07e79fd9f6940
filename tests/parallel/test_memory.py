"""ZeRO formulas for bytes per rank and bytes communicated, and the collective accounting."""

from __future__ import annotations

import pytest
import torch

from lit_parallel.parallel import (
    Collective,
    CommCounter,
    estimate_all_to_all_bytes,
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


# --- expert parallelism: P parameters, X of them experts, N ranks, e expert-parallel ranks ------------------

X = 750_000  # experts: three quarters of P


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_expert_parallel_leaves_the_state_per_rank_at_zero3s(ep):
    # (P - X) / N + (X / e) / (N / e) elements per rank: 250_000 / 8 + 750_000 / 8, whatever e is
    est = estimate_memory(P, strategy="fsdp", world_size=8, expert_params=X, expert_parallel=ep)
    zero3 = estimate_memory(P, strategy="fsdp", world_size=8)
    per_rank = 250_000 / 8 + (750_000 / ep) / (8 / ep)
    assert (est.param_bytes, est.grad_bytes, est.optimizer_bytes) == (
        4 * per_rank,
        4 * per_rank,
        8 * per_rank,
    )
    assert est.total_bytes == zero3.total_bytes == 16 * P / 8
    assert f"{X:,} expert params split over {ep} ranks" in est.describe()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"strategy": "fsdp", "expert_parallel": 3},
            "expert_parallel=3 does not divide world_size=8",
        ),
        ({"strategy": "zero2", "expert_parallel": 2}, "expert_parallel=2 with strategy='zero2'"),
        ({"strategy": "hsdp", "shard_size": 4, "expert_parallel": 2}, "does not combine with replication"),
        (
            {"strategy": "fsdp", "expert_parallel": 2, "expert_params": 2 * P},
            "must be between 0 and num_params",
        ),
        ({"strategy": "fsdp", "expert_parallel": 0}, "expert_parallel=0 must be a positive integer"),
    ],
)
def test_expert_parallel_estimates_refuse_what_no_strategy_runs(kwargs, message):
    kwargs = {"expert_params": X, **kwargs}
    with pytest.raises(ValueError) as info:
        estimate_memory(P, world_size=8, **kwargs)
    assert message in str(info.value)


def test_expert_parallel_communication_gathers_only_the_local_experts_over_their_replicas():
    # 8 ranks, e = 4: the 250_000 non-expert parameters over all 8 as with FSDP (a root of 50_000 gathered
    # once), each expert's quarter (187_500) over the 2 ranks holding it: gathered twice and reduce-scattered
    dense, root, local = P - X, 50_000, X // 4
    zero3 = 7 / 8 * 4 * (dense + (dense - root) + dense) + 1 / 2 * 4 * (2 * local + local)
    got = estimate_comm_bytes(
        P, strategy="fsdp", world_size=8, root_params=root, expert_params=X, expert_parallel=4
    )
    assert got == pytest.approx(zero3) and got == pytest.approx(3_575_000)
    # without expert parallelism every expert crosses all 8 ranks: 7/8 x 4 x (P + (P - root) + P)
    plain = estimate_comm_bytes(P, strategy="fsdp", world_size=8, root_params=root)
    assert plain == pytest.approx(7 / 8 * 4 * (3 * P - root)) and plain > 2.8 * got
    # ZeRO-2 gathers once
    zero2 = estimate_comm_bytes(
        P, strategy="zero2", world_size=8, expert_params=X, expert_parallel=4, reshard_after_forward=False
    )
    assert zero2 == pytest.approx(7 / 8 * 4 * 2 * dense + 1 / 2 * 4 * 2 * local)
    # e = N: every rank holds its experts whole, nothing of theirs is gathered
    alone = estimate_comm_bytes(P, strategy="fsdp", world_size=8, expert_params=X, expert_parallel=8)
    assert alone == pytest.approx(7 / 8 * 4 * 3 * dense)
    with pytest.raises(
        ValueError, match=r"root_params=300000 must be between 0 and num_params - expert_params=250000"
    ):
        estimate_comm_bytes(
            P, strategy="fsdp", world_size=8, root_params=300_000, expert_params=X, expert_parallel=2
        )
    with pytest.raises(ValueError, match="DDP replicates every expert"):
        estimate_comm_bytes(P, strategy="ddp", world_size=8, expert_parallel=2)


def test_all_to_all_bytes_are_tokens_times_top_k_times_hidden_four_times_per_moe_layer():
    # Mixtral-like: 4096 tokens per rank, hidden 4096, top-2 of 8 experts, 32 MoE layers, bf16, e = 8:
    # dispatch + combine, forward + backward = 4 x 4096 x 2 rows of 4096 x 2 bytes, and 8 int64 counts once;
    # 7/8 of it leaves the rank when the experts are equally loaded
    per_layer = 4 * 4096 * 2 * 4096 * 2 + 8 * 8
    kw = {"hidden": 4096, "top_k": 2, "moe_layers": 32, "num_experts": 8, "element_bytes": 2}
    got = estimate_all_to_all_bytes(4096, expert_parallel=8, **kw)
    assert got == 32 * per_layer * 7 / 8 == 7_516_194_560
    # activation checkpointing recomputes the forward and its exchange: 6 passes of rows, 2 of counts
    recomputed = estimate_all_to_all_bytes(4096, expert_parallel=8, recompute=True, **kw)
    assert recomputed == 32 * (6 * 4096 * 2 * 4096 * 2 + 2 * 8 * 8) * 7 / 8
    assert estimate_all_to_all_bytes(4096, expert_parallel=1, **kw) == 0  # nothing leaves a rank
    with pytest.raises(ValueError, match="expert_parallel=3 must be at least 1 and divide num_experts=8"):
        estimate_all_to_all_bytes(4096, expert_parallel=3, **kw)
