"""One training step of a dry run, measured: every tensor fake (a shape, no storage), counted by torch's tracker.

Under torch's ``FakeTensorMode`` the model's parameters, the shards the strategy's setup makes of them and
every tensor of a forward, backward and AdamW step exist with their shapes, dtypes and devices but hold no
memory, and the collectives of the simulated process group (:mod:`lit_parallel.parallel.simulated`) return
at once. torch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``) counts what is live by category
as the step runs; its peak is the rank's peak. The step is Lightning's order after a first step (so the
optimizer state and the last step's gradients exist): forward, loss, ``zero_grad()``, backward,
``optimizer.step()``. lit_parallel's own counter (``LiveMemory``) counts the same step beside it: the two are
independent implementations (64 to 960 bytes apart on the steps the tests measure).

AdamW runs its ``foreach`` implementation, its default on CUDA (its for-loop one on a torch whose foreach step
over fake DTensors holds more: ``_compat`` feature ``fake_foreach_dtensor``). What this cannot measure: a
pipeline schedule (its stages exchange activations point to point and the simulated group delivers none, so a
later stage has nothing to compute on), and what the CUDA caching allocator adds (fragmentation, NCCL's
buffers): the fake tensors live on the CPU device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lit_parallel import _compat
from lit_parallel.measure.live_memory import LiveMemory
from lit_parallel.measure.mem_tracker import start_mem_tracker, stop_mem_tracker

# torch's categories (lit_parallel.measure.mem_tracker.CATEGORIES) -> ours, in the order reported
CATEGORIES = {
    "PARAM": "params",
    "BUFFER": "buffers",
    "GRAD": "grads",
    "OPT": "optimizer",
    "ACT": "activations",
    "TEMP": "temporaries",
    "OTH": "other",
}


@dataclass(frozen=True)
class StepMemory:
    """A rank's peak of one step: by category (bytes) as ``counter`` counted it (torch's ``MemTracker``, or
    lit_parallel's ``LiveMemory`` on a torch without it), and the total of lit_parallel's own counter, which
    counts the same step beside it (:mod:`lit_parallel.measure.live_memory`)."""

    by_category: dict[str, float]
    input_description: str
    live_memory: float = 0.0
    counter: str = "MemTracker"

    @property
    def total(self) -> float:
        return sum(self.by_category.values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "input": self.input_description,
            "counter": self.counter,
            **{f"{k}_bytes": v for k, v in self.by_category.items()},
            "total_bytes": self.total,
            "live_memory_total_bytes": self.live_memory,
        }


@contextmanager
def fake_step_context() -> Iterator[Any]:
    """A ``FakeTensorMode`` (entered by the caller around building the model, the setup and the step), with
    device meshes built on real tensors meanwhile (:func:`lit_parallel._compat.meshes_on_real_tensors`)."""
    mode = _compat.FakeTensorMode(allow_non_fake_inputs=True)
    with _compat.meshes_on_real_tensors():
        yield mode


def fake_module(module: nn.Module, mode: Any, device: str = "cpu") -> nn.Module:
    """``module`` (on the meta device) with fake parameters and buffers on ``device`` (no memory)."""
    with mode:
        return module.to_empty(device=device)


def fake_inputs(args: tuple, mode: Any, device: str = "cpu") -> tuple:
    """Fake tensors of the shapes and dtypes of ``args`` (meta tensors) on ``device``; other values kept."""
    with mode:
        return tuple(
            torch.zeros(a.shape, dtype=a.dtype, device=device) if isinstance(a, torch.Tensor) else a
            for a in args
        )


def measure_step(
    module: nn.Module,
    args: tuple,
    loss: Callable[[Any, tuple], torch.Tensor],
    mode: Any,
    *,
    input_description: str = "",
    context: Callable[[], Any] = nullcontext,
) -> StepMemory:
    """The peak of one step of ``module`` on ``args`` (fake tensors, under ``mode``) with AdamW: a first step
    outside the tracker (AdamW makes its state there), then the tracked one; forward and loss run inside
    ``context()`` (the precision plugin's: autocast under mixed precision)."""
    with mode:
        # foreach: AdamW's default on CUDA (one scratch copy of the parameters), what advise predicts for GPUs,
        # where this torch's fake step allows it (_compat feature "fake_foreach_dtensor")
        optimizer = torch.optim.AdamW(
            [p for p in module.parameters() if p.requires_grad],
            lr=1e-3,
            foreach=_compat.has_feature("fake_foreach_dtensor"),
        )

        def step() -> None:  # Lightning's order: the last step's gradients live until after the forward
            with context():
                value = loss(module(*args), args)
            optimizer.zero_grad()
            value.backward()
            optimizer.step()

        step()
        live = LiveMemory(module, optimizer)  # the package's counter, and torch's inside it: the same ops
        live.__enter__()
        tracker = start_mem_tracker(module, optimizer)  # None on a torch without it (said once)
        try:
            step()
        finally:
            peak = stop_mem_tracker(tracker, "cpu") if tracker is not None else None
            live.__exit__(None, None, None)
    if peak is None:
        return StepMemory(
            {k: float(v) for k, v in live.peak.by_category.items()},
            input_description,
            float(live.peak.total),
            "LiveMemory",
        )
    categories = {ours: float(peak[theirs]) for theirs, ours in CATEGORIES.items()}
    return StepMemory(categories, input_description, float(live.peak.total))
