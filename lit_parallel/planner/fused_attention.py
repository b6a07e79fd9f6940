"""Fused attention on the meta device, so that simulated steps save what real ones save.

On CPU and CUDA, ``F.scaled_dot_product_attention`` runs a fused (flash) kernel that saves the output
and one log-sum-exp per row for backward. On the meta device it falls back to the unfused math, which
saves the full attention matrix (batch x heads x seq x seq): a simulated step would then predict far
more activation memory than a real one uses. :func:`fused_attention_on_meta` routes meta calls that a
fused kernel would take (no dropout, 4-D inputs; grouped-query heads as they are) to the fused op's meta
implementation instead; a mask that needs a gradient (T5's relative position bias) keeps the math path,
as it does on a real device.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_ORIGINAL = F.scaled_dot_product_attention


class _FusedAttention(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention or func is _ORIGINAL:
            out = _fused(*args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


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
def fused_attention_on_meta() -> Iterator[None]:
    """While active, meta-device ``scaled_dot_product_attention`` calls save what the fused kernel saves.

    A torch-function mode catches the calls; so does ``torch.nn.functional``'s own name for the function,
    which ``multi_head_attention_forward`` (``nn.MultiheadAttention``) calls while the mode is handling
    that outer function and so cannot see it.
    """
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _sdpa(original)
    try:
        with _FusedAttention():
            yield
    finally:
        F.scaled_dot_product_attention = original
