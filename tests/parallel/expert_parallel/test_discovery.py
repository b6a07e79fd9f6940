"""MoE layer discovery and the expert-parallel plan's checks (one process, no process group)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lit_parallel.parallel import ParallelDims, find_transformer_blocks
from lit_parallel.parallel.expert_parallel import (
    expert_parameter_count,
    find_moe_layers,
    plan_expert_parallel,
)
from tests.moe_models import EXPERTS, HIDDEN, TOP_K, HandMoE, hand_moe, mixtral, qwen2_moe
from tests.tp_models import TPGPT


def test_stacked_experts_of_transformers_families_are_found():
    for build, inner in ((mixtral, 32), (qwen2_moe, 24)):
        model = build()
        layers = find_moe_layers(model)
        assert [layer.path for layer in layers] == [f"model.layers.{i}.mlp.experts" for i in range(2)]
        for layer in layers:
            assert layer.kind == "stacked" and layer.num_experts == EXPERTS
            # gate_up_proj [E, 2I, H] + down_proj [E, H, I]
            assert layer.expert_numel == EXPERTS * (2 * inner * HIDDEN + HIDDEN * inner)
            assert layer.expert_parameter_names() == [f"{layer.path}.gate_up_proj", f"{layer.path}.down_proj"]


def test_shared_expert_and_router_are_not_experts():
    names = {n for layer in find_moe_layers(qwen2_moe()) for n in layer.expert_parameter_names()}
    assert not any("shared_expert" in n or ".gate." in n for n in names)


def test_a_module_list_of_experts_next_to_a_router_is_found():
    model = hand_moe()
    layers = find_moe_layers(model)
    assert [layer.path for layer in layers] == ["blocks.0.moe", "blocks.1.moe"]
    layer = layers[0]
    assert (layer.kind, layer.experts_name, layer.router_name, layer.top_k) == (
        "module_list",
        "experts",
        "gate",
        TOP_K,
    )
    # w1, w3: [2H, H]; w2: [H, 2H]
    assert layer.expert_numel == EXPERTS * 3 * (2 * HIDDEN * HIDDEN)
    assert expert_parameter_count(model) == 2 * layer.expert_numel


def test_transformer_blocks_are_not_taken_for_experts_nor_experts_for_blocks():
    assert find_moe_layers(TPGPT()) == []  # a ModuleList of blocks has no router
    plan = find_transformer_blocks(hand_moe())
    assert [name for name, _ in plan.blocks] == ["blocks.0", "blocks.1"]


def test_a_module_list_without_router_or_with_unlike_members_is_no_moe():
    class NoRouter(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])

    class Unlike(HandMoE):
        def __init__(self):
            super().__init__()
            self.experts[1] = nn.Linear(HIDDEN, HIDDEN)

    assert find_moe_layers(NoRouter()) == []
    assert find_moe_layers(Unlike()) == []


def test_expert_parallel_on_a_model_without_moe_layers_is_refused():
    with pytest.raises(
        ValueError, match=r"expert_parallel_size=2, but TPGPT has no MoE layer.*expert_parallel_size=1"
    ):
        plan_expert_parallel(TPGPT(), 2)
    assert plan_expert_parallel(TPGPT(), 1).layers == []


def test_a_size_that_does_not_divide_the_experts_is_refused_with_the_choices():
    with pytest.raises(
        ValueError, match=r"expert_parallel_size=3 does not divide the 4 experts.*\[1, 2, 4\]"
    ):
        plan_expert_parallel(mixtral(), 3)


@pytest.mark.parametrize("bad", [0, -1.0, True, "1"])
def test_a_bad_capacity_factor_is_refused(bad):
    with pytest.raises(ValueError, match="expert_capacity_factor"):
        plan_expert_parallel(hand_moe(), 2, capacity_factor=bad)


def test_transformers_own_expert_parallelism_is_refused():
    model = mixtral()
    model.model.layers[0].mlp.experts._is_expert_parallel = True
    with pytest.raises(ValueError, match="already runs expert parallelism itself"):
        find_moe_layers(model)


# --- the mesh ---------------------------------------------------------------------------------------------


def test_expert_parallel_borrows_from_the_data_parallel_ranks():
    dims = ParallelDims.for_fsdp(8, expert_parallel=4)
    assert (dims.data_parallel, dims.expert_parallel, dims.expert_data_parallel) == (8, 4, 2)
    assert dims.mesh_dim_names == ("expert_data_parallel", "expert_parallel", "tensor_parallel")
    tp = ParallelDims.for_tensor_parallel(
        num_nodes=1, devices_per_node=8, tensor_parallel=2, expert_parallel=2
    )
    assert (tp.data_parallel, tp.expert_data_parallel, tp.tensor_parallel) == (4, 2, 2)
    pp = ParallelDims.for_pipeline(world_size=8, pipeline_parallel=2, expert_parallel=2)
    assert pp.mesh_dim_names == (
        "pipeline_parallel",
        "expert_data_parallel",
        "expert_parallel",
        "tensor_parallel",
    )
    assert "expert_parallel=2 of them" in pp.describe()


def test_expert_parallel_sizes_that_cannot_work_are_refused():
    with pytest.raises(
        ValueError, match=r"expert_parallel=3 does not divide the data-parallel size 4.*choose 1, 2 or 4"
    ):
        ParallelDims.for_fsdp(4, expert_parallel=3)
    with pytest.raises(ValueError, match="does not combine with replication"):
        ParallelDims(world_size=8, data_parallel_replicate=2, expert_parallel=2)
    with pytest.raises(ValueError, match="expert_parallel=0 must be"):
        ParallelDims(world_size=4, expert_parallel=0)
    with pytest.raises(RuntimeError, match="no expert_parallel dimension"):
        ParallelDims(world_size=4).expert_mesh()


def test_hidden_sizes_are_what_the_tests_assume():
    layer = find_moe_layers(mixtral())[0]
    assert tuple(layer.module.gate_up_proj.shape) == (EXPERTS, 64, HIDDEN)
    assert isinstance(layer.module.down_proj, torch.nn.Parameter)
