"""What an older torch (2.11, 2.12) makes the strategies do, forced on any torch through
``lit_parallel._compat``: the runs (tests/scenarios/compat.py) share the Lightning-launcher launch."""

from __future__ import annotations

import pytest

from tests.strategies.test_pipeline import _assert_parity, _reference


@pytest.mark.multiprocess
@pytest.mark.timeout(360)
def test_forward_sync_buffers_without_the_ddp_argument_syncs_rank_zeros_buffers_only_when_asked(
    lightning_launcher_two_ranks,
):
    # each rank sets the buffer to its rank + 1 before each batch: with the sync, forward sees rank 0's (1)
    for rank, out in enumerate(lightning_launcher_two_ranks.scenario("forward_sync_buffers")):
        assert out["True"] == [1.0, 1.0], f"rank {rank}"
        assert out["False"] == [rank + 1.0] * 2, f"rank {rank}"
        assert out["messages"] == []  # the same behaviour: nothing lost, nothing said


@pytest.mark.multiprocess
@pytest.mark.timeout(360)
def test_pp_dp_with_integer_inputs_and_validation_first_trains_like_one_process(lightning_launcher_two_ranks):
    per_rank = lightning_launcher_two_ranks.scenario("pipeline")
    _assert_parity(per_rank, _reference(dp=1), "pp2 1F1B as on torch 2.11")
    # training and evaluation got a pipeline each (one batch shape)
    assert [out["pipelines"] for out in per_rank] == [2, 2]
    lines = per_rank[0]["messages"]
    assert len(lines) == 2 and all("(torch 2.1" in line for line in lines), lines
    assert per_rank[1]["messages"] == []  # rank 0 says it
