"""Launches shared by test files: a launch costs every rank's start-up (importing torch and Lightning), which
on a 2-core machine is several seconds per rank, so the layouts that need 4 or 8 ranks run their scenarios
from several files in one launch each. A scenario that raises ends its launch: every test that shares it
then fails with that rank's traceback (tests/harness.py)."""

from __future__ import annotations

import pytest

from tests.harness import LaunchResult, launch

# the callbacks' 2 x 2 (data_parallel x tensor_parallel) runs: 9 samples, one padding repeat on 2 data-parallel
# ranks, batches of 2 (tests/callbacks/test_tensor_parallel_meshes.py)
TENSOR_PARALLEL_METRICS_SAMPLES = 9


@pytest.fixture(scope="session")
def four_ranks(tmp_path_factory) -> LaunchResult:
    """4 ranks: ``tp_dp`` as data parallel 2 x tensor parallel 2 and its checkpoint
    (``tests.scenarios.tp``), ``pp_dp`` as pp2 x dp2 and its recipe (``tests.scenarios.pipeline``), and the
    callbacks under a 2 x 2 mesh (``tests.scenarios.callbacks_*``)."""
    return launch(
        [
            "tests.scenarios.tp:parity_dp2_tp2",
            "tests.scenarios.tp:checkpoint_resume",
            "tests.scenarios.pipeline:parity_pp2_dp2",
            "tests.scenarios.pipeline:recipe_gpt_pp",
            "tests.scenarios.callbacks_metrics:tensor_parallel_metrics",
            "tests.scenarios.callbacks_set_epoch:tensor_parallel_set_epoch",
        ],
        4,
        tmp_path_factory.mktemp("four"),
        args={
            "ckpt_dir": str(tmp_path_factory.mktemp("tp_checkpoints")),
            "n": TENSOR_PARALLEL_METRICS_SAMPLES,
            "batches": [2],
        },
        timeout=1500,
    )


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
