"""Pipeline plans, schedules and sizes without a process group: the stage split, the checks that refuse a
configuration before anything starts, and the ParallelDims layout."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import lit_parallel as lp
from lit_parallel._compat import TorchDispatchMode, storage_key, tree_flatten
from lit_parallel.parallel.blocks import find_transformer_blocks
from lit_parallel.parallel.mesh import PP, ParallelDims
from lit_parallel.parallel.pipeline.plan import (
    SCHEDULES,
    balanced_split,
    bubble_fraction,
    check_schedule,
    micro_batches_for,
    plan_pipeline,
    stage_to_rank,
)
from tests.models import GPT, GPTBlock, GPTConfig


def _brute_force(weights: list[int], parts: int) -> int:
    best = None
    for cuts in itertools.combinations(range(1, len(weights)), parts - 1):
        bounds = [0, *cuts, len(weights)]
        heaviest = max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = heaviest if best is None else min(best, heaviest)
    return best


@pytest.mark.parametrize(
    "weights, parts",
    [([5, 1, 1, 1, 1, 5], 2), ([3, 3, 3, 3], 4), ([10, 1, 1, 1, 1, 1, 1, 10], 3), ([1, 2, 3, 4, 5, 6, 7], 3)],
)
def test_balanced_split_minimises_the_heaviest_stage(weights, parts):
    starts = balanced_split(weights, parts)
    bounds = [*starts, len(weights)]
    assert starts[0] == 0 and len(starts) == parts and all(a < b for a, b in zip(bounds, bounds[1:]))
    assert max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:])) == _brute_force(weights, parts)


def test_auto_split_puts_embeddings_first_head_last_and_balances_parameters():
    model = GPT(GPTConfig(n_layer=4))
    plan = plan_pipeline(model, find_transformer_blocks(model), pp_size=2, schedule="1F1B", microbatches=4)
    first, last = plan.stages
    assert first.prefix == ["wte", "wpe"] and first.blocks == ["h.0", "h.1"] and first.suffix == []
    assert last.blocks == ["h.2", "h.3"] and last.suffix == ["ln_f", "lm_head"]
    total = sum(p.numel() for p in model.parameters())
    assert first.params + last.params == total
    block = sum(p.numel() for p in model.h[0].parameters())
    assert first.params == 2 * block + model.wte.weight.numel() + model.wpe.weight.numel()


def test_interleaved_schedules_get_two_stages_per_rank_looped_or_v_shaped():
    model = GPT(GPTConfig(n_layer=8))
    blocks = find_transformer_blocks(model)
    looped = plan_pipeline(model, blocks, pp_size=2, schedule="Interleaved1F1B", microbatches=4)
    assert [s.rank for s in looped.stages] == [0, 1, 0, 1]
    v = plan_pipeline(model, blocks, pp_size=2, schedule="ZBVZeroBubble", microbatches=4)
    assert [s.rank for s in v.stages] == [0, 1, 1, 0]
    assert stage_to_rank(6, 3, "v") == {0: 0, 1: 1, 2: 2, 3: 2, 4: 1, 5: 0}


def test_split_by_names_overrides_and_wrong_names_are_refused():
    model = GPT(GPTConfig(n_layer=4))
    blocks = find_transformer_blocks(model)
    plan = plan_pipeline(model, blocks, pp_size=2, schedule="GPipe", microbatches=2, split=["h.3"])
    assert [s.blocks for s in plan.stages] == [["h.0", "h.1", "h.2"], ["h.3"]]
    with pytest.raises(ValueError, match=r"'h\.9', which is not a block; stages start at blocks: h\.0"):
        plan_pipeline(model, blocks, pp_size=2, schedule="GPipe", microbatches=2, split=["h.9"])
    with pytest.raises(ValueError, match="names 2 stage starts; 2 stages need 1"):
        plan_pipeline(model, blocks, pp_size=2, schedule="GPipe", microbatches=2, split=["h.1", "h.2"])


def test_tied_weights_across_stages_are_refused():
    model = GPT(GPTConfig(n_layer=2))
    model.lm_head.weight = model.wte.weight
    with pytest.raises(ValueError, match="tied weights cannot be split across pipeline stages"):
        plan_pipeline(model, find_transformer_blocks(model), pp_size=2, schedule="GPipe", microbatches=2)


def test_more_stages_than_blocks_is_refused():
    model = GPT(GPTConfig(n_layer=2))
    blocks = find_transformer_blocks(model)
    # the value, the rule and the fix: the largest size that gives every stage a block, or one stage per rank
    with pytest.raises(
        ValueError, match=r"makes 4 stages, but the model has 2 blocks.*at most 1 or a schedule with one"
    ):
        plan_pipeline(model, blocks, pp_size=2, schedule="LoopedBFS", microbatches=2)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=3 .* 3 stages, .* at most 2$"):
        plan_pipeline(model, blocks, pp_size=3, schedule="1F1B", microbatches=3)


def test_plan_table_is_one_short_table():
    model = GPT(GPTConfig(n_layer=4))
    table = plan_pipeline(
        model, find_transformer_blocks(model), pp_size=2, schedule="GPipe", microbatches=8
    ).table()
    lines = table.splitlines()
    assert len(lines) == 4 and "bubble (P-1)/(M+P-1) = 11%" in lines[0]  # 1 / 9


@pytest.mark.parametrize(
    "schedule, pp, m, dp, message",
    [
        ("Zero", 2, 4, 1, "is not a pipeline schedule; choose one of GPipe, 1F1B"),
        ("1F1B", 4, 2, 1, "microbatches=2 < pipeline_parallel_size=4"),
        ("DualPipeV", 2, 2, 1, "needs microbatches >= the number of stages"),
        ("Interleaved1F1B", 2, 5, 1, "must be a multiple of"),
        ("ZBVZeroBubble", 2, 4, 2, "zero-bubble schedules compute weight gradients"),
    ],
)
def test_schedule_refusals_name_the_value_and_the_fix(schedule, pp, m, dp, message):
    with pytest.raises(ValueError, match=message):
        check_schedule(schedule, pp, m, dp)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("pp, m", [(2, 4), (2, 8), (4, 4), (4, 12)])
def test_a_batch_microbatches_does_not_divide_runs_as_fewer_equal_micro_batches(schedule, pp, m):
    try:
        check_schedule(schedule, pp, m)
    except ValueError:
        return  # a configuration the strategy refuses when built
    for batch in range(1, 3 * m + 1):
        name, count = micro_batches_for(schedule, pp, m, batch)
        divisors = [d for d in range(1, m + 1) if batch % d == 0]
        assert count == max(divisors), f"batch {batch}: {count} micro-batches"
        # the configured schedule whenever it accepts the count, else one with the same stage layout
        accepted = True
        try:
            check_schedule(schedule, pp, count)
        except ValueError:
            accepted = False
        assert (name == schedule) == accepted, f"batch {batch}: {name}"
        assert SCHEDULES[name][1:] == SCHEDULES[schedule][1:]
        check_schedule(name, pp, count)


def test_a_full_batch_keeps_the_configured_schedule_and_micro_batches():
    assert micro_batches_for("1F1B", 2, 4, 8) == ("1F1B", 4)
    assert micro_batches_for("1F1B", 2, 4, 11) == ("GPipe", 1)  # 11 is prime; 1F1B needs 2 at pp2
    assert micro_batches_for("1F1B", 2, 4, 6) == ("1F1B", 3)
    with pytest.raises(ValueError, match="a batch of 0 samples"):
        micro_batches_for("1F1B", 2, 4, 0)


def test_every_schedule_of_torch_is_known():
    import torch.distributed.pipelining as pipelining

    assert all(hasattr(pipelining, cls) for cls, _, _ in SCHEDULES.values())
    assert bubble_fraction(4, 12) == pytest.approx(3 / 15)


def test_parallel_dims_for_pipeline_put_the_pipeline_dimension_outermost():
    dims = ParallelDims.for_pipeline(world_size=8, pipeline_parallel=2, tensor_parallel=2)
    assert dims.data_parallel == 2 and dims.mesh_dim_names == (PP, "data_parallel", "tensor_parallel")
    hsdp = ParallelDims.for_pipeline(world_size=8, pipeline_parallel=2, data_parallel_replicate=2)
    assert hsdp.mesh_dim_names[0] == PP and hsdp.data_parallel_shard == 2
    one = ParallelDims.for_pipeline(world_size=2, pipeline_parallel=1)
    assert one.mesh_dim_names[0] == PP  # pp_dp keeps the dimension (size 1) so lookups by name work
    with pytest.raises(
        ValueError, match=r"pipeline_parallel_size\(3\) \* tensor_parallel_size\(1\) = 3 does not"
    ):
        ParallelDims.for_pipeline(world_size=4, pipeline_parallel=3)
    with pytest.raises(ValueError, match=r"= 8 != world size 4"):
        ParallelDims.for_pipeline(world_size=4, pipeline_parallel=2, data_parallel=4)


def test_strategy_arguments_are_checked_when_built():
    with pytest.raises(ValueError, match="pipeline_parallel_size=0 must be a positive integer"):
        lp.PipelineParallelStrategy(pipeline_parallel_size=0)
    with pytest.raises(ValueError, match="split='even' must be 'auto' or a list of block names"):
        lp.PipelineParallelStrategy(split="even")
    with pytest.raises(ValueError, match="microbatches=1 < pipeline_parallel_size=2"):
        lp.PipelineParallelStrategy(microbatches=1)
    s = lp.PipelineParallelStrategy(pipeline_parallel_size=2, schedule="GPipe", microbatches=1, split=["h.1"])
    assert s.strategy_name == "pp_dp"


def test_registered_as_pp_dp():
    from lightning.pytorch.strategies import StrategyRegistry

    assert StrategyRegistry["pp_dp"]["strategy"] is lp.PipelineParallelStrategy


def test_parameters_sitting_on_the_root_module_are_refused():
    class WithToken(nn.Module):
        def __init__(self):
            super().__init__()
            self.cls_token = nn.Parameter(torch.zeros(4))
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)) for _ in range(2))

    model = WithToken()
    with pytest.raises(ValueError, match=r"parameters \['cls_token'\] sit directly on the root module"):
        plan_pipeline(model, find_transformer_blocks(model), pp_size=2, schedule="GPipe", microbatches=2)


def test_pipeline_rule_holds_only_when_the_model_fits_cut_into_stages_across_nodes():
    from lit_parallel.planner.rules import advise, pipeline_check, pipeline_plan_for

    # bf16-mixed Adam: 16 bytes per parameter; sharded over one node's 8 devices: 2 bytes x params per rank
    big = advise(params=70e9, devices=8, nodes=4, memory_gb=80, precision="bf16-mixed")
    holds, why = pipeline_check(big)
    assert holds is True  # 140 GB per rank inside a node; 2 stages of 2 nodes: 70 GB <= 80 GB
    assert "pipeline_parallel_size=2" in why and "microbatches=8" in why and "= 11%" in why  # 1 / 9
    assert pipeline_plan_for(140e9, 0.0, 80e9, 4) == 2 and pipeline_plan_for(140e9, 0.0, 30e9, 4) is None
    assert pipeline_check(advise(params=7e9, devices=8, nodes=4, memory_gb=80))[0] is False  # 14 GB fits
    assert pipeline_check(advise(params=70e9, devices=8, nodes=1, memory_gb=80))[0] is False  # one node
    # 350 GB per stage
    assert pipeline_check(advise(params=700e9, devices=8, nodes=4, memory_gb=80))[0] is False


def test_a_first_stage_stops_after_its_last_block_when_later_blocks_change_the_shape():
    """A ResNet's later stages widen the channels; the first pipeline stage ends the model's forward at its
    last block (nothing after it, not the head nor the later blocks, runs there), and the second stage's
    skip of the stem works out its output's shape on meta once per input shape."""
    import copy

    from lit_parallel.parallel.pipeline.stage import _Skip, build_stage_modules

    class Widen(nn.Module):
        def __init__(self, cin: int, cout: int) -> None:
            super().__init__()
            self.conv = nn.Conv2d(cin, cout, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.conv(x))

    class ResNetLike(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Conv2d(1, 8, 3, padding=1)
            self.stages = nn.Sequential(Widen(8, 8), Widen(8, 16), Widen(16, 32))
            self.head = nn.Linear(32, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            pooled = nn.functional.adaptive_avg_pool2d(self.stages(self.stem(x)), 1)
            return self.head(torch.flatten(pooled, 1))

    torch.manual_seed(0)
    model = ResNetLike()  # blocks 8 -> 16 -> 32 channels, head Linear(32, 10)
    reference = copy.deepcopy(model)
    plan = plan_pipeline(model, find_transformer_blocks(model), pp_size=2, schedule="1F1B", microbatches=2)
    first, second = plan.stages
    assert first.blocks[-1] != "stages.2"  # the last block (and the head) belong to the second stage
    stage = build_stage_modules(model, plan, pp_rank=0)[0]
    stage.register_hooks()
    ran_after: list[str] = []
    for name, (_, _, _, skip) in stage._others.items():
        skip.register_forward_pre_hook(lambda m, a, name=name: ran_after.append(name))
    x = torch.randn(4, 1, 8, 8)
    activation, inputs = stage(x)
    # the activation is the first stage's last block's output, computed on the unpruned copy
    h = reference.stem(x)
    for name in first.blocks:
        h = reference.get_submodule(name)(h)
    assert torch.equal(activation, h) and torch.equal(inputs, x)
    stage(torch.randn(2, 1, 8, 8))
    assert ran_after == []  # neither the head's skip nor anything after the stage's blocks ran
    # the second stage: the stem is another stage's, its skip computes its output's shape once per shape
    later = build_stage_modules(copy.deepcopy(reference), plan, pp_rank=1)[0]
    later.register_hooks()
    skip = later._others["stem"][3]
    assert isinstance(skip, _Skip)
    calls: list[str] = []
    skip._meta.register_forward_hook(lambda m, a, o: calls.append("stem"))
    out = later(activation, x)
    assert calls == ["stem"] and out.shape == (4, 10)
    later(torch.randn_like(activation), torch.randn(4, 1, 8, 8))
    assert calls == ["stem"]
    later(torch.randn(2, *activation.shape[1:]), torch.randn(2, 1, 8, 8))  # a new micro-batch shape
    assert calls == ["stem", "stem"]


class AllocatedBytes(TorchDispatchMode):
    """Bytes of every new storage an op returns (views of an input's storage are not new), and the largest."""

    def __init__(self) -> None:
        super().__init__()
        self.total = self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # keys of storages live now (a freed storage's key may be reused later, so none is kept across ops)
        seen = {storage_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and storage_key(t) not in seen:
                seen.add(storage_key(t))
                self.total += t.untyped_storage().nbytes()
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def test_a_stage_without_the_head_allocates_no_logits_per_micro_batch():
    """Per micro-batch, a stage before the last allocates exactly what the model's own forward allocates up
    to that stage's last block (counted by a dispatch mode over every op's new storages): nothing for the
    final norm or the head, so not the ``micro-batch x sequence x vocabulary`` logits."""
    from lit_parallel.parallel.pipeline.stage import build_stage_modules

    cfg = GPTConfig(vocab_size=512, n_layer=4, block_size=8, n_embd=16)
    torch.manual_seed(0)
    model = GPT(cfg)
    blocks = find_transformer_blocks(model, {GPTBlock})
    plan = plan_pipeline(model, blocks, pp_size=2, schedule="1F1B", microbatches=2)
    blocks = plan.stages[0].blocks
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    # the model's own forward (tests/models.py GPT) up to the first stage's last block, on the same weights
    with torch.no_grad(), AllocatedBytes() as expected:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = model.wte(idx) + model.wpe(pos)
        for name in blocks:
            x = model.get_submodule(name)(x)
    stage = build_stage_modules(model, plan, pp_rank=0)[0]
    stage.register_hooks()
    stage(idx)  # the first call works nothing out that later ones reuse, but run one anyway
    with torch.no_grad(), AllocatedBytes() as counted:
        activation, _ = stage(idx)
    assert torch.equal(activation, x)
    logits = 2 * cfg.block_size * cfg.vocab_size * 4
    assert counted.total == expected.total, (counted.total, expected.total, logits)
    assert counted.largest < logits
