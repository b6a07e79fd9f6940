"""The multi-process harness: results per rank, prompt failure, every rank's traceback."""

from __future__ import annotations

import time

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


# the collective timeout of the harness's process group (tests/_worker.py's LP_PG_TIMEOUT), given explicitly
PG_TIMEOUT_S = 120


@pytest.mark.timeout(120)
def test_failing_rank_stops_all_ranks_promptly_and_is_named(tmp_path):
    res = launch(
        ["tests.scenarios.harness_checks:allreduce_rank", "tests.scenarios.harness_checks:rank1_raises"],
        2,
        tmp_path,
        timeout=90,
        env={"LP_PG_TIMEOUT": str(PG_TIMEOUT_S)},
        expect_failure=True,
    )
    ended = time.time()
    assert res.failed and res.returncode != 0 and not res.timed_out
    # rank 0 sits in an all_reduce that would wait PG_TIMEOUT_S; the launcher must end it long before.
    # Counted from rank 1's failure (its own time stamp), not from the launch's start-up.
    failed = res.error_times[1]
    assert 0 < ended - failed < PG_TIMEOUT_S / 4, (
        f"every rank stopped {ended - failed:.1f}s after the failure"
    )
    assert res.first_failed_rank == 1
    msg = res.describe_failure()
    assert "first failing rank: 1" in msg
    assert "----- rank 1 traceback -----" in msg
    assert "ValueError: scenario failure injected on rank 1" in msg
