"""Expert parallelism on real gloo ranks against a single-process plain PyTorch reference.

Two launches: 2 ranks (fsdp_blocks with expert_parallel_size=2, the all-to-all bytes, the capacity factor,
checkpoints saved, resumed and resharded to no expert parallelism) and 4 ranks (fsdp_blocks with
expert_parallel_size 2 and 4, tp_dp as data_parallel 2 x tensor_parallel 2 with experts over the 2
data-parallel ranks, pp_dp as pp2 x dp2 with experts inside each stage, the 2-rank checkpoints loaded with
expert_parallel_size 4 and 2). Models: tiny transformers Mixtral and Qwen2-MoE (stacked experts) and a
hand-written MoE with an nn.ModuleList of experts (tests/moe_models.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from lit_parallel.checkpoint.convert import consolidate
from tests.harness import launch
from tests.moe_models import MODELS, TOP_K
from tests.reference import assert_rel_close, reference_training
from tests.scenarios import expert_parallel as sc

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ep_checkpoints")


@pytest.fixture(scope="module")
def two(tmp_path_factory, ckpt_dir):
    return launch(
        [
            f"tests.scenarios.expert_parallel:{n}"
            for n in (
                "parity_fsdp_ep2",
                "parity_fsdp_ep2_checkpointed",
                "exchange_bytes",
                "checkpoint_save",
                "meta_init",
                "init_from_file",
            )
        ],
        2,
        tmp_path_factory.mktemp("ep2"),
        args={"ckpt_dir": str(ckpt_dir)},
        timeout=600,
    )


@pytest.fixture(scope="module")
def four(tmp_path_factory, two):
    saved = two.scenario("checkpoint_save")[0]
    names = ("parity_fsdp_ep2_of_4", "parity_fsdp_ep4", "parity_tp_dp", "parity_pp_dp", "checkpoint_reshard")
    return launch(
        [f"tests.scenarios.expert_parallel:{n}" for n in names],
        4,
        tmp_path_factory.mktemp("ep4"),
        args={f"{name}_ckpt": saved[name]["path"] for name in ("hand", "mixtral")},
        timeout=1200,
    )


_REFERENCES: dict = {}


def _reference(name: str, dp: int, pipeline: bool = False) -> dict:
    key = (name, dp, pipeline)
    if key not in _REFERENCES:
        loss = sc.pipeline_loss if pipeline else (lambda m, b: sc.data_parallel_loss(m, b, dp))
        _REFERENCES[key] = reference_training(
            MODELS[name](),
            sc.lm_dataset(),
            loss,
            world_size=dp,
            per_rank_batch=sc.PER_RANK_BATCH,
            max_steps=sc.STEPS,
            lr=sc.LR,
            accumulate_grad_batches=sc.ACCUMULATE,
            gradient_clip_val=sc.CLIP,
        )
    return _REFERENCES[key]


def _check_parity(results: list[dict], name: str, dp: int, pipeline: bool = False) -> None:
    ref = _reference(name, dp, pipeline)
    got = results[0]
    assert len(got["losses"]) == sc.STEPS * sc.ACCUMULATE
    assert_rel_close(got["losses"], torch.tensor(ref["losses"]), 1e-5, f"{name} losses")
    params = got["params"]
    # the unsplit weights have exactly the unsplit model's keys
    assert set(params) == {f"model.{k}" for k in ref["params"]}, name
    for k, v in ref["params"].items():
        assert_rel_close(params[f"model.{k}"], v, 1e-5, f"{name} {k}")


def _check_holdings(results: list[dict], copies: int) -> None:
    """Every expert weight is held, as a whole, by exactly ``copies`` ranks in total (1, or the
    tensor-parallel ranks that replicate it), split further over the ranks sharing those experts."""
    full = results[0]["params"]
    expert_keys = set().union(*(r["holdings"] for r in results))
    assert expert_keys, "no expert weight found"
    for key in expert_keys:
        whole = full[f"model.{key}"] if f"model.{key}" in full else full[key]
        pieces = [r["holdings"][key] for r in results if key in r["holdings"]]
        assert sum(p.numel() for p in pieces) == copies * whole.numel(), key
        # each piece is a run of whole rows (experts, or FSDP's row shards of one expert's weight)
        found = []
        for piece in pieces:
            rows = whole.reshape(whole.shape[0], -1)
            flat = piece.reshape(piece.shape[0], -1)
            starts = [
                i
                for i in range(rows.shape[0] - flat.shape[0] + 1)
                if torch.equal(rows[i : i + flat.shape[0]], flat)
            ]
            assert starts, f"{key}: a rank holds rows that are not the weight's"
            found.append((starts[0], flat.shape[0]))
        covered = sorted(r for start, n in found for r in range(start, start + n))
        assert covered == sorted(list(range(whole.shape[0])) * copies), key


def _stacked_experts_per_rank(results: list[dict], experts: int) -> None:
    for r in results:
        for key, local in r["holdings"].items():
            if key.endswith(("gate_up_proj", "down_proj")):
                assert local.shape[0] == experts // r["dims"]["dp"], (key, tuple(local.shape), r["dims"])


# --- 2 ranks --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sc.MODEL_NAMES)
def test_fsdp_ep2_matches_one_process(two, name):
    results = [r[name] for r in two.scenario("parity_fsdp_ep2")]
    assert results[0]["mesh"] == ["expert_data_parallel", "expert_parallel", "tensor_parallel"]
    assert results[0]["layers"] and all(n == 4 for _, _, n in results[0]["layers"])
    _check_parity(results, name, dp=2)
    _check_holdings(results, copies=1)
    _stacked_experts_per_rank(results, 4)


@pytest.mark.parametrize("name", ["mixtral", "hand"])
def test_activation_checkpointing_with_experts_matches_one_process(two, name):
    _check_parity([r[name] for r in two.scenario("parity_fsdp_ep2_checkpointed")], name, dp=2)


def _routing(tokens: torch.Tensor, world: int):
    """Which expert each (token, slot) pair of each rank goes to, from an unsplit one-layer Mixtral."""
    model = MODELS["mixtral"](layers=1)
    with torch.no_grad():
        logits = model(input_ids=tokens, output_router_logits=True).router_logits[0]
    chosen = logits.softmax(-1).topk(TOP_K, dim=-1).indices  # [tokens, k]
    return chosen.reshape(world, -1)  # per rank, its pairs in token order


def test_all_to_all_bytes_equal_the_routing(two):
    """Per rank, the all-to-alls receive (payload = what arrives): the counts (E int64), in forward the pairs
    its experts take (R) and its own pairs back (T*k), in backward the same two again; H fp32 each."""
    results = two.scenario("exchange_bytes")
    world, experts, hidden = 2, 4, 16
    pairs = _routing(results[0]["tokens"], world)
    per_rank = experts // world
    for rank, got in enumerate(results):
        own = pairs[rank].numel()
        received = sum(int(((pairs[src] // per_rank) == rank).sum()) for src in range(world))
        exact = got["exact"]
        assert exact["dropped"] == 0
        assert exact["rows_sent"] == own == sc.PER_RANK_BATCH * sc.SEQ * TOP_K
        assert exact["rows_received"] == received
        assert exact["all_to_all_calls"] == 5  # counts + dispatch + combine, and both again in backward
        assert exact["all_to_all_bytes"] == experts * 8 + 2 * (received + own) * hidden * 4


def test_capacity_factor_drops_and_counts(two):
    results = two.scenario("exchange_bytes")
    world, experts, hidden = 2, 4, 16
    pairs = _routing(results[0]["tokens"], world)
    per_rank = experts // world
    capacity = math.ceil(0.5 * pairs[0].numel() / experts)
    kept = torch.stack(
        [torch.bincount(pairs[r], minlength=experts).clamp(max=capacity) for r in range(world)]
    )
    for rank, got in enumerate(results):
        cap = got["capacity"]
        counts = torch.bincount(pairs[rank], minlength=experts)
        assert cap["dropped"] == int((counts - kept[rank]).sum()) > 0
        received = int(kept[:, rank * per_rank : (rank + 1) * per_rank].sum())
        own = int(kept[rank].sum())
        assert cap["rows_sent"] == own and cap["rows_received"] == received
        # the counts travel twice (as routed, then as kept)
        assert cap["all_to_all_bytes"] == 2 * experts * 8 + 2 * (received + own) * hidden * 4


@pytest.mark.parametrize("name", ["hand", "mixtral"])
def test_resume_is_bitwise_and_reshards(two, name, tmp_path):
    got = two.scenario("checkpoint_save")[0][name]
    continued = got["continued"]
    assert len(continued) == 2 * sc.ACCUMULATE  # the 2 steps after the checkpoint, without a break
    assert got["resumed"][2] == continued  # resumed with the same split: bitwise
    assert_rel_close(
        torch.tensor(got["resumed"][1]), torch.tensor(continued), 1e-5, f"{name} resumed without EP"
    )
    # consolidated: the unsplit model's keys, the weights the run held
    state = consolidate(got["path"], tmp_path / "full.pt", strip_prefix="model.")
    expected = {k[len("model.") :]: v for k, v in got["saved"].items()}
    assert set(state) == set(MODELS[name]().state_dict())
    for k, v in expected.items():
        assert torch.equal(state[k], v), k


def test_a_full_checkpoint_file_holds_every_expert_and_resumes(two):
    got = two.scenario("checkpoint_save")[0]
    full = got["mixtral_full"]
    state = torch.load(full["path"], weights_only=True)["state_dict"]
    assert set(state) == set(full["saved"]) == {f"model.{k}" for k in MODELS["mixtral"]().state_dict()}
    for k, v in full["saved"].items():
        assert torch.equal(state[k], v), k
    assert len(full["continued"]) == 2 * sc.ACCUMULATE
    assert full["resumed"] == full["continued"]  # bitwise
    # module-list experts live on their ranks only: a full file is refused before training, with the fix
    assert "save_distributed_checkpoint=False with expert_parallel_size=2" in got["hand_full_refused"]
    assert "lit-parallel consolidate" in got["hand_full_refused"]


@pytest.mark.parametrize("name", ["hand", "mixtral"])
def test_a_meta_device_model_is_materialised_per_expert(two, name):
    got = two.scenario("meta_init")[0][name]
    assert len(got["losses"]) == 2 * sc.ACCUMULATE and all(math.isfinite(x) for x in got["losses"])
    params = got["params"]
    assert set(params) == {f"model.{k}" for k in MODELS[name]().state_dict()}
    for k, v in params.items():
        assert torch.isfinite(v).all(), k
    # every expert drew its own initial weights (no expert left empty, none a copy of another)
    if name == "mixtral":
        experts = params["model.model.layers.0.mlp.experts.gate_up_proj"]
        rows = [experts[i] for i in range(experts.shape[0])]
    else:
        rows = [params[f"model.blocks.0.moe.experts.{i}.w1.weight"] for i in range(4)]
    for i in range(len(rows)):
        assert rows[i].abs().sum() > 0
        for j in range(i):
            assert not torch.equal(rows[i], rows[j]), (i, j)


@pytest.mark.parametrize("name", ["hand", "mixtral"])
def test_init_from_a_full_file_fills_every_expert(two, name):
    got = two.scenario("init_from_file")[0][name]
    full = torch.load(got["path"], weights_only=True)
    assert set(got["params"]) == set(full)
    for k, v in full.items():
        assert torch.equal(got["params"][k], v), k


# --- 4 ranks --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sc.MODEL_NAMES)
@pytest.mark.parametrize("scenario", ["parity_fsdp_ep2_of_4", "parity_fsdp_ep4"])
def test_fsdp_on_4_ranks_matches_one_process(four, scenario, name):
    results = [r[name] for r in four.scenario(scenario)]
    ep = 2 if scenario.endswith("of_4") else 4
    assert {r["dims"]["ep"] for r in results} == {ep}
    assert sorted(r["dims"]["ep_rank"] for r in results) == sorted(list(range(ep)) * (4 // ep))
    _check_parity(results, name, dp=4)
    _check_holdings(results, copies=1)
    _stacked_experts_per_rank(results, 4)


@pytest.mark.parametrize("name", sc.TP_MODEL_NAMES)
def test_tp_dp_with_experts_matches_one_process(four, name):
    results = [r[name] for r in four.scenario("parity_tp_dp")]
    assert results[0]["mesh"] == ["expert_data_parallel", "expert_parallel", "tensor_parallel"]
    _check_parity(results, name, dp=2)
    _check_holdings(results, copies=2)  # the experts are not split over the 2 tensor-parallel ranks


def test_pp_dp_with_experts_matches_one_process(four):
    results = [r["hand"] for r in four.scenario("parity_pp_dp")]
    assert results[0]["mesh"] == [
        "pipeline_parallel",
        "expert_data_parallel",
        "expert_parallel",
        "tensor_parallel",
    ]
    _check_parity(results, "hand", dp=2, pipeline=True)


@pytest.mark.parametrize("name", ["hand", "mixtral"])
@pytest.mark.parametrize("ep", [4, 2])
def test_checkpoint_loads_with_another_expert_split(two, four, name, ep):
    saved = two.scenario("checkpoint_save")[0][name]["saved"]
    got = four.scenario("checkpoint_reshard")[0][f"{name}_ep{ep}"]
    assert got["losses"] == []  # nothing trained after loading
    assert set(got["params"]) == set(saved)
    for k, v in saved.items():
        assert torch.equal(got["params"][k], v), k
