"""Launches shared by the strategy tests: a launch costs every rank's start-up, most of all with 8 ranks on
a 2-core machine, so the 3-D layouts of ``tp_dp`` and ``pp_dp`` run in one launch."""

from __future__ import annotations

import pytest

from tests.harness import LaunchResult, launch


@pytest.fixture(scope="session")
def eight_ranks(tmp_path_factory) -> LaunchResult:
    """Two torchrun agents on loopback ("nodes") of 4 ranks each: ``tp_dp`` as replicate 2 x shard 2 x tensor
    parallel 2 (``tests.scenarios.tp:parity_3d``) and ``pp_dp`` as pp2 x dp2 x tp2
    (``tests.scenarios.pipeline:parity_pp2_dp2_tp2``)."""
    return launch(
        ["tests.scenarios.tp:parity_3d", "tests.scenarios.pipeline:parity_pp2_dp2_tp2"],
        4,
        tmp_path_factory.mktemp("eight"),
        nnodes=2,
        timeout=1500,
    )
