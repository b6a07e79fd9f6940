"""hsdp as 2x2 on 4 ranks of two torchrun "nodes"; checkpoints saved on 4 ranks, loaded on 2 and 1.

Launches: 2 nodes x 2 ranks on loopback (hsdp with shard_size="auto", hsdp parity with shard_size=2,
checkpoint save and resume), then 2 ranks and 1 rank (checkpoint load).
"""

from __future__ import annotations

import argparse

import pytest
import torch

from lit_parallel.checkpoint.convert import consolidate
from lit_parallel.commands import consolidate as consolidate_command
from lit_parallel.commands.cli import COMMANDS
from tests.harness import launch
from tests.models import GPT
from tests.reference import assert_rel_close, reference_training
from tests.scenarios import fsdp as sc
from tests.strategies.test_fsdp import GPT_PARAMS, GROUPS, ROOT_PARAMS, assert_parity, fsdp2_adamw_bytes

pytestmark = pytest.mark.multiprocess
WORLD = 4


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def run4(tmp_path_factory, ckpt_dir):
    """4 ranks as two torchrun agents on loopback ("nodes") of 2 ranks each."""
    return launch(
        [
            "tests.scenarios.fsdp:hsdp_two_nodes",
            "tests.scenarios.fsdp:hsdp_parity",
            "tests.scenarios.fsdp:checkpoint_save",
        ],
        WORLD // 2,
        tmp_path_factory.mktemp("four"),
        nnodes=2,
        args={"ckpt_dir": str(ckpt_dir)},
        timeout=420,
    )


@pytest.fixture(scope="module")
def saved(run4):
    return run4.scenario("checkpoint_save")[0]["saved"]


@pytest.mark.timeout(480)
def test_hsdp_2x2_matches_single_process_with_accumulation_and_clipping(run4):
    out = run4.scenario("hsdp_parity")
    ref = reference_training(
        sc.build_model("gpt"),
        sc.lm_dataset(),
        sc.lm_loss,
        world_size=WORLD,
        per_rank_batch=2,
        max_steps=5,
        lr=0.1,
        accumulate_grad_batches=2,
        gradient_clip_val=0.5,
    )
    assert_parity(out, ref, "hsdp 2x2")
    r0 = out[0]
    assert r0["mesh_dims"] == ["data_parallel_replicate", "data_parallel_shard", "tensor_parallel"]
    assert r0["mesh_shape"] == [2, 2, 1] and r0["dp_size"] == WORLD
    assert all(p == "(Replicate(), Shard(dim=0))" for p in r0["placements"].values())
    # the sampler spans all 4 ranks: every rank reads different data
    assert [r["sampler"] for r in out] == [{"num_replicas": WORLD, "rank": i} for i in range(WORLD)]


@pytest.mark.timeout(480)
def test_hsdp_reduce_scatters_inside_the_replica_and_all_reduces_across(run4):
    shard = replicas = 2
    for rank, r in enumerate(run4.scenario("hsdp_parity")):
        for step in r["steps"]:
            records = [tuple(x) for x in step["records"]]
            gathers = [x for x in records if x[0] == "all_gather"]
            scatters = [x for x in records if x[0] == "reduce_scatter"]
            reduces = [x for x in records if x[0] == "all_reduce"]
            # 2 micro-batches x every group in forward and every block in backward (the root stays gathered
            # into backward), over the 2 ranks of a replica
            assert len(gathers) == 2 * (2 * GROUPS - 1) and {x[2] for x in gathers} == {shard}, rank
            assert sum(x[1] for x in gathers) == 2 * 4 * (2 * GPT_PARAMS - ROOT_PARAMS)
            assert len(scatters) == GROUPS and sum(x[1] for x in scatters) == 4 * GPT_PARAMS
            # each group's gradient shard (1/shard of it) is all-reduced over the replicas, once per step;
            # plus the scalar all-reduce of gradient clipping
            grad_reduces = [x for x in reduces if x[1] > 4 * 64]
            assert len(grad_reduces) == GROUPS and {x[2] for x in grad_reduces} == {replicas}
            assert sum(x[1] for x in grad_reduces) == 4 * GPT_PARAMS // shard
            assert len(reduces) == GROUPS + 1


@pytest.mark.timeout(480)
def test_resumed_run_continues_the_uninterrupted_loss_curve(run4):
    r = run4.scenario("checkpoint_save")[0]
    half = len(r["first_half"])
    assert len(r["uninterrupted"]) == 2 * half and len(r["resumed"]) == half
    torch.testing.assert_close(r["first_half"], r["uninterrupted"][:half], rtol=0, atol=0)
    # model, AdamW state and loop state restored: the same losses and weights as never stopping
    assert_rel_close(r["resumed"], r["uninterrupted"][half:], rel=1e-6, what="resumed losses")
    for k, v in r["uninterrupted_params"].items():
        assert_rel_close(r["resumed_params"][k], v, rel=1e-6, what=k)


@pytest.mark.timeout(480)
def test_memory_per_rank_on_four_ranks(run4):
    m = run4.scenario("checkpoint_save")[0]["saved"]["memory"]  # rank 0 of fsdp_blocks over 4 ranks
    assert m["params"] == m["grads"] == 4 * GPT_PARAMS // WORLD
    assert m == fsdp2_adamw_bytes(GPT(), WORLD, rank=0)  # exactly, shape by shape


def _assert_bitwise(got, expected, path="") -> None:
    if isinstance(expected, torch.Tensor):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=path)
    elif isinstance(expected, dict):
        assert set(got) == set(expected), path
        for k in expected:
            _assert_bitwise(got[k], expected[k], f"{path}/{k}")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), path
        for i, (g, e) in enumerate(zip(got, expected)):
            _assert_bitwise(g, e, f"{path}[{i}]")
    else:
        assert got == expected, path


@pytest.mark.timeout(480)
@pytest.mark.parametrize("ranks", [2, 1])
def test_checkpoint_saved_on_4_ranks_loads_bitwise_on_fewer(ranks, saved, ckpt_dir, tmp_path):
    res = launch(
        "tests.scenarios.fsdp:checkpoint_load",
        ranks,
        tmp_path,
        args={"sharded": str(ckpt_dir / "sharded"), "file": str(ckpt_dir / "full.ckpt")},
        timeout=300,
    )
    out = res.scenario("checkpoint_load")[0]
    for label, model_key, optim_key in (
        ("sharded", "model", "optimizer"),
        ("file", "file_model", "file_optimizer"),
    ):
        r = out[label]
        assert r["trained"] == 0  # restored at max_epochs: no step ran after loading
        assert (r["global_step"], r["epoch"]) == (saved["global_step"], saved["epoch"])
        _assert_bitwise(r["model"], saved[model_key], f"{label} model")
        _assert_bitwise(r["optimizer"], saved[optim_key], f"{label} optimizer")


@pytest.mark.timeout(480)
def test_consolidated_checkpoint_loads_into_the_unwrapped_model(saved, ckpt_dir, tmp_path):
    # the LightningModule's keys ...
    state = consolidate(ckpt_dir / "sharded", tmp_path / "full.pt")
    loaded = torch.load(tmp_path / "full.pt", weights_only=True)
    module = sc.LitModel()
    module.load_state_dict(loaded)
    _assert_bitwise(loaded, saved["model"])
    assert set(state) == set(loaded)
    # ... and, through `lit-parallel consolidate`, the plain nn.Module's
    assert COMMANDS["consolidate"][0] == "lit_parallel.commands.consolidate"
    parser = argparse.ArgumentParser()
    consolidate_command.add_arguments(parser)
    args = parser.parse_args(
        [str(ckpt_dir / "sharded"), str(tmp_path / "gpt.pt"), "--strip-prefix", "model."]
    )
    assert consolidate_command.run(args) == 0
    gpt = GPT()
    gpt.load_state_dict(torch.load(tmp_path / "gpt.pt", weights_only=True))
    for k, v in gpt.state_dict().items():
        torch.testing.assert_close(v, saved["model"][f"model.{k}"], rtol=0, atol=0)


@pytest.mark.timeout(540)
def test_hsdp_on_two_torchrun_nodes_shards_within_and_replicates_across(run4):
    out = run4.scenario("hsdp_two_nodes")
    assert sorted(r["node_rank"] for r in out) == [0, 0, 1, 1]
    for r in out:
        assert r["num_nodes"] == 2
        assert (r["shard"], r["replicate"]) == (2, 2)  # shard_size="auto" = 2 devices per node
        assert r["placements"] and all(p == "(Replicate(), Shard(dim=0))" for p in r["placements"].values())
        assert all(torch.isfinite(torch.tensor(r["losses"])))
    # sampling is over all 4 ranks: disjoint shards that together cover the dataset
    seen = [i for r in out for i in r["indices"]]
    assert sorted(seen) == list(range(16))
