"""One launch through Lightning's own launcher (``python train.py`` with ``Trainer(devices=2)``: Lightning
starts the second rank) for the strategies' runs under it; start-up is paid once."""

from __future__ import annotations

import pytest

from tests.harness import LaunchResult, launch

# tests/strategies/test_auto.py: auto_parallel decides before Lightning's launcher starts the other rank
AUTO_SCENARIOS = (
    "picks_ddp_tuned",
    "picks_fsdp_blocks",
    "picks_tp_dp",
    "setup_built_picks_fsdp_blocks",
    "picks_fsdp_blocks_with_expert_parallelism",
    "no_parameters_validates",
)


@pytest.fixture(scope="session")
def lightning_launcher_two_ranks(tmp_path_factory) -> LaunchResult:
    """``ddp_tuned`` by its registry name (``tests.scenarios.ddp:parity``), ``fsdp_blocks`` and ``hsdp`` by
    their names in repeated Trainers (``tests.scenarios.fsdp:lightning_launcher``) and ``auto_parallel``'s
    choices (``tests.strategies.test_auto``), on 2 ranks started by Lightning's launcher."""
    return launch(
        [
            "tests.scenarios.ddp:parity",
            "tests.scenarios.fsdp:lightning_launcher",
            *(f"tests.strategies.test_auto:{n}" for n in AUTO_SCENARIOS),
            # tests/strategies/test_older_torch.py: the paths of torch < 2.13, forced
            "tests.scenarios.compat:forward_sync_buffers",
            "tests.scenarios.compat:pipeline",
        ],
        2,
        tmp_path_factory.mktemp("lightning_launcher"),
        launcher="lightning",
        args={"strategy_object": False},
        timeout=400,
    )
