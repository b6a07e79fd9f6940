"""expert_parallel_size / expert_capacity_factor on the strategies: checked when the strategy is built, and
against the model before any process group (no ranks needed)."""

from __future__ import annotations

import pytest

import lit_parallel as lp


@pytest.mark.parametrize(
    "cls", [lp.TransformerFSDPStrategy, lp.TensorParallelStrategy, lp.PipelineParallelStrategy]
)
@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2"])
def test_a_bad_expert_parallel_size_is_refused(cls, bad):
    with pytest.raises(ValueError, match=rf"expert_parallel_size={bad!r} must be a positive integer"):
        cls(expert_parallel_size=bad)


@pytest.mark.parametrize("bad", [0, -1, True, "1.2"])
def test_a_bad_capacity_factor_is_refused(bad):
    with pytest.raises(ValueError, match=rf"expert_capacity_factor={bad!r} must be None"):
        lp.TransformerFSDPStrategy(expert_capacity_factor=bad)


def test_hsdp_refuses_expert_parallelism():
    with pytest.raises(ValueError, match="does not combine with replication across nodes"):
        lp.HybridShardStrategy(expert_parallel_size=2)


def test_a_dense_model_with_expert_parallelism_is_refused_before_any_process_group():
    from tests.scenarios.tp import LitLM

    strategy = lp.TransformerFSDPStrategy(expert_parallel_size=2)
    strategy._dims = None
    with pytest.raises(ValueError, match="has no MoE layer"):
        strategy._check_blocks(LitLM("gpt"))
