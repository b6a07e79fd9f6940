"""The host copy ``async_checkpoint=True`` keeps per rank, as ``advise`` predicts it
(lit_parallel/planner/memory/host_copy.py): against counts written out by hand for small models, and against
the bytes the package allocated in a real launch of 2 ranks (``tests.scenarios.advise:async_host_copy``, in
the advise scenarios' one launch: tests/conftest.py ``advise_two_ranks``)."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch
from torch import nn

from lit_parallel.parallel.blocks import find_transformer_blocks
from lit_parallel.parallel.tensor_parallel.infer import infer_tp_plan
from lit_parallel.planner.memory.host_copy import host_copies, saved_state_bytes, stage_entries
from lit_parallel.planner.memory.predict import predict_peaks
from lit_parallel.planner.memory.table import memory_rows
from lit_parallel.planner.memory.tensor_parallel import tp_local_model
from lit_parallel.planner.model_summary import build_on_meta
from lit_parallel.planner.pipeline_layout import pipeline_layout, pipeline_plan
from lit_parallel.planner.rules import advise
from tests.moe_models import HandMoE
from tests.scenarios.advise import HOST_COPY_RUNS, HOST_COPY_SEQ, HostCopyModel


def rng_bytes(cuda: bool = False) -> int:
    """One rank's RNG states in a checkpoint, counted from the generators themselves: torch's CPU state
    (uint8), Python's and numpy's Mersenne Twister words (int64 each), a CUDA generator's seed and offset."""
    python_words = len(random.getstate()[1])
    numpy_words = np.random.get_state()[1].size
    return torch.get_rng_state().numel() + 8 * (python_words + numpy_words) + (16 if cuda else 0)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 5)  # weight (5, 4), bias (5,)
        self.norm = nn.LayerNorm(5)  # weight (5,), bias (5,)


class Small(nn.Module):
    """A tied embedding and head (7 x 4: one tensor under two state-dict names), two blocks, a frozen bias,
    persistent buffers of 3 fp32 and 2 int64 elements, and a non-persistent one (not saved)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.emb.weight
        self.blocks[1].norm.bias.requires_grad_(False)
        self.register_buffer("scale", torch.ones(3))
        self.register_buffer("count", torch.zeros(2, dtype=torch.int64))
        self.register_buffer("cache", torch.zeros(10), persistent=False)


# trainable parameter tensors of Small (each has an AdamW step): emb, 4 in block 0, 3 in block 1
SMALL_STEPS = 8 * 4
SMALL_INT_BUFFER = 2 * 8


@pytest.mark.parametrize(
    ("precision", "element", "float_buffer"),
    [("32-true", 4, 4), ("bf16-mixed", 4, 4), ("bf16-true", 2, 2), ("64-true", 8, 8)],
)
def test_a_whole_copy_is_every_state_dict_entry_and_adamws_two_states_in_the_optimizers_dtype(
    precision, element, float_buffer
):
    # state-dict parameter entries: emb 28, per block fc 20 + 5 and norm 5 + 5 (the head is the tied
    # embedding: one tensor, copied once); AdamW's state for each trainable tensor once: 28 + 2 x 35 - 5
    entries, trainable = 28 + 2 * 35, 28 + 2 * 35 - 5
    expected = entries * element + 2 * trainable * element + SMALL_STEPS + 3 * float_buffer + SMALL_INT_BUFFER
    assert saved_state_bytes(Small(), precision=precision) == expected


@pytest.mark.parametrize(
    ("shard", "index", "rows"),
    [
        # rows of dim 0 each rank holds of (emb 7, fc.weight 5, fc.bias 5, norm 5): ceil(d / N) from the front
        (2, 0, (4, 3, 3, 3)),
        (2, 1, (3, 2, 2, 2)),
        (4, 3, (1, 0, 0, 0)),  # 7 rows in chunks of 2: the last rank gets 1; 5 rows in chunks of 2: none
    ],
)
def test_a_sharded_copy_holds_the_rows_fsdp2_gives_the_rank(shard, index, rows):
    emb, fc_w, fc_b, norm = rows
    block = fc_w * 4 + fc_b + 2 * norm
    entries = emb * 4 + 2 * block  # the tied weight once
    trainable = emb * 4 + 2 * block - norm  # block 1's norm bias is frozen
    expected = 4 * entries + 8 * trainable + SMALL_STEPS + 3 * 4 + SMALL_INT_BUFFER
    assert saved_state_bytes(Small(), precision="32-true", shard=shard, index=index) == expected


def test_expert_parallelism_keeps_the_ranks_experts_sharded_over_the_ranks_holding_them():
    # HandMoE: gate 4 x 16, 4 experts of w1 32 x 16, w2 16 x 32, w3 32 x 16. On 4 ranks with
    # expert_parallel_size=2, rank 0 keeps experts 0 and 1, each sharded over 2 ranks (16, 8 and 16 rows of
    # 16, 32 and 16), and 1 of the gate's 4 rows
    experts = 2 * (16 * 16 + 8 * 32 + 16 * 16)
    gate = 1 * 16
    steps = 4 * (1 + 2 * 3)
    expected = 12 * (experts + gate) + steps
    assert saved_state_bytes(HandMoE(), precision="32-true", shard=4, expert_parallel=2) == expected
    with pytest.raises(ValueError, match="index=1 with expert_parallel=2"):
        saved_state_bytes(HandMoE(), precision="32-true", shard=4, index=1, expert_parallel=2)


def test_the_memory_tables_column_is_zeros_count_in_the_checkpoints_dtypes():
    # 1000 parameters (900 trainable in 10 tensors, 600 in blocks), 40 bytes of buffers, 4 devices x 2 nodes,
    # bf16-mixed: the checkpoint holds fp32 weights (4 bytes) and AdamW's two fp32 states of the trainable
    rows = memory_rows(
        1000,
        devices=4,
        nodes=2,
        precision="bf16-mixed",
        trainable_params=900,
        tp_split_params=600,
        param_tensors=10,
        buffer_bytes=40,
        device_type="cpu",
    )
    whole = 1000 * 4 + 900 * 8
    extra = 10 * 4 + 40 + 8 * rng_bytes()  # rank 0 holds every rank's RNG states
    expected = {
        "DDP": whole + extra,
        "ZeRO-1": None,
        "ZeRO-2": whole / 8 + extra,
        "FSDP/ZeRO-3": whole / 8 + extra,
        "HSDP": whole / 4 + extra,
        "TP+DP": 0.6 * whole / 8 + 0.4 * whole / 2 + extra,  # blocks over all 8 ranks, the rest over 2 nodes
    }
    got = {r.name: r.host_copy_bytes for r in rows}
    assert got == pytest.approx(expected)


def test_advise_reports_the_host_copy_of_every_strategy_it_can_run():
    a = advise(params=10**9, devices=8, nodes=2, memory_gb=80, precision="bf16-mixed")
    rows = {r["name"]: r["host_copy_gb"] for r in a.as_dict()["rows"]}
    per_rank = 16 * rng_bytes(cuda=True) / 1e9  # a GPU cluster: every rank's CUDA generator as well
    assert rows == pytest.approx(
        {
            "DDP": 12.0 + per_rank,
            "ZeRO-1": None,
            "ZeRO-2": 0.75 + per_rank,
            "FSDP/ZeRO-3": 0.75 + per_rank,
            "HSDP": 1.5 + per_rank,
            "TP+DP": 0.75 + per_rank,
        }
    )


# --- against a real launch --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def meta_model():
    module = build_on_meta(HostCopyModel)
    return module, [n for n, _ in find_transformer_blocks(module, "auto").blocks]


@pytest.fixture(scope="module")
def measured(advise_two_ranks) -> dict[str, list[int]]:
    """``{strategy: [rank 0's host copy bytes, rank 1's]}`` of the launch's saves."""
    per_rank = advise_two_ranks.scenario("async_host_copy")
    assert [set(r) for r in per_rank] == [{name for name, _, _ in HOST_COPY_RUNS}] * 2
    for results in per_rank:  # one save: everything the copy holds was allocated for it, once
        assert all(r["allocated_bytes"] == r["nbytes"] for r in results.values())
    return {name: [r[name]["nbytes"] for r in per_rank] for name, _, _ in HOST_COPY_RUNS}


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_advise_predicts_the_host_copy_a_real_run_allocates_on_rank_0(measured, meta_model):
    module, blocks = meta_model
    work = copy.deepcopy(module)
    report = predict_peaks(
        module,
        precision="32-true",
        devices=2,
        batch_size=2,
        seq_len=HOST_COPY_SEQ,
        block_names=blocks,
        device_type="cpu",
        tp_plan=(work, infer_tp_plan(work, tp_size=2)),
    )
    for name in ("ddp_tuned", "tp_dp", "pp_dp"):  # the launch saved them in 32-true
        assert report.host_copy[name] == measured[name][0], name
        assert report.as_dict()["peak"][name]["async_checkpoint_host_copy_bytes"] == measured[name][0]
    mixed = host_copies(module, precision="bf16-mixed", devices=2, device_type="cpu")
    assert mixed["fsdp_blocks"] == measured["fsdp_blocks"][0]
    # hsdp of 2 replicas x 1 shard, in bf16-true: every rank saves the whole model in bf16
    replicas = host_copies(module, precision="bf16-true", devices=1, nodes=2, device_type="cpu")
    assert replicas["hsdp"] == measured["hsdp"][0]


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_every_ranks_host_copy_is_its_own_share_of_the_model_and_optimizer_state(measured, meta_model):
    module, blocks = meta_model
    rng = 2 * rng_bytes()  # rank 0's checkpoint holds both ranks' RNG states; rank 1's none
    tp = copy.deepcopy(module)
    tp_local = tp_local_model(tp, infer_tp_plan(tp, tp_size=2))
    plan = pipeline_plan(module, blocks, pipeline_layout(2, 1, 2))
    expected = {
        "ddp_tuned": [saved_state_bytes(module, precision="32-true"), 0],  # rank 0 writes the one file
        # the embedding and the head have 63 rows: rank 0 holds 32 of them, rank 1 31
        "fsdp_blocks": [saved_state_bytes(module, precision="bf16-mixed", shard=2, index=i) for i in (0, 1)],
        "hsdp": [saved_state_bytes(module, precision="bf16-true")] * 2,
        "tp_dp": [saved_state_bytes(tp_local, precision="32-true")] * 2,
        "pp_dp": [
            saved_state_bytes(module, precision="32-true", keep=stage_entries(plan, s)) for s in (0, 1)
        ],
    }
    for name, (rank0, rank1) in expected.items():
        assert measured[name] == [rank0 + rng, rank1], name
    assert measured["fsdp_blocks"][0] - rng - measured["fsdp_blocks"][1] == 12 * (
        32 + 32
    )  # one more row of 32
