"""Launches shared by test files: a launch costs every rank's start-up (importing torch and Lightning), which
on a 2-core machine is several seconds per rank, so the layouts that need 4 or 8 ranks run their scenarios
from several files in one launch each. A scenario that raises ends its launch: every test that shares it
then fails with that rank's traceback (tests/harness.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness import LaunchResult, launch

# the callbacks' 2 x 2 (data_parallel x tensor_parallel) runs: 9 samples, one padding repeat on 2 data-parallel
# ranks, batches of 2 (tests/callbacks/test_tensor_parallel_meshes.py)
TENSOR_PARALLEL_METRICS_SAMPLES = 9


@pytest.fixture(scope="session")
def reshard_dir(tmp_path_factory) -> Path:
    """Where the 4-rank launch saves the checkpoints that tests/reliability/test_failures.py restores on 3
    ranks in other layouts."""
    return tmp_path_factory.mktemp("reshard")


@pytest.fixture(scope="session")
def four_ranks(tmp_path_factory, reshard_dir) -> LaunchResult:
    """4 ranks: ``tp_dp`` as data parallel 2 x tensor parallel 2 and its checkpoint
    (``tests.scenarios.tp``), ``pp_dp`` as pp2 x dp2 (also with short last batches) and its recipe
    (``tests.scenarios.pipeline``), the
    callbacks under a 2 x 2 mesh (``tests.scenarios.callbacks_*``), the checkpoints that
    tests/reliability/test_failures.py reshards (``tests.scenarios.reliability:reshard_save``) and the docs'
    4-rank examples (``tests.scenarios.doc_examples``, tests/test_doc_examples.py)."""
    return launch(
        [
            "tests.scenarios.tp:parity_dp2_tp2",
            "tests.scenarios.tp:checkpoint_resume",
            "tests.scenarios.pipeline:parity_pp2_dp2",
            "tests.scenarios.pipeline:recipe_gpt_pp",
            "tests.scenarios.pipeline:partial_batches",
            "tests.scenarios.callbacks_metrics:tensor_parallel_metrics",
            "tests.scenarios.callbacks_set_epoch:tensor_parallel_set_epoch",
            "tests.scenarios.reliability:reshard_save",
            "tests.scenarios.doc_examples:four_rank_examples",
        ],
        4,
        tmp_path_factory.mktemp("four"),
        args={
            "ckpt_dir": str(tmp_path_factory.mktemp("tp_checkpoints")),
            "n": TENSOR_PARALLEL_METRICS_SAMPLES,
            "batches": [2],
            "dir": str(reshard_dir),
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


# the advise planner's scenarios that run on real ranks (tests/scenarios/advise.py): the parts and costs its
# --verify launch times (tests/planner/time/test_calibration.py), the steps advise and lab measure, under
# torch's memory tracker as well (tests/commands/advise/test_advise.py, tests/commands/test_lab.py), and the
# host copy of async_checkpoint=True under every strategy (tests/planner/memory/test_host_copy.py)
ADVISE_SCENARIOS = (
    "slowest_rank_timing",
    "tp_all_reduces",
    "all_reduce_timer",
    "fsdp_cost_timer",
    "memory_with_torch_tracker",
    "async_host_copy",
)


@pytest.fixture(scope="session")
def advise_two_ranks(tmp_path_factory) -> LaunchResult:
    """One launch of 2 ranks for every scenario of tests/scenarios/advise.py, and the host synchronisations per
    optimizer step of every strategy (``tests.scenarios.host_syncs``, tests/strategies/test_host_syncs.py)."""
    return launch(
        [f"tests.scenarios.advise:{n}" for n in ADVISE_SCENARIOS]
        + ["tests.scenarios.host_syncs:syncs_per_step"],
        2,
        tmp_path_factory.mktemp("advise"),
        timeout=300,
    )


@pytest.fixture(scope="session")
def torch_tracked(advise_two_ranks) -> dict[str, list[dict]]:
    """``memory_with_torch_tracker``'s figures: ``{"model/strategy": [rank 0's {"live": LiveMemory's peak,
    "torch": torch's peak}, rank 1's]}``."""
    per_rank = advise_two_ranks.scenario("memory_with_torch_tracker")
    return {case: [r[case] for r in per_rank] for case in per_rank[0]}
