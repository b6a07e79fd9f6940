"""One micro-batch of a pipelined model simulated on the meta device: what the planner's ``pp_dp`` terms
(:mod:`~lit_parallel.planner.memory.pipeline`) are built from.

Forward, the planner's loss and backward run as in :mod:`~lit_parallel.planner.simulation`, with the
saved activations attributed to the modules before the blocks, to each block and to what follows them
(head and loss). A real stage runs every micro-batch but the first into gradients that already exist
(torch's ``PipelineStage`` accumulates over the step's micro-batches), so each gradient is computed into a
new tensor and then added: the simulation starts its backward with every gradient in place, and those new
tensors are among its temporaries.

What a stage keeps of a micro-batch's boundaries is told apart here because the pipeline holds those
tensors in buffers of its own (:func:`~lit_parallel.planner.memory.pipeline.stage_peaks`): a block's input
that the block saves (on a later stage: the receive buffer), a block's output that the block saves (the
stage output), the model's inputs that are saved (slices of the step's batch) and the model's output that
the loss saves (the last stage keeps every micro-batch's output).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lit_parallel._compat import storage_key, tree_flatten
from lit_parallel.measure.live_memory import LiveMemory

__all__ = ["MicroBatchSimulation", "simulate_micro_batch"]


@dataclass(frozen=True)
class MicroBatchSimulation:
    """One micro-batch simulated on meta, in bytes.

    Attributes:
        prefix, blocks, suffix: saved activations before the blocks, per block, after them (head and loss).
        outputs: each block's output.
        temporaries: the largest temporaries of the forward or the backward.
        input_saved, output_saved: per block, its input (other than the model's inputs) / its output when
            the block itself saves it first (so that it is in the block's saved bytes), else 0.
        inputs: the micro-batch's input tensors.
        prefix_inputs, block_inputs, suffix_inputs: the model's inputs saved first before the blocks, by
            each block, after them.
        model_output, model_output_saved: the model's output; what of it the loss saves.
    """

    prefix: float
    blocks: list[float]
    suffix: float
    outputs: list[float]
    temporaries: float
    input_saved: list[float]
    output_saved: list[float]
    inputs: float
    prefix_inputs: float
    block_inputs: list[float]
    suffix_inputs: float
    model_output: float
    model_output_saved: float


def _first_tensor(value: Any) -> torch.Tensor | None:
    first = value[0] if isinstance(value, (tuple, list)) and value else value
    return first if isinstance(first, torch.Tensor) else None


def _storages(value: Any) -> dict[int, torch.Tensor]:
    """Every tensor in ``value`` (nested containers), one per storage."""
    return {storage_key(t): t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)}


def _bytes_if_saved(tracker: LiveMemory, t: torch.Tensor | None) -> float:
    """``t``'s storage bytes when it is saved for backward (counted as activations now), else 0."""
    saved = t is not None and tracker.kind_of(t) == "activations"
    return float(t.untyped_storage().nbytes()) if saved else 0.0


class _BlockBoundaries:
    """Forward hooks on the blocks: saved activations before and after each call, which of its input and
    output the block saved, and the model's inputs saved before, by and after each block."""

    def __init__(self, tracker: LiveMemory, inputs: dict[int, torch.Tensor]) -> None:
        self.tracker, self.inputs = tracker, inputs
        self.marks: list[tuple[float, float]] = []  # (activations, model inputs saved) before each block call
        self.after: list[tuple[float, float]] = []  # ... and after it
        self.outputs: list[float] = []
        self.input_saved: list[float] = []
        self.output_saved: list[float] = []
        self._input: tuple[torch.Tensor | None, bool] = (None, False)

    def now(self) -> tuple[float, float]:
        """Saved activations, and the model's inputs among them."""
        saved = float(self.tracker.snapshot().by_category["activations"])
        return saved, sum(_bytes_if_saved(self.tracker, t) for t in self.inputs.values())

    def pre(self, module: nn.Module, args: Any) -> None:
        self.marks.append(self.now())
        first = _first_tensor(args)
        model_input = first is not None and storage_key(first) in self.inputs
        self._input = (
            first,
            model_input or (first is not None and self.tracker.kind_of(first) == "activations"),
        )

    def post(self, module: nn.Module, args: Any, out: Any) -> None:
        self.after.append(self.now())
        first = _first_tensor(out)
        self.outputs.append(float(first.untyped_storage().nbytes()) if first is not None else 0.0)
        self.output_saved.append(_bytes_if_saved(self.tracker, first))
        inp, skip = self._input
        self.input_saved.append(0.0 if skip else _bytes_if_saved(self.tracker, inp))


def simulate_micro_batch(
    module: nn.Module,
    block_names: list[str],
    args: tuple,
    *,
    dtype: torch.dtype = torch.float32,
    activation_checkpointing: bool = False,
) -> MicroBatchSimulation:
    """Forward, :func:`~lit_parallel.planner.simulation.default_loss` and backward of one micro-batch
    (``args``: meta tensors) on a meta copy of ``module``, saved activations attributed by block."""
    from lit_parallel.parallel.example_inputs import to_meta
    from lit_parallel.parallel.parallelize import apply_activation_checkpointing
    from lit_parallel.planner.activations import forward_target
    from lit_parallel.planner.fused_attention import fused_attention_on_meta
    from lit_parallel.planner.simulation import default_loss, meta_copy

    meta = meta_copy(module, dtype)
    blocks = [meta.get_submodule(n) for n in block_names]
    tracker = LiveMemory(list(meta.parameters()), exact=False, meta=True)
    args = tuple(to_meta(a, dtype) for a in args)
    bounds = _BlockBoundaries(tracker, _storages(args))
    handles = []
    for block in blocks:
        if activation_checkpointing:
            apply_activation_checkpointing(block)
        handles += [block.register_forward_pre_hook(bounds.pre), block.register_forward_hook(bounds.post)]
    # the fused kernel's saved tensors, as a real step saves them (not with checkpointing: the recomputation
    # must see the same ops, as in planner/simulation.py)
    attention = fused_attention_on_meta(attention=not activation_checkpointing)
    try:
        with tracker, attention:
            output = forward_target(meta, blocks)(*args)
            loss = default_loss(output, args)
            outputs = list(_storages(output).values())
            model_output = float(sum(t.untyped_storage().nbytes() for t in outputs))
            model_output_saved = sum(_bytes_if_saved(tracker, t) for t in outputs)
            del output, outputs  # counted apart: the last stage keeps every micro-batch's output
            forward = tracker.peak_so_far().by_category
            end = bounds.now()
            for p in meta.parameters():  # a later micro-batch's gradients are added to the earlier ones'
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
            tracker.reset_peak()
            loss.backward()
            del loss
    finally:
        for h in handles:
            h.remove()
    backward = tracker.peak.by_category
    temporaries = float(max(forward.get("temporaries", 0), backward.get("temporaries", 0)))
    return _result(bounds, end, temporaries, model_output, float(model_output_saved))


def _result(
    bounds: _BlockBoundaries,
    end: tuple[float, float],
    temporaries: float,
    model_output: float,
    model_output_saved: float,
) -> MicroBatchSimulation:
    """The simulation from the block boundaries and ``end`` (saved activations and model inputs at the end
    of forward and loss)."""
    first, last = (bounds.marks[0], bounds.after[-1]) if bounds.marks else (end, end)
    return MicroBatchSimulation(
        prefix=first[0],
        blocks=[a[0] - b[0] for b, a in zip(bounds.marks, bounds.after)],
        suffix=end[0] - last[0],
        outputs=bounds.outputs,
        temporaries=temporaries,
        input_saved=bounds.input_saved,
        output_saved=bounds.output_saved,
        inputs=float(sum(t.untyped_storage().nbytes() for t in bounds.inputs.values())),
        prefix_inputs=first[1],
        block_inputs=[a[1] - b[1] for b, a in zip(bounds.marks, bounds.after)],
        suffix_inputs=end[1] - last[1],
        model_output=model_output,
        model_output_saved=model_output_saved,
    )
