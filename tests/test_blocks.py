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
from tests.models import GPT, GPTBlock, Llama, LlamaBlock, PlainMLP, Seq2Seq, ViT, ViTBlock, num_params


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


def test_model_without_repeated_blocks_raises_saying_what_was_searched_and_how_to_fix():
    with pytest.raises(NoBlocksFoundError) as err:
        find_transformer_blocks(PlainMLP())
    msg = str(err.value)
    assert "PlainMLP" in msg and "nn.ModuleList / nn.Sequential / nn.ModuleDict" in msg
    assert "block_types={MyBlock}" in msg


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


def test_blocks_holding_too_few_parameters_are_refused_under_min_fraction():
    with pytest.raises(NoBlocksFoundError, match="less than min_fraction=0.9"):
        find_transformer_blocks(GPT(), min_fraction=0.9)


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
