"""Dry runs (lit_parallel.strategies.dry_run) on simulated worlds of 2 to 4096 ranks, in this process.

The per-rank state the strategies' real setup leaves (placements and local shapes of every parameter) is
checked against the planner's formulas (lit_parallel.planner.memory.rank_state), and both against a count
written here by hand from the model's shapes for the simplest cases.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from lit_parallel.parallel.blocks import find_transformer_blocks
from lit_parallel.parallel.pipeline.plan import plan_pipeline
from lit_parallel.parallel.tensor_parallel import plan_from_spec
from lit_parallel.planner.memory import rank_state as formulas
from lit_parallel.strategies.dry_run import dry_run
from tests.moe_models import mixtral

# world size -> (devices per node, nodes)
SHAPES = {2: (2, 1), 8: (8, 1), 64: (8, 8), 512: (8, 64), 4096: (8, 512)}


def llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=250,  # not a multiple of most world sizes: uneven shards, padded
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def moe() -> torch.nn.Module:
    with torch.device("meta"):
        return mixtral(experts=4)


@pytest.fixture(autouse=True)
def _no_process_group():
    yield
    assert not dist.is_initialized()  # every dry run destroys the world it simulated


def _check(real, formula, precision):
    if precision == "32-true":  # the stored dtypes are ZeRO's accounting: category by category
        assert (real.param_bytes, real.grad_bytes, real.optimizer_bytes) == (
            formula.param_bytes,
            formula.grad_bytes,
            formula.optimizer_bytes,
        )
    # mixed precision stores fp32 parameters and gradients (4 + 4 + 8 bytes) where ZeRO counts 2 + 2 + 12
    assert real.state_bytes == formula.state_bytes


@pytest.mark.parametrize("world", list(SHAPES))
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_sharded_state_equals_the_formulas_at_every_world_size(world, precision):
    devices, nodes = SHAPES[world]
    model = llama()
    blocks = [b for _, b in find_transformer_blocks(model, "auto").blocks]
    runs = {
        "fsdp_blocks": ({}, formulas.fsdp_state(model, blocks, shard=world, precision=precision)),
        "hsdp": ({}, formulas.fsdp_state(model, blocks, shard=devices, precision=precision)),
        "ddp_tuned": ({}, formulas.ddp_state(model, precision=precision)),
        "tp_dp": (
            {"tensor_parallel_size": 2},
            formulas.tensor_parallel_state(
                model,
                plan_from_spec(model, "auto", 2, block_types="auto"),
                data_parallel_shard=world // 2,
                precision=precision,
            ),
        ),
    }
    for name, (kwargs, formula) in runs.items():
        run = dry_run(llama, name, devices=devices, num_nodes=nodes, precision=precision, strategy_kwargs=kwargs, ranks="first")
        assert run.error is None, (name, run.error)
        (rank0,) = run.ranks
        _check(rank0, formula, precision)
    # by hand, for fsdp_blocks: each parameter's rows padded to a multiple of the world, one share per rank
    hand = sum(math.ceil(p.shape[0] / world) * math.prod(p.shape[1:]) for p in dict.fromkeys(model.parameters()))
    fsdp = dry_run(llama, "fsdp_blocks", devices=devices, num_nodes=nodes, precision="32-true", ranks="first")
    assert fsdp.ranks[0].param_bytes == 4 * hand


@pytest.mark.parametrize("world", list(SHAPES))
def test_pipeline_stage_state_equals_the_formula(world):
    devices, nodes = SHAPES[world]
    model = llama()
    blocks = find_transformer_blocks(model, "auto")
    plan = plan_pipeline(model, blocks, pp_size=2, schedule="1F1B", microbatches=2)
    kwargs = {"pipeline_parallel_size": 2, "microbatches": 2}
    run = dry_run(llama, "pp_dp", devices=devices, num_nodes=nodes, precision="32-true", strategy_kwargs=kwargs, ranks="first")
    assert run.error is None, run.error
    pieces = plan.stages[0].pieces
    _check(run.ranks[0], formulas.pipeline_state(model, pieces, data_parallel_shard=world // 2, precision="32-true"), "32-true")


@pytest.mark.parametrize("world", [8, 64, 512, 4096])
def test_expert_parallel_state_equals_the_formula(world):
    devices, nodes = SHAPES[world]
    model = moe()
    blocks = [b for _, b in find_transformer_blocks(model, "auto").blocks]
    formula = formulas.fsdp_state(model, blocks, shard=world, precision="32-true", expert_parallel=2)
    run = dry_run(moe, "fsdp_blocks", devices=devices, num_nodes=nodes, precision="32-true", strategy_kwargs={"expert_parallel_size": 2}, ranks="first")
    assert run.error is None, run.error
    _check(run.ranks[0], formula, "32-true")
