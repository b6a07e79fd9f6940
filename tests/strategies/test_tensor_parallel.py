"""tp_dp and apply_tp on real gloo ranks, against a single-process plain PyTorch reference.

Launches (2, and a share of one): 2 ranks (tensor_parallel 2), 4 ranks (data_parallel 2 x tensor_parallel 2),
and two torchrun "nodes" of 4 ranks on loopback (replicate 2 x shard 2 x tensor_parallel 2), shared with
pp_dp's 3-D layout; the 4-rank launch is shared with pp_dp and the callbacks (tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from lit_parallel.checkpoint.load import load_sharded
from tests.harness import launch
from tests.reference import assert_rel_close, rank_orders, reference_training
from tests.scenarios import tp as sc

pytestmark = pytest.mark.multiprocess
VARIANTS = ["llama", "llama_sp", "gpt", "gpt_sp"]
N_LAYERS, BATCH, D = 2, 4, 32  # the models' blocks and width; comm_counts runs 4 sequences of sc.SEQ tokens


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    path = tmp_path_factory.mktemp("pretrained") / "gpt.pt"
    torch.save({f"model.{k}": v for k, v in sc.build_model("gpt", seed=123).state_dict().items()}, path)
    return path


@pytest.fixture(scope="module")
def two(tmp_path_factory, pretrained, four_ranks):
    # after the 4-rank launch, whose checkpoint it loads
    names = ["parity_tp2", "custom_plans", "comm_counts", "bad_sequence_length", "init_from_file"]
    names.append("resume_elsewhere")
    return launch(
        [f"tests.scenarios.tp:{n}" for n in names],
        2,
        tmp_path_factory.mktemp("tp2"),
        args={"pretrained": str(pretrained), "ckpt": four_ranks.scenario("checkpoint_resume")[0]["ckpt"]},
        timeout=300,
    )


_REFERENCES: dict = {}


def _reference(name: str, dp: int) -> dict:
    key = (name, dp)
    if key not in _REFERENCES:
        _REFERENCES[key] = reference_training(
            sc.build_model(name),
            sc.lm_dataset(),
            sc.lm_loss,
            world_size=dp,
            per_rank_batch=sc.PER_RANK_BATCH,
            max_steps=sc.STEPS,
            lr=sc.LR,
            accumulate_grad_batches=sc.ACCUMULATE,
            gradient_clip_val=sc.CLIP,
        )
    return _REFERENCES[key]


def _assert_parity(per_rank: list[dict], name: str, dp: int, what: str) -> None:
    ref = _reference(name, dp)
    by_dp: dict[int, torch.Tensor] = {}
    for r in per_rank:
        by_dp.setdefault(r["dp_rank"], r["losses"])
        assert torch.equal(r["losses"], by_dp[r["dp_rank"]]), f"{what}: ranks of one TP group disagree"
    assert sorted(by_dp) == list(range(dp))
    # each data-parallel rank's loss is the mean over its samples; the global loss is their mean
    losses = torch.stack([by_dp[k] for k in sorted(by_dp)]).mean(0)
    assert len(losses) == sc.STEPS * sc.ACCUMULATE
    assert_rel_close(losses, torch.tensor(ref["losses"]), what=f"{what}: losses")
    params = per_rank[0]["params"]
    assert set(params) == {f"model.{k}" for k in ref["params"]}
    for k, expected in ref["params"].items():
        assert_rel_close(params[f"model.{k}"], expected, what=f"{what}: {k}")


def test_reference_clips():
    # the parity runs are only a test of clipping if clipping changes the reference
    no_clip = reference_training(
        sc.build_model("llama"),
        sc.lm_dataset(),
        sc.lm_loss,
        world_size=2,
        per_rank_batch=sc.PER_RANK_BATCH,
        max_steps=sc.STEPS,
        lr=sc.LR,
        accumulate_grad_batches=sc.ACCUMULATE,
    )
    diff = max(
        (no_clip["params"][k] - v).abs().max().item() for k, v in _reference("llama", 2)["params"].items()
    )
    assert diff > 1e-3


# --- 2 ranks: tensor parallel only ----------------------------------------------------------------------


@pytest.mark.timeout(360)
@pytest.mark.parametrize("variant", [*VARIANTS, "llama_ac"])
def test_tp2_matches_single_process_with_accumulation_and_clipping(two, variant):
    out = [r[variant] for r in two.scenario("parity_tp2")]
    assert out[0]["mesh"] == ["data_parallel", "tensor_parallel"]
    _assert_parity(out, variant.split("_")[0], 1, f"tp2 {variant}")


@pytest.mark.timeout(360)
@pytest.mark.parametrize("how", ["dict", "function"])
def test_plan_given_as_dict_or_function_trains_like_the_inferred_one(two, how):
    out = [r[how] for r in two.scenario("custom_plans")]
    assert out[0]["how"] == how
    inferred = two.scenario("parity_tp2")[0]["llama"]["placements"]
    assert out[0]["placements"] == inferred  # the same layers split the same way
    _assert_parity(out, "llama", 1, f"tp2 plan={how}")


@pytest.mark.timeout(360)
@pytest.mark.parametrize("name", ["llama", "gpt"])
def test_two_all_reduces_per_block_forward_without_sequence_parallel(two, name):
    activation = BATCH * sc.SEQ * D * 4  # fp32 (batch, sequence, width) after each row-parallel layer
    for r in two.scenario("comm_counts"):
        assert r[name]["counts"] == {"all_reduce": 2 * N_LAYERS}
        assert r[name]["records"] == [("all_reduce", activation)] * (2 * N_LAYERS)


@pytest.mark.timeout(360)
@pytest.mark.parametrize("name", ["llama", "gpt"])
def test_sequence_parallel_gathers_before_and_reduce_scatters_after_each_region(two, name):
    full = BATCH * sc.SEQ * D * 4
    for r in two.scenario("comm_counts"):
        out = r[f"{name}_sp"]
        # per block: an all-gather after each norm, a reduce-scatter after each row layer; one all-gather
        # of the stream after the last block; no all-reduce
        assert out["counts"] == {
            "all_gather_into_tensor": 2 * N_LAYERS + 1,
            "reduce_scatter_tensor": 2 * N_LAYERS,
        }
        assert out["records"] == [("all_gather", full), ("reduce_scatter", full)] * (2 * N_LAYERS) + [
            ("all_gather", full)
        ]


@pytest.mark.timeout(360)
def test_apply_tp_without_trainer_gives_the_unsplit_forward(two):
    tokens = sc.lm_dataset()[:BATCH][0]
    for name in ("llama", "gpt"):
        expected = sc.build_model(name)(tokens).detach()
        for r in two.scenario("comm_counts"):
            for variant in (name, f"{name}_sp"):
                assert_rel_close(r[variant]["out"], expected, what=variant)
    expected = sc.bench_model()(tokens).detach()  # fused qkv seen through view(b, t, 3, heads, -1)
    for r in two.scenario("comm_counts"):
        assert_rel_close(r["bench"]["out"], expected, what="bench model")
        assert r["bench"]["counts"] == {"all_reduce": 2 * N_LAYERS}


@pytest.mark.timeout(360)
def test_sequence_length_not_divisible_names_the_numbers(two):
    for r in two.scenario("bad_sequence_length"):
        assert "sequence length 7" in r["error"] and "not divisible by tensor_parallel_size=2" in r["error"]


@pytest.mark.timeout(360)
def test_plan_and_parameter_bytes_are_logged(two):
    assert "tensor-parallel plan (traced) for tensor_parallel_size=2" in two.output
    assert "model.h.0.attn.c_attn: colwise (fused)" in two.output
    assert "model.layers.0.attention.n_heads: 4 -> 2 per rank" in two.output
    assert "parameter bytes on this rank" in two.output


@pytest.mark.timeout(360)
def test_meta_device_model_is_filled_from_a_full_state_dict_file(two, pretrained):
    r = two.scenario("init_from_file")[0]
    assert r["how"] == "traced"  # planned on the meta device
    expected = torch.load(pretrained, weights_only=True)
    assert set(r["params"]) == set(expected)
    for k, v in expected.items():
        assert torch.equal(r["params"][k], v), k


# --- 4 ranks: data parallel 2 x tensor parallel 2 -------------------------------------------------------


@pytest.mark.timeout(480)
@pytest.mark.parametrize("variant", VARIANTS)
def test_dp2_tp2_matches_single_process_with_accumulation_and_clipping(four_ranks, variant):
    out = [r[variant] for r in four_ranks.scenario("parity_dp2_tp2")]
    _assert_parity(out, variant.split("_")[0], 2, f"dp2 x tp2 {variant}")


@pytest.mark.timeout(480)
def test_ranks_of_one_tensor_parallel_group_read_identical_batches(four_ranks):
    out = [r["llama"] for r in four_ranks.scenario("parity_dp2_tp2")]
    # mesh (data_parallel, tensor_parallel): ranks 0, 1 form TP group 0 and ranks 2, 3 TP group 1
    assert [r["dp_rank"] for r in out] == [0, 0, 1, 1]
    assert out[0]["batches"] == out[1]["batches"] and out[2]["batches"] == out[3]["batches"]
    # and the sampler shards over the 2 data-parallel ranks only, as DistributedSampler(num_replicas=2)
    for dp_rank, order in enumerate(rank_orders(32, 2, epoch=0)):
        seen = [i for batch in out[2 * dp_rank]["batches"][:8] for i in batch]
        assert seen == order


@pytest.mark.timeout(480)
def test_per_rank_bytes_of_split_block_layers_are_one_over_dp_times_tp(four_ranks):
    full = {f"model.{k}": v.numel() * v.element_size() for k, v in sc.build_model("llama").named_parameters()}
    split = (
        "attention.wq",
        "attention.wk",
        "attention.wv",
        "attention.wo",
        "feed_forward.w1",
        "feed_forward.w2",
    )
    split += ("feed_forward.w3",)
    for r in four_ranks.scenario("parity_dp2_tp2"):
        local = r["llama"]["local_bytes"]
        assert set(local) == set(full)
        for name, nbytes in full.items():
            share = 4 if any(f".{s}." in name for s in split) else 2  # dp x tp, or dp only
            assert local[name] * share == nbytes, name


@pytest.mark.timeout(480)
def test_resume_from_sharded_checkpoint_continues_the_loss_curve(four_ranks):
    r = four_ranks.scenario("checkpoint_resume")[0]
    assert len(r["first"]) == 4 and len(r["resumed"]) == 4
    assert torch.equal(r["straight"], torch.cat([r["first"], r["resumed"]]))
    for k, v in r["straight_params"].items():
        assert torch.equal(r["resumed_params"][k], v), k


@pytest.mark.timeout(480)
def test_sharded_checkpoint_consolidates_to_the_single_process_weights(four_ranks):
    r = four_ranks.scenario("checkpoint_resume")[0]
    state = load_sharded(r["ckpt"], keys={"state_dict"})["state_dict"]
    ref = reference_training(
        sc.build_model("gpt"),
        sc.lm_dataset(16),
        sc.lm_loss,
        world_size=2,
        per_rank_batch=sc.PER_RANK_BATCH,
        max_steps=4,  # one epoch of 16 samples over 2 data-parallel ranks
        lr=sc.LR,
        momentum=sc.MOMENTUM,
        gradient_clip_val=sc.CLIP,
    )
    expected = ref["params"]
    assert set(state) == {f"model.{k}" for k in expected}
    for k, v in expected.items():  # fused c_attn rows back in their original order
        assert_rel_close(state[f"model.{k}"], v, what=k)


@pytest.mark.timeout(480)
def test_checkpoint_loads_on_two_ranks_and_refuses_another_tensor_parallel_size(two, four_ranks):
    saved = four_ranks.scenario("checkpoint_resume")[0]["first_params"]
    r = two.scenario("resume_elsewhere")[0]
    assert r["step"] == 4
    for k, v in saved.items():
        assert torch.equal(r["params"][k], v), k
    assert "saved with tensor_parallel_size=2" in r["error"]
    assert "cannot be resumed with tensor_parallel_size=1" in r["error"]
    assert "model.h.0.attn.c_attn" in r["error"]


# --- 8 ranks: replicate 2 x shard 2 x tensor parallel 2 -------------------------------------------------


@pytest.mark.timeout(480)
@pytest.mark.parametrize("variant", ["llama", "gpt_sp"])
def test_3d_replicate_shard_tensor_matches_single_process(eight_ranks, variant):
    out = [r[variant] for r in eight_ranks.scenario("parity_3d")]
    assert out[0]["mesh"] == ["data_parallel_replicate", "data_parallel_shard", "tensor_parallel"]
    assert [r["dp_rank"] for r in out] == [0, 0, 1, 1, 2, 2, 3, 3]
    _assert_parity(out, variant.split("_")[0], 4, f"replicate 2 x shard 2 x tp 2, {variant}")
