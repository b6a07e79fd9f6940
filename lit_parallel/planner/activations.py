"""Activation memory of one forward, traced on the meta device: the bytes autograd keeps for backward.

Only shapes are computed (meta tensors), so a model of any size is measured without memory. Saved tensors
are attributed to the transformer block running when they are saved, which is what tensor parallelism
divides.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lit_parallel._compat import storage_key
from lit_parallel.parallel.example_inputs import meta_example_input, to_meta
from lit_parallel.planner.fused_attention import fused_attention_on_meta
from lit_parallel.planner.precision import precision_bytes


@dataclass(frozen=True)
class ActivationEstimate:
    """Bytes autograd keeps for backward in one forward of one micro-batch (parameters excluded).

    Attributes:
        total_bytes: the whole model.
        block_bytes: inside transformer blocks (the part tensor parallelism divides).
        largest_block_bytes: the largest single block.
        batch_size: the micro-batch the estimate is for.
        input_description: the input that was traced.
    """

    total_bytes: float
    block_bytes: float
    largest_block_bytes: float
    batch_size: int
    input_description: str


def _overrides_forward(module: nn.Module) -> bool:
    forward = type(module).forward
    return forward is not nn.Module.forward and not forward.__qualname__.startswith("LightningModule.")


def forward_target(module: nn.Module, blocks: Sequence[nn.Module]) -> nn.Module:
    """The module whose forward to trace: ``module``, or (a LightningModule without ``forward``) the
    child that holds the blocks, e.g. ``self.model``."""
    if _overrides_forward(module) or not blocks:
        return module
    ids = {id(b) for b in blocks}
    for child in module.children():
        if _overrides_forward(child) and ids <= {id(m) for m in child.modules()}:
            return child
    return module


def _pop_hook(stack: list[int]) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any, output: Any) -> None:  # returns None: keeps the output
        stack.pop()

    return hook


def _meta_state(target: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Meta stand-ins of ``target``'s parameters and buffers, floating ones in the compute dtype."""
    stand_ins = {
        name: torch.empty(
            p.shape, dtype=dtype if p.is_floating_point() else p.dtype, device="meta"
        ).requires_grad_(p.requires_grad and p.is_floating_point())
        for name, p in target.named_parameters()
    }
    stand_ins.update({name: to_meta(t, dtype) for name, t in target.named_buffers()})
    return stand_ins


def _saved_bytes(
    target: nn.Module, state: dict[str, torch.Tensor], args: tuple, blocks: Sequence[nn.Module]
) -> tuple[float, list[float]]:
    """Bytes saved for backward in one forward of ``target``: in total, and per block."""
    from torch.func import functional_call

    # storages are keyed by identity (storage_key): several saved views of one storage are counted once
    param_storages = {storage_key(t) for t in state.values()}
    seen: dict[int, int] = {}
    owner: dict[int, int] = {}
    stack: list[int] = []
    handles = []
    for i, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(lambda m, a, i=i: stack.append(i)))
        handles.append(block.register_forward_hook(_pop_hook(stack)))

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key not in param_storages and key not in seen:
            seen[key] = t.untyped_storage().nbytes()
            owner[key] = stack[-1] if stack else -1
        return t

    try:
        with fused_attention_on_meta(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = functional_call(target, state, args, strict=False)
    finally:
        for h in handles:
            h.remove()
    del out
    per_block = [0.0] * len(blocks)
    for key, nbytes in seen.items():
        if owner[key] >= 0:
            per_block[owner[key]] += nbytes
    return float(sum(seen.values())), per_block


def estimate_activations(
    module: nn.Module,
    *,
    precision: str = "bf16-mixed",
    batch_size: int | None = None,
    seq_len: int | None = None,
    example_inputs: Any = None,
    blocks: Sequence[nn.Module] = (),
) -> ActivationEstimate:
    """Bytes autograd saves for backward in one forward, traced on the meta device (no memory used).

    The forward runs on meta-device stand-ins of the parameters and buffers (``torch.func.functional_call``),
    in the compute dtype of ``precision``. Every tensor saved for backward is counted once (by storage);
    parameters are not activations. Saved tensors are attributed to the block running when they are
    saved.
    """
    dtype = torch.bfloat16 if precision_bytes(precision).compute == 2 else torch.float32
    example = meta_example_input(module, batch_size=batch_size, seq_len=seq_len, given=example_inputs)
    args = tuple(to_meta(a, dtype) for a in example.args)
    target = forward_target(module, blocks)
    total, per_block = _saved_bytes(target, _meta_state(target, dtype), args, blocks)
    return ActivationEstimate(
        total_bytes=total,
        block_bytes=float(sum(per_block)),
        largest_block_bytes=float(max(per_block, default=0.0)),
        batch_size=example.batch_size,
        input_description=example.description,
    )
