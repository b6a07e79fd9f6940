"""What the tests of `advise` and `lab` share: one launch of the steps they measure, under torch's tracker."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def torch_tracked(tmp_path_factory) -> dict[str, list[dict]]:
    """tests/scenarios/advise.py:memory_with_torch_tracker on 2 real ranks: ``{"model/strategy": [rank 0's
    {"live": LiveMemory's peak, "torch": torch's peak}, rank 1's]}``."""
    from tests.harness import launch

    name = "memory_with_torch_tracker"
    res = launch(f"tests.scenarios.advise:{name}", 2, tmp_path_factory.mktemp("torch_tracked"), timeout=300)
    per_rank = res.scenario(name)
    return {case: [r[case] for r in per_rank] for case in per_rank[0]}
