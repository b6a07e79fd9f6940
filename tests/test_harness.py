"""The multi-process harness: results per rank, prompt failure, every rank's traceback."""

from __future__ import annotations

import pytest

from tests.harness import launch

pytestmark = pytest.mark.multiprocess


@pytest.mark.timeout(120)
def test_torchrun_collects_every_rank(tmp_path):
    res = launch("tests.scenarios.harness_checks:allreduce_rank", 3, tmp_path)
    out = res.scenario("allreduce_rank")
    assert [r["rank"] for r in out] == [0, 1, 2]
    # each rank contributes its rank: 0 + 1 + 2
    assert all(r["sum"] == 3.0 and r["world"] == 3 for r in out)


@pytest.mark.timeout(120)
def test_failing_rank_stops_all_ranks_promptly_and_is_named(tmp_path):
    res = launch(
        ["tests.scenarios.harness_checks:allreduce_rank", "tests.scenarios.harness_checks:rank1_raises"],
        2,
        tmp_path,
        timeout=90,
        expect_failure=True,
    )
    assert res.failed and res.returncode != 0 and not res.timed_out
    # rank 0 sits in an all_reduce with a 120 s gloo timeout; the launcher must end it long before.
    assert res.wall_s < 30, f"failure took {res.wall_s:.1f}s to stop every rank"
    assert res.first_failed_rank == 1
    msg = res.describe_failure()
    assert "first failing rank: 1" in msg
    assert "----- rank 1 traceback -----" in msg
    assert "ValueError: scenario failure injected on rank 1" in msg
