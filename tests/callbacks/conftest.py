"""One launch of 2 ranks for the callbacks' DDP runs (SetEpochCheck's sharding faults, synchronized BatchNorm,
CrossRankMetrics on 7 samples): start-up is paid once. PitfallReport keeps a launch of its own, since it
judges the timing of the steps it watches."""

from __future__ import annotations

import pytest
from lightning.pytorch.strategies import StrategyRegistry

import lit_parallel  # noqa: F401  (registers the strategy names)
from tests.harness import LaunchResult, launch

SET_EPOCH_SCENARIOS = [
    "hidden_distributed_sampler",
    "hidden_distributed_sampler_raise",
    "hidden_distributed_sampler_fixed",
    "every_rank_reads_everything",
    "wrong_rank_in_sampler",
    "iterable_set_epoch_never_called",
    "iterable_every_rank_same_stream",
    "correct_setups",
]
SYNC_BATCHNORM_STRATEGIES = [s for s in ("ddp", "ddp_tuned", "fsdp_blocks", "hsdp") if s in StrategyRegistry]
# CrossRankMetrics on 2 ranks: 7 samples; batch 2: rank 1's last batch is [sample 5, repeat] (partly padded);
# batch 3: it is [repeat] only
METRICS_SAMPLES, METRICS_BATCHES = 7, [2, 3]


@pytest.fixture(scope="session")
def callbacks_two_ranks(tmp_path_factory) -> LaunchResult:
    return launch(
        [
            *(f"tests.scenarios.callbacks_set_epoch:{n}" for n in SET_EPOCH_SCENARIOS),
            "tests.scenarios.callbacks_sync_batchnorm:layer_parity",
            "tests.scenarios.callbacks_sync_batchnorm:training_parity",
            "tests.scenarios.callbacks_metrics:exact_metrics",
        ],
        2,
        tmp_path_factory.mktemp("callbacks"),
        args={
            "strategies": SYNC_BATCHNORM_STRATEGIES + ["ddp_configure_model", "ddp_plain_batchnorm"],
            "n": METRICS_SAMPLES,
            "batches": METRICS_BATCHES,
        },
        timeout=400,
    )
