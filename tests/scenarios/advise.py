"""Scenarios for ``lit-parallel advise --verify``'s launch (tests/test_calibration.py)."""

from __future__ import annotations

import torch.distributed as dist


def slowest_rank_timing(ctx) -> dict:
    """A real :class:`PartsTimer` on every rank, given made-up samples (rank r's first part takes r + 1 ms
    in sample 0 and 3 - r ms in sample 1): the timing every rank gets back is the slowest rank's, sample by
    sample."""
    from lit_parallel.advise_report import shaped_input
    from lit_parallel.advise_rounds import slowest_rank_timing
    from lit_parallel.parallel.model_summary import build_on_meta
    from lit_parallel.parallel.step_time import PartsTimer
    from tests.conformance_models import FEATURES, mlp

    timer = PartsTimer(
        build_on_meta(mlp, {}), block_name=None, batch_size=4, example_inputs=shaped_input((FEATURES,))
    )
    r = dist.get_rank()
    timer.samples = [[(r + 1) * 1e-3, 1e-3, 1e-4, 64e-6], [(3 - r) * 1e-3, 1e-3, 1e-4, 64e-6]]
    timing = slowest_rank_timing(timer)
    return {
        "block_s": timing["block_s"],
        "samples_left": len(timer.samples),
        "none": slowest_rank_timing(None),
    }
