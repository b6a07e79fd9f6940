"""Synchronized BatchNorm on gloo: 2 ranks equal one process on the global batch.

The layer alone (uneven and empty per-rank batches, momentum and cumulative averages, eval mode), and
whole training runs with SyncBatchNormConversion under Lightning's ddp and our strategies (the callbacks'
2-rank launch, tests/callbacks/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

import lit_parallel  # noqa: F401  (registers the strategy names)
from tests.callbacks.conftest import SYNC_BATCHNORM_STRATEGIES
from tests.reference import assert_rel_close, reference_training
from tests.scenarios import callbacks_sync_batchnorm as sc

pytestmark = pytest.mark.multiprocess
WORLD = 2
STRATEGIES = SYNC_BATCHNORM_STRATEGIES


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(sc.LAYER_CASES))
def test_sync_batchnorm_layer_matches_one_process_on_global_batch(callbacks_two_ranks, case):
    per_rank = [r[case] for r in callbacks_two_ranks.scenario("layer_parity")]
    inputs = sc.layer_inputs(case)
    reference = sc.make_bn(case, inputs)  # torch's BatchNorm, one process, the whole batch
    for step, (x, grad, bounds) in enumerate(inputs["steps"]):
        x = x.clone().requires_grad_(True)
        reference.zero_grad(set_to_none=True)
        y = reference(x)
        (y * grad).sum().backward()
        what = f"{case} step {step}"
        for rank, (lo, hi) in enumerate(bounds):
            got = per_rank[rank]["steps"][step]
            assert got["y"].shape[0] == hi - lo
            if hi > lo:
                assert_rel_close(got["y"], y[lo:hi], what=f"{what}: rank {rank} output")
                assert_rel_close(got["x_grad"], x.grad[lo:hi], what=f"{what}: rank {rank} input gradient")
        # each rank holds the gradient of its own loss; their sum is the global loss's gradient
        for name in ("weight", "bias"):
            total = sum(r["steps"][step][f"{name}_grad"] for r in per_rank)
            assert_rel_close(total, getattr(reference, name).grad, what=f"{what}: {name} gradient")
    reference.eval()
    assert per_rank[0]["agree"] == [] and per_rank[1]["agree"] == []
    assert [name for name, _ in per_rank[0]["drift"]] == ["0"]
    assert per_rank[0]["drift"][0][1] == pytest.approx(1.0)
    for rank, got in enumerate(per_rank):
        assert_rel_close(
            got["running_mean"], reference.running_mean, what=f"{case}: rank {rank} running_mean"
        )
        assert_rel_close(got["running_var"], reference.running_var, what=f"{case}: rank {rank} running_var")
        assert got["num_batches_tracked"] == int(reference.num_batches_tracked)
        assert_rel_close(got["eval_y"], reference(inputs["eval_x"]), what=f"{case}: rank {rank} eval output")


def _reference_state() -> dict:
    return reference_training(
        sc.conv_net(),
        sc.conv_data(),
        sc.conv_loss,
        world_size=WORLD,
        per_rank_batch=sc.PER_RANK_BATCH,
        max_steps=sc.STEPS,
        lr=sc.LR,
    )["params"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", [*STRATEGIES, "ddp_configure_model"])
def test_training_with_conversion_matches_one_process(callbacks_two_ranks, strategy):
    expected = _reference_state()
    for rank, out in enumerate(callbacks_two_ranks.scenario("training_parity")):
        got = out[strategy]
        assert got["converted"] == 3 and got["layer_types"] == ["SyncBatchNorm"]
        if rank == 0 and strategy != "ddp_tuned":
            (warning,) = got["warnings"]
            assert (
                "normalize over a global batch of 8 samples (4 on this rank x 2 data-parallel ranks)"
                in warning
            )
            assert "GroupNorm" in warning
        else:  # ddp_tuned runs with min_batch_size=8; other ranks never warn
            assert got["warnings"] == []
        for name, value in expected.items():
            assert_rel_close(got["state"][name], value, what=f"{strategy}: rank {rank} {name}")


@pytest.mark.timeout(300)
def test_training_without_conversion_differs(callbacks_two_ranks):
    """Control: the same run with plain BatchNorm does not match, so the parity above is not vacuous."""
    expected = _reference_state()
    got = callbacks_two_ranks.scenario("training_parity")[0]["ddp_plain_batchnorm"]["state"]
    assert got["0.bn.running_mean"].shape == expected["0.bn.running_mean"].shape
    assert not torch.allclose(got["0.bn.running_mean"], expected["0.bn.running_mean"], rtol=1e-3, atol=0)
