"""Callbacks under a 2 x 2 (data_parallel x tensor_parallel) mesh: tensor-parallel peers count once.

Lightning's ModelParallelStrategy and our tp_dp (TensorParallelStrategy) both give each
tensor-parallel peer the same data-parallel shard. The runs share the 4-rank launch of tests/conftest.py.
"""

from __future__ import annotations

import pytest

from tests.callbacks.test_metrics import single_process_values
from tests.conftest import TENSOR_PARALLEL_METRICS_SAMPLES

pytestmark = pytest.mark.multiprocess
N = TENSOR_PARALLEL_METRICS_SAMPLES  # 9 on 2 data-parallel ranks: one padding repeat (the 4-rank launch, tests/conftest.py)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("strategy", ["model_parallel", "tp_dp"])
def test_metrics_count_each_sample_once_under_tensor_parallelism(four_ranks, strategy):
    expected = single_process_values(N)
    for rank, out in enumerate(four_ranks.scenario("tensor_parallel_metrics")):
        runs = out[strategy][2]
        for name, prefix in (("fit", "val"), ("validate", "val"), ("test", "test")):
            got = runs[name]
            assert got[f"{prefix}_count"] == got[f"{prefix}_count_metric"] == N, (rank, name, got)
            assert got[f"{prefix}_acc"] == pytest.approx(expected["acc"], rel=1e-6)
            assert got[f"{prefix}_loss"] == pytest.approx(expected["loss"], rel=1e-5)
            assert runs[f"{name}_gathered"]["index"].tolist() == list(range(N))
        # without the callback: 2 tensor-parallel peers x (9 samples + 1 padding repeat)
        assert runs["validate_without_callback"]["val_count"] == 20


@pytest.mark.timeout(420)
def test_set_epoch_check_counts_tensor_parallel_peers_once(four_ranks):
    outs = four_ranks.scenario("tensor_parallel_set_epoch")
    assert all(out["correct"] == [] for out in outs)
    (finding,) = outs[0]["everything"]
    assert "16 of the 32 samples drawn by the 2 data-parallel ranks" in finding
    assert outs[0]["everything_warnings"] == [finding] and outs[1]["everything_warnings"] == []
