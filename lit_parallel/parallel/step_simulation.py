"""One training step's forward, loss and backward simulated on the meta device: what is live when.

Only shapes are computed (meta tensors), so a model of any size is simulated without memory. The step
is the one the planner predicts and ``advise --verify`` measures: ``loss = default_loss(model(x), x)``,
``loss.backward()``. :class:`~lit_parallel.parallel.live_memory.LiveMemory` counts what is live: at the end
of forward (the highest point of forward and loss) and at the peak of backward (gradients arriving
while activations are freed). The model state around it (parameters, last step's gradients, optimizer
state) is accounted for by :mod:`lit_parallel.parallel.peak`, not simulated.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lit_parallel.parallel.activations import forward_target
from lit_parallel.parallel.example_inputs import meta_example_input, to_meta
from lit_parallel.parallel.fused_attention import fused_attention_on_meta
from lit_parallel.parallel.live_memory import LiveMemory, MemoryPeak


def logits_of(output: Any) -> torch.Tensor:
    """The tensor a loss is computed on: the output, its ``.logits`` (Hugging Face) or its first element."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise ValueError(
        f"cannot find the output tensor in a {type(output).__name__}; return a tensor or .logits"
    )


def default_loss(output: Any, args: Sequence[Any]) -> torch.Tensor:
    """The loss of the simulated and the measured step.

    Token models (the input is integer ids, the output has one more dimension): cross-entropy over the
    vocabulary against the input ids; a 2-D output: cross-entropy against class 0; otherwise the mean
    square of the output. Computed in fp32, as Lightning's mixed precision does for losses.
    """
    logits = logits_of(output)
    first = args[0] if args else None
    if (
        isinstance(first, torch.Tensor)
        and not first.is_floating_point()
        and logits.dim() == first.dim() + 1
        and logits.shape[:-1] == first.shape
    ):
        return F.cross_entropy(logits.flatten(0, -2).float(), first.flatten())
    if logits.dim() == 2:
        return F.cross_entropy(
            logits.float(), torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
        )
    return logits.float().pow(2).mean()


def meta_copy(module: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """A copy of ``module`` on the meta device (no memory copied: parameters and buffers are replaced by
    meta stand-ins while copying); floating parameters and buffers cast to ``dtype`` when given."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    copied = copy.deepcopy(module, memo)
    return copied.to(dtype) if dtype is not None else copied


@dataclass(frozen=True)
class StepSimulation:
    """Bytes live in one simulated forward + backward, beyond the model's parameters.

    Attributes:
        forward_peak: the highest point of forward and loss: ``activations`` (saved for backward so far)
            and ``temporaries`` (outputs not saved, the loss's intermediate results, ...).
        backward_peak: the highest point of backward: ``grads`` (this step's gradients so far),
            ``activations`` not yet freed, ``temporaries`` (gradients flowing between layers).
        block_starts: ``(activations, temporaries)`` live as each block's forward starts, in call order:
            the moments FSDP gathers that block's parameters.
        block_inside, block_after: ``(activations, temporaries)`` at the highest point inside each block's
            forward, and between its end and the next block's start (or the model's end).
        block_grads_done: per block (module order), ``(activations, temporaries, gradients)`` live when
            its last parameter gradient is computed: the moment FSDP reduce-scatters that block.
        model_end: ``(activations, temporaries)`` live when the model's forward returns (before the loss).
        saved_bytes: everything saved for backward in the forward (the activations of one micro-batch).
        grad_bytes: all gradients at the end of backward (in the simulated dtype).
        batch_size: the micro-batch.
        input_description: the input that was simulated.
    """

    forward_peak: MemoryPeak
    backward_peak: MemoryPeak
    block_starts: tuple[tuple[float, float], ...]
    model_end: tuple[float, float]
    block_inside: tuple[tuple[float, float], ...]
    block_after: tuple[tuple[float, float], ...]
    block_grads_done: tuple[tuple[float, float, float], ...]
    saved_bytes: float
    grad_bytes: float
    batch_size: int
    input_description: str


class _BlockMoments:
    """Forward hooks on the blocks: what is live (activations, temporaries) at each block's start, and the
    peak segments inside each block and between it and the next (or the model's end)."""

    def __init__(self, tracker: Any, blocks: list[nn.Module]) -> None:
        self.tracker = tracker
        self.starts: list[tuple[float, float]] = []
        self.inside: list[tuple[float, float]] = []
        self.after: list[tuple[float, float]] = []
        self.handles = [b.register_forward_pre_hook(self._at_start) for b in blocks]
        self.handles += [b.register_forward_hook(self._at_end) for b in blocks]

    def _at_start(self, module: nn.Module, inputs: Any) -> None:
        if self.starts:
            self.after.append(self.tracker.segment())
        now = self.tracker.snapshot().by_category
        self.starts.append((float(now["activations"]), float(now["temporaries"])))
        self.tracker.segment()

    def _at_end(self, module: nn.Module, inputs: Any, output: Any) -> None:
        self.inside.append(self.tracker.segment())

    def finish(self) -> None:
        """At the end of forward: remove the hooks, close the last block's segment."""
        for h in self.handles:
            h.remove()
        if self.starts:
            self.after.append(self.tracker.segment())


def simulate_step(
    module: nn.Module,
    *,
    dtype: torch.dtype = torch.float32,
    batch_size: int | None = None,
    seq_len: int | None = None,
    example_inputs: Any = None,
    block_names: Sequence[str] = (),
    activation_checkpointing: bool = False,
) -> StepSimulation:
    """Simulate forward, :func:`default_loss` and backward of ``module`` on the meta device.

    Args:
        module: the model (any device; it is copied to meta without copying memory) whose ``forward`` runs.
        dtype: compute dtype of the simulation (parameters and floating inputs cast to it).
        block_names: qualified names of the transformer blocks (for activation checkpointing).
        activation_checkpointing: recompute each block in backward (non-reentrant checkpoint per block,
            as ``activation_checkpointing=True`` does in fsdp_blocks / tp_dp).
    """
    from lit_parallel.parallel.parallelize import apply_activation_checkpointing

    example = meta_example_input(module, batch_size=batch_size, seq_len=seq_len, given=example_inputs)
    meta = meta_copy(module, dtype)
    blocks = [meta.get_submodule(name) for name in block_names]
    if activation_checkpointing:
        for block in blocks:
            apply_activation_checkpointing(block)
    args = tuple(to_meta(a, dtype) for a in example.args)
    target = forward_target(meta, blocks)
    tracker = _Segments(list(meta.parameters()), exact=False, meta=True)
    # fused attention is simulated without checkpointing only: recomputation must see the same ops
    attention = fused_attention_on_meta() if not activation_checkpointing else contextlib.nullcontext()
    moments = _BlockMoments(tracker, blocks)
    with attention, tracker:
        output = target(*args)
        moments.finish()
        now = tracker.snapshot().by_category
        model_end = (float(now["activations"]), float(now["temporaries"]))
        loss = default_loss(output, args)
        del output
        done = _watch_block_grads(blocks, tracker)
        forward_peak = tracker.peak_so_far()
        saved = tracker.snapshot().by_category["activations"]
        tracker.reset_peak()
        loss.backward()
        del loss
    grads = sum(p.grad.untyped_storage().nbytes() for p in meta.parameters() if p.grad is not None)
    return StepSimulation(
        forward_peak=forward_peak,
        backward_peak=tracker.peak,
        block_starts=tuple(moments.starts),
        model_end=model_end,
        block_inside=tuple(moments.inside),
        block_after=tuple(moments.after),
        block_grads_done=tuple(done[i] for i in sorted(done)),
        saved_bytes=float(saved),
        grad_bytes=float(grads),
        batch_size=example.batch_size,
        input_description=example.description,
    )


class _Segments(LiveMemory):
    """:class:`LiveMemory` that also keeps the highest point since the last :meth:`segment` call."""

    high = 0

    def _add(self, t: torch.Tensor) -> int | None:
        alloc = super()._add(t)
        self.high = max(self.high, self.current)
        return alloc

    def segment(self) -> tuple[float, float]:
        """``(activations now, the rest of the highest point since the last call)``, beyond parameters;
        starts the next segment."""
        now = self.snapshot().by_category
        high = self.high - now["params"] - now["grads"] - now["optimizer"]
        self.high = self.current
        return float(now["activations"]), float(max(0, high - now["activations"]))


def _watch_block_grads(
    blocks: Sequence[nn.Module], tracker: LiveMemory
) -> dict[int, tuple[float, float, float]]:
    """Snapshots (filled during backward) of what is live when each block's last gradient arrives."""
    done: dict[int, tuple[float, float, float]] = {}
    for i, block in enumerate(blocks):
        params = [p for p in block.parameters() if p.requires_grad]
        left = [len(params)]

        def hook(_: torch.Tensor, i: int = i, left: list[int] = left) -> None:
            left[0] -= 1
            if left[0] == 0:
                now = tracker.snapshot().by_category
                done[i] = (float(now["activations"]), float(now["temporaries"]), float(now["grads"]))

        for p in params:
            p.register_post_accumulate_grad_hook(hook)
    return done
