"""CrossRankMetrics: metrics under 2 and 3 ranks equal the single-process values on the same data."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.callbacks.conftest import METRICS_BATCHES, METRICS_SAMPLES
from tests.harness import launch
from tests.scenarios.callbacks_metrics import classification_data

pytestmark = pytest.mark.multiprocess


def single_process_values(n: int) -> dict:
    """What one process evaluating all n samples once reports, computed directly from the data."""
    x, y = classification_data(n).tensors
    losses = F.cross_entropy(x, y, reduction="none")
    return {
        "acc": (x.argmax(1) == y).float().mean().item(),
        "count": float(n),
        "loss": losses.mean().item(),
        "max_loss": losses.max().item(),
        "preds": x.argmax(1),
    }


def _check(per_rank: list[dict], n: int, world: int, batches: list[int]) -> None:
    expected = single_process_values(n)
    for rank, out in enumerate(per_rank):
        for batch in batches:
            runs = out[batch]
            for run, prefix in (("fit", "val"), ("validate", "val"), ("test", "test")):
                got = runs[run]
                where = f"rank {rank}, batch {batch}, {run}"
                assert got[f"{prefix}_count"] == expected["count"], where
                assert got[f"{prefix}_count_metric"] == expected["count"], where
                assert got[f"{prefix}_acc"] == pytest.approx(expected["acc"], rel=1e-6), where
                assert got[f"{prefix}_loss"] == pytest.approx(expected["loss"], rel=1e-5), where
                assert got[f"{prefix}_mean_loss_metric"] == pytest.approx(expected["loss"], rel=1e-5), where
                assert got[f"{prefix}_max_loss"] == pytest.approx(expected["max_loss"], rel=1e-6), where
                gathered = runs[f"{run}_gathered"]
                # every sample exactly once, in dataset order
                assert torch.equal(gathered["index"], torch.arange(n)), where
                assert torch.equal(gathered["preds"], expected["preds"]), where
            # Without the callback the padding repeats are counted: the test above can fail.
            padded = -(-n // world) * world
            assert padded != n
            assert runs["validate_without_callback"]["val_count"] == padded


@pytest.mark.timeout(420)
def test_metrics_equal_single_process_7_samples_on_2_ranks(callbacks_two_ranks):
    # the callbacks' 2-rank launch (tests/callbacks/conftest.py): 7 samples, batches 2 and 3
    _check(callbacks_two_ranks.scenario("exact_metrics"), METRICS_SAMPLES, 2, METRICS_BATCHES)


@pytest.mark.timeout(300)
def test_metrics_equal_single_process_10_samples_on_3_ranks(tmp_path):
    batches = [2, 3]
    res = launch(
        "tests.scenarios.callbacks_metrics:exact_metrics", 3, tmp_path, args={"n": 10, "batches": batches}
    )
    _check(res.scenario("exact_metrics"), 10, 3, batches)
