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
from lit_parallel.parallel.simulated import simulated_world
from lit_parallel.parallel.tensor_parallel import plan_from_spec
from lit_parallel.planner.memory import rank_state as formulas
from lit_parallel.strategies.dry_run import dry_run
from tests.moe_models import hand_moe, mixtral

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


def _rank0(strategy, devices, nodes, precision, kwargs):
    """Rank 0's state after ``strategy``'s dry run on the llama model."""
    run = dry_run(
        llama,
        strategy,
        devices=devices,
        num_nodes=nodes,
        precision=precision,
        strategy_kwargs=kwargs,
        ranks="first",
    )
    assert run.error is None, (strategy, kwargs, run.error)
    (rank0,) = run.ranks
    return rank0


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
        _check(_rank0(name, devices, nodes, precision, kwargs), formula, precision)
    # by hand, for fsdp_blocks: each parameter's rows padded to a multiple of the world, one share per rank
    hand = sum(
        math.ceil(p.shape[0] / world) * math.prod(p.shape[1:]) for p in dict.fromkeys(model.parameters())
    )
    fsdp = dry_run(llama, "fsdp_blocks", devices=devices, num_nodes=nodes, precision="32-true", ranks="first")
    assert fsdp.ranks[0].param_bytes == 4 * hand


@pytest.mark.parametrize("world", list(SHAPES))
def test_pipeline_stage_state_equals_the_formula(world):
    devices, nodes = SHAPES[world]
    model = llama()
    blocks = find_transformer_blocks(model, "auto")
    plan = plan_pipeline(model, blocks, pp_size=2, schedule="1F1B", microbatches=2)
    kwargs = {"pipeline_parallel_size": 2, "microbatches": 2}
    run = dry_run(
        llama,
        "pp_dp",
        devices=devices,
        num_nodes=nodes,
        precision="32-true",
        strategy_kwargs=kwargs,
        ranks="first",
    )
    assert run.error is None, run.error
    pieces = plan.stages[0].pieces
    _check(
        run.ranks[0],
        formulas.pipeline_state(model, pieces, data_parallel_shard=world // 2, precision="32-true"),
        "32-true",
    )


def hand_moe_on_meta() -> torch.nn.Module:
    with torch.device("meta"):
        return hand_moe()


@pytest.mark.parametrize("world", list(SHAPES))
@pytest.mark.parametrize("factory", [moe, hand_moe_on_meta], ids=["stacked_experts", "module_list_experts"])
def test_expert_parallel_state_equals_the_formula(world, factory):
    """expert_parallel_size=2 under fsdp_blocks, tp_dp (tensor parallel 2) and pp_dp (2 stages): experts split
    first, then sharded over the ranks holding the same ones; tp_dp and pp_dp from 8 ranks (2 x 2 x 2)."""
    devices, nodes = SHAPES[world]
    model = factory()
    blocks = find_transformer_blocks(model, "auto")
    runs = {"fsdp_blocks": {}}
    if world >= 8:
        runs["tp_dp"] = {"tensor_parallel_size": 2}
        runs["pp_dp"] = {"pipeline_parallel_size": 2, "microbatches": 2}
    for name, kwargs in runs.items():
        kwargs = {**kwargs, "expert_parallel_size": 2}
        run = dry_run(
            factory, name, devices=devices, num_nodes=nodes, precision="32-true", strategy_kwargs=kwargs
        )
        assert run.error is None, (name, run.error)
        shard = run.sizes["data_parallel_shard"]
        if name == "fsdp_blocks":
            formula = formulas.fsdp_state(
                model, [b for _, b in blocks.blocks], shard=shard, precision="32-true", expert_parallel=2
            )
        elif name == "tp_dp":
            plan = plan_from_spec(model, "auto", 2, block_types=blocks)
            formula = formulas.tensor_parallel_state(
                model, plan, data_parallel_shard=shard, precision="32-true", expert_parallel=2
            )
        else:
            layout = plan_pipeline(model, blocks, pp_size=2, schedule="1F1B", microbatches=2)
            formula = max(
                (
                    formulas.pipeline_state(
                        model, s.pieces, data_parallel_shard=shard, precision="32-true", expert_parallel=2
                    )
                    for s in layout.stages
                ),
                key=lambda f: f.state_bytes,
            )
        _check(run.largest, formula, "32-true")


@pytest.mark.parametrize(
    ("factory", "strategy", "kwargs", "nodes", "says"),
    [
        # the mesh does not multiply to the world size
        (
            llama,
            "tp_dp",
            {"tensor_parallel_size": 3},
            1,
            ["tensor_parallel_size(3)", "choose sizes whose product divides 8"],
        ),
        # tensor parallelism splitting heads unevenly (4 query heads, 2 key/value heads)
        (
            llama,
            "tp_dp",
            {"tensor_parallel_size": 8},
            64,
            ["tensor_parallel_size=8 cannot split", "Choose tensor_parallel_size from 1 or 2"],
        ),
        # more pipeline stages than blocks
        (llama, "pp_dp", {"pipeline_parallel_size": 8, "microbatches": 8}, 64, ["4 blocks", "at most 4"]),
        (
            llama,
            "pp_dp",
            {"pipeline_parallel_size": 4, "schedule": "Interleaved1F1B", "microbatches": 8},
            64,
            ["makes 8 stages", "at most 2", "one stage per rank"],
        ),
        # expert parallelism over a size that does not divide the data-parallel ranks
        (
            moe,
            "fsdp_blocks",
            {"expert_parallel_size": 3},
            64,
            ["expert_parallel=3 does not divide", "choose 1, 2, 4"],
        ),
        (
            llama,
            "fsdp_blocks",
            {"block_types": {"NoSuchBlock"}},
            8,
            ["names no module", "block_types='auto'"],
        ),
    ],
)
def test_setup_errors_at_scale_are_reported_with_their_fix(factory, strategy, kwargs, nodes, says):
    run = dry_run(factory, strategy, devices=8, num_nodes=nodes, strategy_kwargs=kwargs, ranks="first")
    assert run.error is not None and run.ranks == []
    for words in says:
        assert words in run.error, run.error


def test_every_distinct_position_is_dry_run_and_the_last_rank_holds_the_short_shards():
    # pp_dp over 64 ranks: 2 stages x 32 data-parallel ranks: the first and last rank of each stage
    run = dry_run(
        llama,
        "pp_dp",
        devices=8,
        num_nodes=8,
        precision="32-true",
        strategy_kwargs={"pipeline_parallel_size": 2, "microbatches": 2},
    )
    assert run.error is None, run.error
    assert [
        (r.rank, r.coordinates["pipeline_parallel"], r.coordinates["data_parallel"]) for r in run.ranks
    ] == [
        (0, 0, 0),
        (31, 0, 31),
        (32, 1, 0),
        (63, 1, 31),
    ]
    first, last = run.ranks[0], run.ranks[1]
    # the same padded storage on every rank of a stage; AdamW's state follows each rank's own rows: by hand, the
    # last of 32 ranks holds rows - 31 * ceil(rows / 32) of each parameter (none when the others took them all)
    assert first.param_bytes == last.param_bytes
    model = llama()
    names = {p.name for p in first.parameters}
    params = {n.removeprefix(""): p for n, p in model.named_parameters() if n in names}

    def rows_of(rank: int, rows: int) -> int:
        per = math.ceil(rows / 32)
        return max(0, min(per, rows - rank * per))

    for rank, state in ((0, first), (31, last)):
        hand = sum(2 * 4 * rows_of(rank, p.shape[0]) * math.prod(p.shape[1:]) for p in params.values())
        assert state.optimizer_bytes == hand, rank
    assert (
        last.padding_elements
        == sum(
            32 * 0
            + math.ceil(p.shape[0] / 32) * math.prod(p.shape[1:])
            - rows_of(31, p.shape[0]) * math.prod(p.shape[1:])
            for p in params.values()
        )
        > 0
    )


def test_nothing_is_materialised_and_tensor_parallel_reports_what_it_split():
    run = dry_run(
        llama, "tp_dp", devices=8, num_nodes=512, strategy_kwargs={"tensor_parallel_size": 2}, ranks=[4095]
    )
    assert run.error is None, run.error
    (state,) = run.ranks
    assert state.rank == 4095 and state.coordinates == {"data_parallel": 2047, "tensor_parallel": 1}
    split, replicated = state.split_and_replicated("tensor_parallel")
    # the projections of every block are split; embeddings, norms and the head are replicated
    assert sorted({n.split(".")[-2] for n in split}) == [
        "down_proj",
        "gate_proj",
        "k_proj",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]
    assert set(replicated) == {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} | {
        f"model.layers.{i}.{norm}.weight"
        for i in range(4)
        for norm in ("input_layernorm", "post_attention_layernorm")
    }


def test_a_simulated_world_keeps_the_model_on_meta_and_refuses_a_real_group(tmp_path):
    from lit_parallel.parallel import ParallelDims, ParallelizeConfig, parallelize

    model = llama()
    with simulated_world(4096, 17):
        assert dist.get_world_size() == 4096 and dist.get_rank() == 17
        dims = ParallelDims.for_fsdp(4096)
        dims.build_mesh("cpu")
        parallelize(model, dims, ParallelizeConfig())
        with pytest.raises(RuntimeError, match="a process group already exists"):
            with simulated_world(2):
                pass
    assert all(p.is_meta for p in model.parameters())
    for bad, says in (
        ({"world_size": 0}, "world_size=0"),
        ({"world_size": 4, "rank": 4}, "rank=4 must be one of"),
    ):
        with pytest.raises(ValueError, match=says):
            with simulated_world(**bad):
                pass


@pytest.mark.parametrize("world", list(SHAPES))
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_the_advise_table_equals_the_dry_run_of_each_strategy(world, precision):
    """``advise --model``'s memory table: each row is the state the strategy's dry run leaves on the rank holding
    the most (tensor parallelism over the devices of a node, 2 here: the model's 2 key/value heads)."""
    from lit_parallel.planner.rules import advise

    devices, nodes = 2, world // 2
    advice = advise(
        model=llama(), devices=devices, nodes=nodes, memory_gb=80, precision=precision, device_type="cuda"
    )
    runs = {
        "DDP": ("ddp_tuned", {}),
        "ZeRO-2": ("fsdp_blocks", {"reshard_after_forward": False}),
        "FSDP/ZeRO-3": ("fsdp_blocks", {}),
        "HSDP": ("hsdp", {}),
        "TP+DP": ("tp_dp", {"tensor_parallel_size": devices}),
    }
    gathered = sum(p.numel() for p in llama().parameters()) * (4 if precision == "32-true" else 2)
    for row, (name, kwargs) in runs.items():
        rank0 = _rank0(name, devices, nodes, precision, kwargs)
        table = advice.row(row)
        # ZeRO-2's row also counts every parameter gathered from forward to backward (not stored state)
        extra = gathered if row == "ZeRO-2" else 0
        assert table.state_bytes - extra == rank0.state_bytes, row
        if precision == "32-true":
            assert (table.param_bytes - extra, table.grad_bytes, table.optimizer_bytes) == (
                rank0.param_bytes,
                rank0.grad_bytes,
                rank0.optimizer_bytes,
            ), row


def test_the_ranks_asked_for_are_dry_run_each_once_in_order():
    run = dry_run(llama, "ddp_tuned", devices=8, num_nodes=8, ranks=[5, 63, 5], precision="32-true")
    assert [r.rank for r in run.ranks] == [5, 63]
    assert run.ranks[0].state_bytes == run.ranks[1].state_bytes  # replicas
    run = dry_run(llama, "hsdp", devices=8, num_nodes=8, ranks=[9])
    assert [(r.rank, r.coordinates) for r in run.ranks] == [
        (9, {"data_parallel_replicate": 1, "data_parallel_shard": 1, "tensor_parallel": 0})
    ]
    with pytest.raises(ValueError, match=r"ranks=\[64\] must be global ranks of the world, 0 to 63"):
        dry_run(llama, "ddp_tuned", devices=8, num_nodes=8, ranks=[64])
    with pytest.raises(ValueError, match="strategy='fsdp' is not one a dry run knows"):
        dry_run(llama, "fsdp", devices=8)
