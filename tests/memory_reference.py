"""torch's own memory tracker on the step lit_parallel measures: the independent reference for LiveMemory.

``advise --verify``, ``lit-parallel lab memory`` and the planner's tests measure a real step's peak with
:class:`~lit_parallel.measure.live_memory.LiveMemory`, and the planner's simulation counts with the same class
on meta. To check the measurement with another tool, :func:`measure_step_with_torch_tracker` runs the very
step :func:`~lit_parallel.commands.advise.measure.measure_step` measures (its fourth, under a real
``lightning.Trainer``) under torch's ``MemTracker`` as well (``torch.distributed._tools.mem_tracker``, reached
through ``lit_parallel._compat``): torch's own implementation, its own hooks (module, gradient and optimizer
hooks, ``resize_`` of storages patched) and its own bookkeeping of live storages per device.

torch's tracker starts inside LiveMemory's (at the start of the measured step, with the module, the
optimizer and the batch registered as existing before it) and stops right after the optimizer step, the
end of what the step allocates. Under Lightning the forward and backward run inside ``optimizer.step``
(the closure), so torch's tracker files everything the step makes as optimizer state: of its categories only
the total, the parameters and the gradients are comparable.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lit_parallel._compat import MemTracker, tree_flatten
from lit_parallel.measure.live_memory import MemoryPeak


def torch_peak(tracker: Any) -> dict[str, int]:
    """The peak torch's tracker saw on the CPU (the only device of these runs; meta tensors take none):
    ``total``, ``params``, ``grads``."""
    snapshot = tracker.get_tracker_snapshot("peak").get(torch.device("cpu"), {})
    by_name = {getattr(k, "name", k): v for k, v in snapshot.items()}
    return {
        "total": by_name.get("Total", 0),
        "params": by_name.get("PARAM", 0),
        "grads": by_name.get("GRAD", 0),
    }


def measure_step_with_torch_tracker(
    model: nn.Module, inputs: tuple, **kwargs: Any
) -> tuple[MemoryPeak, float, dict[str, int]]:
    """:func:`~lit_parallel.commands.advise.measure.measure_step` ``(model, inputs, **kwargs)`` with its
    measured step tracked by torch's ``MemTracker`` too. Returns LiveMemory's peak, the step seconds and
    torch's peak (:func:`torch_peak`)."""
    from lit_parallel.commands.advise.measure import _lightning_module, measure_step

    tracking: dict[str, Any] = {}

    class TrackedStep(type(_lightning_module(model))):  # the step measure_step fits: forward, loss, AdamW
        def optimizer_step(self, *args: Any, **kw: Any) -> None:
            super().optimizer_step(*args, **kw)
            if tracking.get("tracker") is not None:
                tracking.pop("tracker").__exit__(None, None, None)

    def start(trainer: Any, batch: Any) -> list[torch.Tensor]:
        # called by measure_step at the start of the measured step, inside LiveMemory: torch's tracker
        # nests inside it and stops first (above)
        tracker = MemTracker()
        tensors = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]
        tracker.track_external(trainer.lightning_module, trainer.optimizers[0], *tensors)
        tracker.__enter__()
        tracking["tracker"] = tracking["done"] = tracker
        return []

    peak, seconds = measure_step(model, inputs, module=TrackedStep(), live_from_start=start, **kwargs)
    assert "done" in tracking and "tracker" not in tracking, "torch's tracker did not cover the measured step"
    return peak, seconds, torch_peak(tracking["done"])


# How far LiveMemory's peak may be from torch's in a launch. Two known differences, both of a few kB or
# percent: (1) LiveMemory counts a tensor subclass other than DTensor by the nominal storage of the wrapper,
# not by its inner tensors (test_live_memory_counts_a_tensor_subclass_by_its_inner_tensors in
# tests/commands/advise/test_advise.py): under tp_dp the AsyncCollectiveTensor of each functional all-reduce
# (BlockMLP(32): LiveMemory 4096 bytes more at the peak; Llama: 16 bytes fewer); (2) torch's tracker varies
# from run to run under FSDP2 where LiveMemory does not (BlockMLP(128), fsdp_blocks, one rank: torch 6,168,108
# bytes in one run of ten, 6,067,224 in the others, as LiveMemory in all ten).
LAUNCH_SLACK = 0.03


def assert_live_memory_is_torchs(case: str, ranks: list[dict]) -> None:
    """Every rank's LiveMemory peak is the peak torch's tracker saw in the same step, within
    :data:`LAUNCH_SLACK`."""
    for rank, r in enumerate(ranks):
        live, by_torch = r["live"]["total"], r["torch"]["total"]
        assert abs(live - by_torch) <= LAUNCH_SLACK * by_torch, (case, rank, r)
