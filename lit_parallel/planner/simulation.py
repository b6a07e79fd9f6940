"""One training step's forward, loss and backward simulated on the meta device: what is live when.

Only shapes are computed (meta tensors), so a model of any size is simulated without memory. The step
is the one the planner predicts and ``advise --verify`` measures: ``loss = default_loss(model(x), x)``,
``loss.backward()``. :class:`~lit_parallel.measure.live_memory.LiveMemory` counts what is live: at the end
of forward (the highest point of forward and loss) and at the peak of backward (gradients arriving
while activations are freed). The model state around it (parameters, last step's gradients, optimizer
state) is accounted for by :mod:`lit_parallel.planner.memory.peak`, not simulated.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lit_parallel._compat import tree_flatten
from lit_parallel.measure.live_memory import LiveMemory, MemoryPeak, Moment
from lit_parallel.parallel.example_inputs import meta_example_input, to_meta
from lit_parallel.planner.activations import forward_target
from lit_parallel.planner.fused_attention import fused_attention_on_meta


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
        backward_head, backward_blocks: the highest points of backward before the last block's backward
            starts (the loss, the head: FSDP has no block gathered yet) and from then on (``None`` without
            blocks); ``backward_peak`` is the larger.
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
        moe_calls: ``(rows, hidden, top_k, num_experts)`` of each MoE layer call in the forward (tokens
            routed, their width, experts per token, experts in the layer; ``top_k`` ``None`` where the layer
            does not state it): what expert parallelism's all-to-alls carry.
    """

    forward_peak: MemoryPeak
    backward_peak: MemoryPeak
    backward_head: MemoryPeak | None
    backward_blocks: MemoryPeak | None
    block_starts: tuple[tuple[float, float], ...]
    model_end: tuple[float, float]
    block_inside: tuple[tuple[float, float], ...]
    block_after: tuple[tuple[float, float], ...]
    block_grads_done: tuple[tuple[float, float, float], ...]
    saved_bytes: float
    grad_bytes: float
    batch_size: int
    input_description: str
    moe_calls: tuple[tuple[int, int, int | None, int], ...] = ()


def _watch_moe_calls(module: nn.Module) -> tuple[list[tuple[int, int, int | None, int]], list[Any]]:
    """Forward pre-hooks recording ``(rows, hidden, top_k, num_experts)`` of each MoE layer call of ``module`` (a
    stacked-experts module is called with the routing: ``hidden_states [T, H], top_k_index [T, k]``; a
    module-list layer with its input ``[..., H]`` and keeps its top-k as an attribute)."""
    from lit_parallel.parallel.expert_parallel import find_moe_layers

    calls: list[tuple[int, int, int | None, int]] = []
    handles = []
    try:
        layers = find_moe_layers(module)
    except ValueError:  # experts already split by transformers' own expert parallelism
        layers = []
    for layer in layers:

        def hook(m: nn.Module, args: tuple, kwargs: dict, layer: Any = layer) -> None:
            x = args[0] if args else next(iter(kwargs.values()), None)
            if not isinstance(x, torch.Tensor) or x.dim() == 0:
                return
            top_k = layer.top_k
            if layer.kind == "stacked":
                index = args[1] if len(args) > 1 else kwargs.get("top_k_index")
                top_k = index.shape[-1] if isinstance(index, torch.Tensor) and index.dim() else None
            calls.append((x.numel() // x.shape[-1], x.shape[-1], top_k, layer.num_experts))

        handles.append(layer.module.register_forward_pre_hook(hook, with_kwargs=True))
    return calls, handles


class _BlockMoments:
    """Forward hooks on the blocks: what is live at each block's start, and the highest points inside each
    block and between it and the next (or the model's end); split by :meth:`pairs` once the step is over."""

    def __init__(self, tracker: _Segments, blocks: list[nn.Module]) -> None:
        self.tracker = tracker
        self.starts: list[Moment] = []
        self.inside: list[Moment] = []
        self.after: list[Moment] = []
        self.handles = [b.register_forward_pre_hook(self._at_start) for b in blocks]
        self.handles += [b.register_forward_hook(self._at_end) for b in blocks]
        self._output_hook: Any = None
        self.head: Moment | None = None  # backward's highest point before the blocks' backward

    def _at_start(self, module: nn.Module, inputs: Any) -> None:
        if self.starts:
            self.after.append(self.tracker.segment())
        self.starts.append(self.tracker.moment())
        self.tracker.segment()

    def _at_end(self, module: nn.Module, inputs: Any, output: Any) -> None:
        self.inside.append(self.tracker.segment())
        # the gradient of the last block's output starts that block's backward: the head's part ends
        if self._output_hook is not None:
            self._output_hook.remove()
        first = next(
            (t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad), None
        )
        self._output_hook = first.register_hook(self._blocks_backward) if first is not None else None

    def _blocks_backward(self, grad: torch.Tensor) -> None:
        if self.head is None:
            self.head = self.tracker.peak_moment()
            self.tracker.reset_peak()

    def finish(self) -> None:
        """At the end of forward: remove the hooks, close the last block's segment."""
        for h in self.handles:
            h.remove()
        last = self.tracker.segment(last=True)
        if self.starts:
            self.after.append(last)

    def pairs(self, moments: list[Moment]) -> tuple[tuple[float, float], ...]:
        """``(activations, temporaries)`` of each moment, every storage's role known (the step is over)."""
        return tuple(self.tracker.pair(m) for m in moments)


def _meta_model(
    module: nn.Module, dtype: torch.dtype, block_names: Sequence[str], activation_checkpointing: bool
) -> tuple[nn.Module, list[nn.Module]]:
    """A meta copy of ``module`` and its blocks (by name), each block checkpointed when asked."""
    from lit_parallel.parallel.parallelize import apply_activation_checkpointing

    meta = meta_copy(module, dtype)
    blocks = [meta.get_submodule(name) for name in block_names]
    if activation_checkpointing:
        for block in blocks:
            apply_activation_checkpointing(block)
    return meta, blocks


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
    example = meta_example_input(module, batch_size=batch_size, seq_len=seq_len, given=example_inputs)
    meta, blocks = _meta_model(module, dtype, block_names, activation_checkpointing)
    args = tuple(to_meta(a, dtype) for a in example.args)
    target = forward_target(meta, blocks)
    tracker = _Segments(list(meta.parameters()), exact=False, meta=True)
    # fused attention is simulated without checkpointing only: recomputation must see the same ops
    attention = fused_attention_on_meta(attention=not activation_checkpointing)
    moments = _BlockMoments(tracker, blocks)
    moe_calls, handles = _watch_moe_calls(meta)
    # every moment is split once the step is over, as the measured peak is: a storage saved for backward
    # after a moment (a block's output the next block saves) is an activation at that moment too
    with attention, tracker:
        output = target(*args)
        for handle in handles:  # the forward's calls only (checkpointing recomputes them in backward)
            handle.remove()
        moments.finish()
        model_end = tracker.moment()
        loss = default_loss(output, args)
        del output
        done = _watch_block_grads(blocks, tracker)
        forward_peak, forward_end = tracker.peak_moment(), tracker.moment()
        tracker.reset_peak()
        loss.backward()
        del loss
    grads = sum(p.grad.untyped_storage().nbytes() for p in meta.parameters() if p.grad is not None)
    head = tracker.split(moments.head) if moments.head is not None else None
    return StepSimulation(
        forward_peak=tracker.split(forward_peak),
        backward_peak=max(tracker.peak, head or tracker.peak, key=lambda m: m.total),
        backward_head=head,
        backward_blocks=tracker.peak if head is not None else None,
        block_starts=moments.pairs(moments.starts),
        model_end=tracker.pair(model_end),
        block_inside=moments.pairs(moments.inside),
        block_after=moments.pairs(moments.after),
        block_grads_done=tuple(_triple(tracker.split(done[i])) for i in sorted(done)),
        saved_bytes=float(tracker.split(forward_end).by_category["activations"]),
        grad_bytes=float(grads),
        batch_size=example.batch_size,
        input_description=example.description,
        moe_calls=tuple(moe_calls),
    )


class _Segments(LiveMemory):
    """:class:`LiveMemory` that also keeps the highest point since the last :meth:`segment` call."""

    high: float = 0
    _high = Moment({})

    def _add(self, t: torch.Tensor) -> int | None:
        alloc = super()._add(t)
        if self.current > self.high:
            self.high, self._high = self.current, self.moment()
        return alloc

    def segment(self, last: bool = False) -> Moment:
        """What was live at the highest point since the last call (or since tracking started); starts the
        next segment, or with ``last`` stops following the highest point."""
        high = self._high
        self.high, self._high = math.inf if last else self.current, self.moment()
        return high

    def pair(self, moment: Moment) -> tuple[float, float]:
        """``(activations, temporaries)`` of a moment: the bytes beyond the model state."""
        split = self.split(moment).by_category
        return float(split["activations"]), float(split["temporaries"])


def _triple(peak: MemoryPeak) -> tuple[float, float, float]:
    now = peak.by_category
    return float(now["activations"]), float(now["temporaries"]), float(now["grads"])


def _watch_block_grads(blocks: Sequence[nn.Module], tracker: LiveMemory) -> dict[int, Moment]:
    """Moments (taken during backward) when each block's last gradient arrives."""
    done: dict[int, Moment] = {}
    for i, block in enumerate(blocks):
        params = [p for p in block.parameters() if p.requires_grad]
        left = [len(params)]

        def hook(_: torch.Tensor, i: int = i, left: list[int] = left) -> None:
            left[0] -= 1
            if left[0] == 0:
                done[i] = tracker.moment()

        for p in params:
            p.register_post_accumulate_grad_hook(hook)
    return done
