"""The planner with expert parallelism: what a model's experts are, when the advisor lists and chooses
``fsdp_blocks(expert_parallel_size=e)`` (rule 5), and what each rank holds and gathers then.

The parameter counts are written out from the tiny models' layer sizes (tests/moe_models.py), never read
from the code under test: ``V`` vocabulary, ``H`` hidden, ``E`` experts, ``I`` an expert's inner size.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lit_parallel.planner.memory.peak import ModelShape, fsdp_moments, gathered_elements, shard_elements
from lit_parallel.planner.model_summary import ModelSummary
from lit_parallel.planner.rules import EXPERT_SHARE_THRESHOLD, advise, expert_parallel_choice, summarize_model
from lit_parallel.planner.simulation import simulate_step
from tests import moe_models as mm
from tests.models import GPT

V, H, E = mm.VOCAB, mm.HIDDEN, mm.EXPERTS
ROOT = V * H + V * H + H  # the embedding, the untied output head, the final norm (HF models)

# Mixtral layer: q, k, v, o (2 heads of 8 and 2 key/value heads: H x H each), the router (E x H), the
# stacked experts gate_up [E, 2I, H] and down [E, H, I] with I = 32, two RMSNorms
MIXTRAL_DENSE = 4 * H * H + E * H + 2 * H  # 1,120
MIXTRAL_EXPERTS = E * 2 * 32 * H + E * H * 32  # 6,144
MIXTRAL = 2 * (MIXTRAL_DENSE + MIXTRAL_EXPERTS) + ROOT  # 16,592
# Qwen2-MoE layer: q, k, v with biases, o without; the router; the experts (I = 24); the shared expert
# (3 x H x 32) and its gate (H); two RMSNorms
QWEN_DENSE = 3 * (H * H + H) + H * H + E * H + 3 * H * 32 + H + 2 * H  # 2,720
QWEN_EXPERTS = E * 2 * 24 * H + E * H * 24  # 4,608
QWEN = 2 * (QWEN_DENSE + QWEN_EXPERTS) + ROOT  # 16,720
# the hand-written block: two LayerNorms (weight + bias), q, k, v, o projections with biases, the router
# (E x H), a ModuleList of E SwiGLU MLPs of inner size 2H (three H x 2H matrices)
HAND_DENSE = 2 * 2 * H + 4 * (H * H + H) + E * H  # 1,216
HAND_EXPERT = 3 * H * 2 * H  # 1,536 per expert
HAND = 2 * (HAND_DENSE + E * HAND_EXPERT) + 2 * V * H  # 16,768 (no final norm)

MODELS = {
    "mixtral": (mm.mixtral, MIXTRAL, 2 * MIXTRAL_EXPERTS, MIXTRAL_DENSE, MIXTRAL_EXPERTS),
    "qwen2_moe": (mm.qwen2_moe, QWEN, 2 * QWEN_EXPERTS, QWEN_DENSE, QWEN_EXPERTS),
    "hand": (mm.hand_moe, HAND, 2 * E * HAND_EXPERT, HAND_DENSE, E * HAND_EXPERT),
}
FP32 = 4 + 4 + 8  # bytes per parameter: parameter, gradient, Adam's two moments


def _between_fsdp_and_ddp(params: int, ranks: int) -> float:
    """Device memory (GB, CPU devices: 10 % headroom) halfway between the state sharded over ``ranks`` and
    the whole state: DDP does not fit, FSDP does (the tiny models' blocks fit easily)."""
    usable = (FP32 * params / ranks + FP32 * params) / 2
    return usable / 0.9 / 1e9


@pytest.mark.parametrize("name", list(MODELS))
def test_the_summary_counts_the_experts_of_stacked_and_module_list_layers(name):
    build, params, experts, dense, block_experts = MODELS[name]
    s = summarize_model(build(), precision="32-true", seq_len=8)
    assert (s.params, s.expert_params, s.experts_per_layer) == (params, experts, (E, E))
    assert (s.largest_block_params, s.largest_block_expert_params) == (dense + block_experts, block_experts)


@pytest.mark.parametrize("name", list(MODELS))
def test_rule_5_gives_fsdp_blocks_with_expert_parallelism_when_experts_dominate(name):
    build, params, experts, dense, block_experts = MODELS[name]
    assert experts / params >= EXPERT_SHARE_THRESHOLD  # 74 %, 55 %, 73 %
    a = advise(
        model=build(),
        devices=2,
        memory_gb=_between_fsdp_and_ddp(params, 2),
        precision="32-true",
        device_type="cpu",
        batch_size=1,
        seq_len=2,
    )
    assert (a.recommendation, a.rule.number, a.strategy_arguments) == (
        "fsdp_blocks",
        5,
        {"expert_parallel_size": 2},
    )
    assert a.choice == "fsdp_blocks(expert_parallel_size=2)" and a.verdict(a.rule, True) == "yes"
    assert [holds for _, holds, _ in a.evaluations] == [False, False, False, False, True]
    # the row: experts / 2 / (2 / 2), the rest / 2: ZeRO-3's state, 16 bytes x P / 2 with each parameter's
    # dim 0 padded to a multiple of 2 (the rank holding the most; an even number of experts needs no padding)
    row = a.row("FSDP+EP")
    assert row.strategy == "fsdp_blocks(expert_parallel_size=2)" and row.fits
    half = sum(
        -(-p.shape[0] // 2) * p[0].numel() if p.dim() else 1 for p in dict.fromkeys(build().parameters())
    )
    assert params / 2 <= half < params / 2 + 1000
    assert row.state_bytes == FP32 * half == a.row("FSDP/ZeRO-3").state_bytes
    assert "experts / 2 (expert parallel) / 1 (FSDP); the rest / 2" == row.sharding
    evidence = a.evaluations[-1][2]
    gathered = dense + block_experts // 2
    assert f"experts hold {experts / params:.0%} of the parameters ({experts:,} of {params:,}" in evidence
    assert f"gathers {gathered:,} of the largest block's {dense + block_experts:,} parameters" in evidence
    assert "expert_parallel_size=2: the largest that divides" in evidence
    assert "-> fsdp_blocks(expert_parallel_size=2) (rule 5)" in a.describe()
    assert a.as_dict()["strategy_arguments"] == {"expert_parallel_size": 2}


def test_a_dense_model_never_gets_expert_parallelism():
    model = GPT()
    params = sum(p.numel() for p in model.parameters())
    memory_gb = _between_fsdp_and_ddp(params, 2)
    a = advise(model=model, devices=2, memory_gb=memory_gb, precision="32-true", device_type="cpu", seq_len=2)
    assert (a.recommendation, a.strategy_arguments, a.expert_parallel_size) == ("fsdp_blocks", {}, 1)
    rule, holds, evidence = a.evaluations[4]
    assert (rule.number, holds) == (5, False) and evidence.startswith("no MoE layers")
    assert a.rule.number == 7 and "FSDP+EP" not in [r.name for r in a.rows]


def test_experts_below_half_of_the_parameters_are_not_split():
    # one hand-written MoE block under an embedding of 1000 x 16: 6,144 experts of 16,000 + 7,360 parameters
    model = nn.Sequential(nn.Embedding(1000, H), mm.HandBlock())
    size, reason = expert_parallel_choice(summarize_model(model, precision="32-true"), devices=2)
    share = E * HAND_EXPERT / (1000 * H + HAND_DENSE + E * HAND_EXPERT)
    assert size == 1 and f"experts hold {share:.0%} of the parameters" in reason and "less than 50%" in reason


def test_the_threshold_is_inclusive_and_unknown_experts_are_not_evaluated():
    half = ModelSummary("m", params=100, trainable_params=100, expert_params=50, experts_per_layer=(4,))
    assert expert_parallel_choice(half, devices=2)[0] == 2
    less = ModelSummary("m", params=100, trainable_params=100, expert_params=49, experts_per_layer=(4,))
    assert expert_parallel_choice(less, devices=2)[0] == 1
    size, reason = expert_parallel_choice(None, devices=2)
    assert size is None and "pass a model" in reason
    a = advise(7e9, devices=8, memory_gb=80, block_params=0.2e9)  # a parameter count only
    assert a.evaluations[4][1] is None and "which parameters are experts" in a.evaluations[4][2]


@pytest.mark.parametrize(
    ("experts", "devices", "size"),
    [
        ((4, 4), 2, 2),
        ((4, 4), 8, 4),  # at most the experts of a layer
        ((8, 8), 4, 4),  # at most the devices of a node
        ((8, 8), 6, 2),  # dividing both 8 and 6
        ((8, 4), 8, 4),  # every layer: their common divisors
        ((4, 4), 3, 1),  # none above 1 divides 4 and 3
        ((6,), 4, 2),
    ],
)
def test_the_size_is_the_largest_dividing_every_layers_experts_and_the_devices_of_a_node(
    experts, devices, size
):
    summary = ModelSummary("m", params=100, trainable_params=100, expert_params=90, experts_per_layer=experts)
    got, reason = expert_parallel_choice(summary, devices=devices)
    assert got == size
    if size == 1:
        assert "no expert_parallel_size above 1 divides both" in reason and f"{devices} device(s)" in reason


def test_several_nodes_keep_the_all_to_all_inside_a_node():
    # 2 nodes of 2 devices, 4 experts: 4 would divide the 4 ranks, but an all-to-all group must stay in a node
    s = summarize_model(mm.mixtral(), precision="32-true", seq_len=2)
    assert expert_parallel_choice(s, devices=2)[0] == 2


def test_rule_5_holds_as_a_last_resort_when_even_the_split_state_does_not_fit():
    # 110 kB usable: a block (7,264 x 8 bytes) fits, the state over 2 ranks (16 x 16,592 / 2 bytes) does not
    memory_gb = 110e3 / 0.9 / 1e9
    a = advise(
        model=mm.mixtral(), devices=2, memory_gb=memory_gb, precision="32-true", device_type="cpu", seq_len=2
    )
    assert a.choice == "fsdp_blocks(expert_parallel_size=2)" and a.rule.number == 5
    assert a.verdict(a.rule, True) == "last resort" and "does not fit either" in a.evaluations[-1][2]
    assert a.warnings[0].startswith("fsdp_blocks(expert_parallel_size=2) needs")


# --- what a rank gathers and holds -----------------------------------------------------------------------


def _blocks(model: nn.Module) -> list[nn.Module]:
    return list(model.model.layers) if hasattr(model, "model") else list(model.blocks)


def test_a_block_gathers_its_non_expert_parameters_and_its_share_of_the_experts():
    model = mm.mixtral()
    shape = ModelShape.of(model, _blocks(model))
    assert shape.expert_params == 2 * MIXTRAL_EXPERTS
    dense, experts = shape.groups()[0]
    # 2 ranks (no padding: every dim 0 is even): the whole block, or its dense part + half of its experts
    assert gathered_elements(dense, experts, 2) == MIXTRAL_DENSE + MIXTRAL_EXPERTS
    assert gathered_elements(dense, experts, 2, expert_parallel=2) == MIXTRAL_DENSE + MIXTRAL_EXPERTS // 2
    # 6 ranks, e = 2: the experts' shards over 3 ranks; dim 0 of every parameter padded as FSDP2 pads it
    # dense: q, k, v, o [16, 16] -> 18 rows; router [4, 16] -> 6 rows; two norms [16] -> 18 elements
    padded_dense = 4 * 18 * H + 6 * H + 2 * 18
    # local experts [2, 64, 16] and [2, 16, 32] -> 3 rows over 3 ranks; without EP [4, ...] -> 6 rows over 6
    assert gathered_elements(dense, experts, 6, expert_parallel=2) == padded_dense + 3 * 64 * H + 3 * H * 32
    assert gathered_elements(dense, experts, 6) == padded_dense + 6 * 64 * H + 6 * H * 32
    assert (
        shard_elements(dense, experts, 6, expert_parallel=2)
        == padded_dense / 6 + (3 * 64 * H + 3 * H * 32) / 3
    )


def test_module_list_experts_keep_e_over_ep_whole_experts_and_their_tensors():
    model = mm.hand_moe()
    shape = ModelShape.of(model, _blocks(model))
    dense, experts = shape.groups()[1]
    assert gathered_elements(dense, experts, 2, expert_parallel=2) == HAND_DENSE + 2 * HAND_EXPERT
    assert gathered_elements(dense, experts, 4, expert_parallel=4) == HAND_DENSE + HAND_EXPERT
    # parameter tensors: embedding, head; per block 2 + 8 + 2 + 1 + E x 3; with e = 2 each block keeps 2 experts
    tensors = 2 + 2 * (2 + 8 + 2 + 1 + E * 3)
    assert (
        shape.param_tensors_per_rank(1) == tensors and shape.param_tensors_per_rank(2) == tensors - 2 * 2 * 3
    )
    assert shape.expert_groups(2) == 2 * 2  # each local expert is an FSDP group of its own
    mixtral = mm.mixtral()
    assert ModelShape.of(mixtral, _blocks(mixtral)).expert_groups(2) == 2  # one per stacked module


@pytest.mark.parametrize(("name", "pad"), [("mixtral", 0), ("qwen2_moe", H)])
def test_fsdp_moments_with_expert_parallelism_gather_half_the_experts_and_hold_the_same_state(name, pad):
    # pad: Qwen2-MoE's shared expert gate [1, H] has one row, padded to 2 over 2 ranks (every other dim 0 is even)
    build, params, _, dense, block_experts = MODELS[name]
    model = build()
    blocks = _blocks(model)
    names = [f"model.layers.{i}" for i in range(len(blocks))]
    sim = simulate_step(model, block_names=names, batch_size=2, seq_len=8)
    shape = ModelShape.of(model, blocks)
    state = (4 * params / 2, 4 * params / 2, 8 * params / 2)  # fp32 ZeRO-3 over 2 ranks (no padding)
    kw = {"c": 4, "opt_bytes": 0, "shard": 2, "gloo": True}
    plain = {m.moment or m.phase: m for m in fsdp_moments("fsdp_blocks", sim, shape, state, **kw)}
    split = {
        m.moment or m.phase: m
        for m in fsdp_moments("fsdp_blocks_ep", sim, shape, state, expert_parallel=2, **kw)
    }
    for k in range(len(blocks)):
        inside, ep = plain[f"inside block {k}"], split[f"inside block {k}"]
        # the shards, the root gathered (kept from forward into backward) and block k gathered
        shards = 4 * (params + 2 * pad) / 2
        assert inside.params == shards + 4 * ROOT + 4 * (dense + pad + block_experts)
        assert ep.params == shards + 4 * ROOT + 4 * (dense + pad + block_experts // 2)
        # block k's flat all-gather output shrinks alike; activations are the one-process step's
        assert inside.temporaries - ep.temporaries == 4 * block_experts // 2
        assert (ep.grads, ep.optimizer, ep.activations) == (
            inside.grads,
            inside.optimizer,
            inside.activations,
        )
        done, ep_done = plain[f"block {k} reduce-scattered"], split[f"block {k} reduce-scattered"]
        assert ep_done.total < done.total
    figures = ("params", "grads", "optimizer", "activations", "temporaries")
    steps = (plain["optimizer step"], split["optimizer step"])
    assert [getattr(steps[0], f) for f in figures] == [getattr(steps[1], f) for f in figures]  # the shards


def test_the_simulated_step_records_the_rows_each_moe_layer_routes():
    sim = simulate_step(mm.mixtral(), dtype=torch.float32, batch_size=2, seq_len=8)
    # 2 sequences of 8 tokens, hidden 16, top-2 of 4 experts, in each of the 2 layers
    assert sim.moe_calls == ((16, H, mm.TOP_K, E), (16, H, mm.TOP_K, E))
