"""Scenarios for the rank-0 copy of a model not built on the meta device (``broadcast_from_rank0`` inside
``parallelize`` / ``parallelize_stages``), run on 2 real gloo ranks by tests/strategies/test_fsdp.py.

Each rank builds the model from its own seed (rank 0's weights must win) and parallelizes it as
``fsdp_blocks``, ``tp_dp`` (tensor parallel 2) and ``pp_dp`` (2 stages) do, under the package's live-memory
counter (:class:`~lit_parallel.measure.live_memory.LiveMemory`), every parameter and buffer of the model
counted as live from the start. Returned: the extra bytes at the peak (peak minus the start) and the weights
each rank ends with; the test computes the bound from the model's block sizes and the chunk cap.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lit_parallel.measure.live_memory import LiveMemory
from lit_parallel.parallel import ParallelDims, ParallelizeConfig, parallelize
from lit_parallel.parallel.fsdp import full_state_dict
from tests.tp_models import TPGPT, TPGPTConfig

# the cap the scenarios sync under: a quarter of the smallest block's bytes (the test checks that), so a copy
# of more than that at once, or of a whole block, shows
CHUNK = 4096
CONFIG = TPGPTConfig(n_layer=4, block_size=8)


def build(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return TPGPT(CONFIG)


def _measured(model: torch.nn.Module, run) -> int:
    tracker = LiveMemory(exact=True)  # no module given: it must not keep the replaced parameters alive
    with tracker:
        tracker.count(t for t in [*model.parameters(), *model.buffers()])
        start = tracker.current
        tracker.reset_peak()
        run()
    return tracker.peak.total - start


def sync_memory(ctx) -> dict:
    from lit_parallel.parallel.blocks import find_transformer_blocks
    from lit_parallel.parallel.pipeline.plan import plan_pipeline
    from lit_parallel.parallel.pipeline.schedule import parallelize_stages
    from lit_parallel.parallel.tensor_parallel import infer_tp_plan

    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict = {}

    model = build(seed=rank)
    dims = ParallelDims.for_fsdp(world)
    dims.build_mesh("cpu")
    extra = _measured(model, lambda: parallelize(model, dims, ParallelizeConfig(sync_chunk_bytes=CHUNK)))
    out["fsdp_blocks"] = {"extra": extra, "params": full_state_dict(model)}

    model = build(seed=rank)
    dims = ParallelDims(world_size=world, tensor_parallel=world)
    dims.build_mesh("cpu")
    plan = infer_tp_plan(model, world)
    config = ParallelizeConfig(tp_plan=plan, sync_chunk_bytes=CHUNK)
    extra = _measured(model, lambda: parallelize(model, dims, config))
    out["tp_dp"] = {"extra": extra, "params": full_state_dict(model)}  # original row order (layout hooks)

    model = build(seed=rank)
    dims = ParallelDims.for_pipeline(world_size=world, pipeline_parallel=world, data_parallel=1)
    dims.build_mesh("cpu")
    pp_plan = plan_pipeline(
        model, find_transformer_blocks(model), pp_size=world, schedule="1F1B", microbatches=2
    )
    extra = _measured(model, lambda: parallelize_stages(model, pp_plan, dims, sync_chunk_bytes=CHUNK))
    local = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    out["pp_dp"] = {"extra": extra, "params": {k: v.detach().clone() for k, v in local.items()}}
    return out
