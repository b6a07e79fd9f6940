"""Finding transformer blocks in models no one registered, and the plan built from them (no Trainer)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lit_parallel.parallel import (
    NoBlocksFoundError,
    apply_activation_checkpointing,
    find_transformer_blocks,
    plan_fsdp,
)
from lit_parallel.parallel.blocks import default_group_threshold, size_groups
from tests.models import (
    GPT,
    ConvNet,
    GPTBlock,
    Llama,
    LlamaBlock,
    PlainMLP,
    ResidualMLP,
    Seq2Seq,
    ViT,
    ViTBlock,
    num_params,
    tanh_mlp,
)


@pytest.mark.parametrize(
    ("model", "block_cls", "names"),
    [
        (GPT, GPTBlock, ["h.0", "h.1"]),
        (Llama, LlamaBlock, ["layers.0", "layers.1"]),
        (ViT, ViTBlock, ["blocks.0", "blocks.1", "blocks.2"]),
    ],
)
def test_auto_finds_the_repeated_blocks(model, block_cls, names):
    m = model()
    plan = find_transformer_blocks(m)
    assert [n for n, _ in plan.blocks] == names
    assert plan.block_types == (block_cls,)
    assert plan.block_params == len(names) * num_params(getattr(m, names[0].split(".")[0])[0])
    assert plan.total_params == num_params(m)
    assert plan.block_fraction > 0.5


def test_encoder_decoder_has_two_block_kinds():
    plan = find_transformer_blocks(Seq2Seq())
    assert [c.__name__ for c in plan.block_types] == ["TransformerEncoderLayer", "TransformerDecoderLayer"]
    assert [n for n, _ in plan.blocks] == [
        "transformer.encoder.layers.0",
        "transformer.encoder.layers.1",
        "transformer.decoder.layers.0",
        "transformer.decoder.layers.1",
    ]
    assert set(plan.params_per_block()) == {"TransformerEncoderLayer", "TransformerDecoderLayer"}


def test_model_without_repeated_blocks_is_split_into_size_based_groups():
    # "auto" shards a model without repeated blocks in size-based groups, and the reason and the fix are in
    # the description.
    m = PlainMLP()  # net = Sequential(Linear(16, 32), ReLU, Linear(32, 32), ReLU); out = Linear(32, 4)
    plan = find_transformer_blocks(m)
    total = 16 * 32 + 32 + 32 * 32 + 32 + 32 * 4 + 4
    threshold = -(-total // 8)
    assert (plan.how, plan.total_params, plan.group_threshold) == ("size", total, threshold)
    assert [n for n, _ in plan.blocks] == ["net.0", "net.2"]  # out (132 params) is below the threshold
    assert plan.rest_params == 32 * 4 + 4
    assert plan.counts() == [
        f"no repeated blocks: 2 size-based groups of ~800 params (threshold {threshold})"
    ]
    text = plan.describe()
    assert text.startswith(plan.counts()[0]) and "132 outside (root group)" in text
    assert "nn.ModuleList / nn.Sequential / nn.ModuleDict" not in text and "block_types={MyBlock}" in text


def test_tutorial_mlp_of_linear_and_tanh_has_no_blocks_and_its_linears_repeat_only_as_size_groups():
    m = tanh_mlp()  # Linear 1,088 / 4,160 / 8,320 / 516 params
    plan = find_transformer_blocks(m)
    assert plan.how == "size" and plan.group_threshold == -(-num_params(m) // 8) == 1761
    # post-order: layer 0 (1,088) stays pending, layers 2 and 4 close a group each; layer 6 is left over
    assert [n for n, _ in plan.blocks] == ["2", "4"]
    assert plan.rest_params == 1088 + 516
    # the same model inside a LightningModule-like wrapper: the same groups, one level down
    wrapped = nn.ModuleDict({"model": m})
    assert [n for n, _ in find_transformer_blocks(wrapped).blocks] == ["model.2", "model.4"]


def test_min_group_params_sets_the_threshold_and_groups_never_nest():
    m = tanh_mlp()
    assert [n for n, _ in find_transformer_blocks(m, min_group_params=1).blocks] == ["0", "2", "4", "6"]
    # a module with a group below it is never a group itself: what it holds besides goes to the root group
    assert [n for n, _ in size_groups(m, 5000)] == ["4"]
    # ungrouped parameters add up in the parent: here the whole MLP reaches the threshold only together
    assert [n for n, _ in size_groups(nn.ModuleDict({"model": m}), 14_000)] == ["model"]
    assert size_groups(m, 20_000) == []  # the root is never a group of its own: it is the root group
    with pytest.raises(ValueError, match=r"min_group_params=0 must be a positive integer"):
        find_transformer_blocks(m, min_group_params=0)


def test_default_group_threshold_is_an_eighth_of_the_model_capped_at_fsdp1s_1e8():
    assert default_group_threshold(14_084) == 1761
    assert default_group_threshold(16) == 2
    assert default_group_threshold(8 * 10**9) == 10**8


def test_tied_weights_are_never_split_across_size_groups():
    emb = nn.Embedding(64, 32)
    head = nn.Linear(32, 64, bias=False)
    head.weight = emb.weight
    m = nn.Sequential(emb, nn.Linear(32, 32), nn.Tanh(), head)
    plan = find_transformer_blocks(m, min_group_params=100)
    assert [n for n, _ in plan.blocks] == ["1"]  # the tied embedding and head stay in the root group
    assert plan.total_params == 64 * 32 + 32 * 32 + 32


def test_residual_blocks_as_module_list_of_sequential_are_blocks():
    m = ResidualMLP()
    plan = find_transformer_blocks(m)
    assert plan.how == "auto" and plan.block_types == (nn.Sequential,)
    assert [n for n, _ in plan.blocks] == ["blocks.0", "blocks.1", "blocks.2"]
    per_block = 2 * 16 + 16 * 32 + 32 + 32 * 16 + 16
    assert plan.block_params == 3 * per_block and plan.counts() == [
        f"3 x Sequential ({per_block:,} params each)"
    ]


def test_cnn_stages_of_different_widths_are_blocks_but_the_head_is_not():
    m = ConvNet()
    plan = find_transformer_blocks(m)
    # the stages share a class tree (Conv2d, BatchNorm2d, ReLU, MaxPool2d); the head Sequential does not
    assert [n for n, _ in plan.blocks] == ["features.0", "features.1", "features.2"]
    sizes = [9 * a * b + b + 2 * b for a, b in ((3, 8), (8, 16), (16, 32))]
    assert plan.params_per_block() == {"Sequential": sizes}
    assert plan.rest_params == 32 * 4 + 4


def test_sequential_siblings_of_different_structure_are_not_blocks():
    m = nn.Sequential(
        nn.Sequential(nn.Linear(8, 64), nn.Tanh()),
        nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64)),
        nn.Linear(64, 4),
    )
    assert find_transformer_blocks(m).how == "size"
    same = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)), nn.Linear(8, 2))
    assert [n for n, _ in find_transformer_blocks(same).blocks] == ["0", "1", "2"]


def test_torch_transformer_encoder_layers_are_the_blocks():
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    m = nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
    plan = find_transformer_blocks(m)
    assert plan.how == "auto" and plan.block_types == (nn.TransformerEncoderLayer,)
    assert [n for n, _ in plan.blocks] == ["layers.0", "layers.1", "layers.2"]
    assert plan.block_params == 3 * num_params(layer) == num_params(m)


class Head(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.q, self.k = nn.Linear(d, d // 4), nn.Linear(d, d // 4)


class HeadsBlock(nn.Module):
    """Per-head modules inside each block hold a minority of the block: the block is the unit."""

    def __init__(self, d=16):
        super().__init__()
        self.heads = nn.ModuleList(Head(d) for _ in range(2))
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))


class Stage(nn.Module):
    def __init__(self, depth):
        super().__init__()
        self.downsample = nn.Linear(16, 16)
        self.layers = nn.ModuleList(HeadsBlock() for _ in range(depth))


class Staged(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.stages = nn.ModuleList([Stage(3), Stage(3)])


def test_stages_made_of_blocks_are_split_into_the_blocks_but_heads_are_not():
    plan = find_transformer_blocks(Staged())
    assert plan.block_types == (HeadsBlock,)
    assert [n for n, _ in plan.blocks] == [f"stages.{s}.layers.{i}" for s in range(2) for i in range(3)]


def test_block_types_as_classes_names_import_paths_or_predicate():
    m = GPT()
    expected = ["h.0", "h.1"]
    assert [n for n, _ in find_transformer_blocks(m, {GPTBlock}).blocks] == expected
    assert [n for n, _ in find_transformer_blocks(m, {"GPTBlock"}).blocks] == expected
    assert [n for n, _ in find_transformer_blocks(m, {"tests.models.GPTBlock"}).blocks] == expected
    plan = find_transformer_blocks(m, lambda mod: isinstance(mod, GPTBlock))
    assert [n for n, _ in plan.blocks] == expected and plan.how == "predicate"
    # matches inside a match are ignored: the outer module is the block
    outer = find_transformer_blocks(m, {GPTBlock, nn.Linear})
    assert [n for n, _ in outer.blocks][:2] == ["h.0", "h.1"]
    assert all(not n.startswith("h.0.") for n, _ in outer.blocks)


def test_block_types_naming_no_module_lists_the_classes_present():
    with pytest.raises(
        NoBlocksFoundError, match=r"block_types=\{GRU\} names no module in GPT; the classes present"
    ):
        find_transformer_blocks(GPT(), {nn.GRU})
    with pytest.raises(NoBlocksFoundError, match="GPTBlock"):
        find_transformer_blocks(GPT(), {"NoSuchBlock"})
    with pytest.raises(ValueError, match="cannot be imported"):
        find_transformer_blocks(GPT(), {"tests.models.NoSuchBlock"})


def test_blocks_holding_too_few_parameters_fall_back_to_size_groups_under_min_fraction():
    # blocks holding less than min_fraction of the parameters: the model is sharded in size-based groups
    m = GPT()
    plan = find_transformer_blocks(m, min_fraction=0.9)
    assert plan.how == "size" and plan.group_threshold == -(-num_params(m) // 8)
    assert "less than min_fraction=0.9" in plan.describe()
    names = [n for n, _ in plan.blocks]
    assert names and all(not a.startswith(b + ".") for a in names for b in names)  # never nested


def test_predicate_matching_nothing_is_still_refused():
    with pytest.raises(
        NoBlocksFoundError, match="the block_types predicate matched no submodule of PlainMLP"
    ):
        find_transformer_blocks(PlainMLP(), lambda mod: isinstance(mod, nn.GRU))


def test_plan_of_a_model_without_blocks_on_meta_says_size_based_groups():
    with torch.device("meta"):
        m = tanh_mlp()
    plan = plan_fsdp(m, world_size=2)
    assert plan.memory.total_bytes == 16 * num_params(m) / 2
    assert "no repeated blocks: 2 size-based groups of ~6,240 params (threshold 1,761)" in plan.summary()


def test_plan_without_a_trainer_on_a_meta_model():
    with torch.device("meta"):
        m = GPT()
    p = num_params(m)
    plan = plan_fsdp(m, world_size=4)
    assert plan.blocks.num_blocks == 2
    assert plan.memory.total_bytes == 16 * p / 4  # fp32 params + grads + AdamW state, sharded over 4
    text = plan.describe()
    assert "block classes GPTBlock" in text and "2 x GPTBlock (12,704 params each)" in text
    assert "world size 4" in text and "ZeRO-3" in text
    hybrid = plan_fsdp(m, world_size=4, shard_size=2, optimizer="sgd")
    assert hybrid.dims.data_parallel_replicate == 2 and hybrid.memory.total_bytes == 8 * p / 2


def test_activation_checkpointing_keeps_names_outputs_and_gradients():
    torch.manual_seed(0)
    a, b = GPT(), GPT()
    b.load_state_dict(a.state_dict())
    for block in b.h:
        apply_activation_checkpointing(block)
    assert list(a.state_dict()) == list(b.state_dict())
    x = torch.randint(0, 64, (2, 8))
    a(x).sum().backward()
    b(x).sum().backward()
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pb.grad, pa.grad, msg=n)


def test_a_module_list_reaching_the_threshold_is_grouped_by_its_members():
    # blocks holding less than half the parameters (4 layers, a 32k vocabulary): size-based groups; the layers'
    # ModuleList has no forward for fully_shard to hook (it refuses it), so its layers are the groups
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=1024, num_hidden_layers=4, num_attention_heads=8, intermediate_size=2816, vocab_size=32000
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    plan = find_transformer_blocks(model)
    assert plan.how == "size"
    assert [n for n, _ in plan.blocks] == [
        "model.embed_tokens",
        *(f"model.layers.{i}" for i in range(4)),
        "lm_head",
    ]
    layers = nn.ModuleList([nn.Linear(100, 100) for _ in range(3)])
    assert [n for n, _ in size_groups(nn.Sequential(layers), 20_000)] == ["0.0", "0.1", "0.2"]
