"""Fused attention on the meta device, so that simulated steps save what real ones save.

On CPU and CUDA, ``F.scaled_dot_product_attention`` runs a fused (flash) kernel that saves the output
and one log-sum-exp per row for backward. On the meta device it falls back to the unfused math, which
saves the full attention matrix (batch x heads x seq x seq): a simulated step would then predict far
more activation memory than a real one uses. :func:`fused_attention_on_meta` routes meta calls that a
fused kernel would take (no dropout, 4-D inputs; grouped-query heads as they are) to the fused op's meta
implementation instead; a mask that needs a gradient (T5's relative position bias) keeps the math path,
as it does on a real device.

The same mode lets a grouped matrix product (``torch._grouped_mm``, which transformers' MoE experts call
through ``F.grouped_mm``) run on meta in every dtype: its meta implementation takes bfloat16 only, while the
CPU kernel a real step runs takes float32 too. On meta, outside bfloat16, a stand-in returns the product's
shape and saves what the real op saves for backward (both operands), and its backward allocates the two
gradients, so a simulated step of an MoE model holds what a real one holds.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_ORIGINAL = F.scaled_dot_product_attention


class _FusedAttention(TorchFunctionMode):
    def __init__(self, attention: bool = True) -> None:
        super().__init__()
        self.attention = attention

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.attention and (func is F.scaled_dot_product_attention or func is _ORIGINAL):
            out = _fused(*args, **kwargs)
            if out is not None:
                return out
        if func in _GROUPED_MM:
            out = _grouped_mm_on_meta(*args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


_GROUPED_MM = tuple(f for f in (getattr(F, "grouped_mm", None), getattr(torch, "_grouped_mm", None)) if f)


class _MetaGroupedMM(torch.autograd.Function):
    """``a [S, K] @ b [G, K, N]`` by groups of rows, on meta: shapes only; saves both operands, as the real
    op does, and allocates both gradients in backward."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return a.new_empty((a.shape[0], b.shape[-1]))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, b = ctx.saved_tensors
        grad_a = torch.empty_like(a) if ctx.needs_input_grad[0] else None
        grad_b = torch.empty_like(b) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b, None


def _grouped_mm_on_meta(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """The stand-in's result for a meta call the meta kernel refuses (not bfloat16), else ``None``."""
    tensors = isinstance(mat_a, torch.Tensor) and isinstance(mat_b, torch.Tensor)
    if not tensors or not (mat_a.is_meta and mat_b.is_meta) or mat_a.dtype == torch.bfloat16:
        return None
    if mat_a.dim() != 2 or mat_b.dim() != 3 or bias is not None or out_dtype not in (None, mat_a.dtype):
        return None  # only the layout MoE experts use: rows of tokens by groups of stacked weights
    return _MetaGroupedMM.apply(mat_a, mat_b, offs)


def _fused(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    meta = all(isinstance(t, torch.Tensor) and t.is_meta and t.dim() == 4 for t in (q, k, v))
    if not meta or dropout_p:
        return None
    heads, kv_heads = q.shape[1], k.shape[1]
    if kv_heads != heads and not (enable_gqa and heads % kv_heads == 0):  # the fused kernel takes GQA as is
        return None
    if isinstance(attn_mask, torch.Tensor) and attn_mask.requires_grad:
        return None  # a learned mask (T5's position bias): the fused kernel has no gradient for it, math runs
    from lit_parallel._compat import flash_attention_for_cpu

    return flash_attention_for_cpu(q, k, v, 0.0, is_causal, attn_mask=attn_mask, scale=scale)[0]


def _sdpa(original):
    def sdpa(*args, **kwargs):
        out = _fused(*args, **kwargs)
        return original(*args, **kwargs) if out is None else out

    return sdpa


@contextmanager
def fused_attention_on_meta(attention: bool = True) -> Iterator[None]:
    """While active, meta-device ``scaled_dot_product_attention`` calls save what the fused kernel saves
    (``attention=False``: they keep the math path), and grouped matrix products run in every dtype.

    A torch-function mode catches the calls; so does ``torch.nn.functional``'s own name for the function,
    which ``multi_head_attention_forward`` (``nn.MultiheadAttention``) calls while the mode is handling
    that outer function and so cannot see it.
    """
    original = F.scaled_dot_product_attention
    if attention:
        F.scaled_dot_product_attention = _sdpa(original)
    try:
        with _FusedAttention(attention):
            yield
    finally:
        F.scaled_dot_product_attention = original
