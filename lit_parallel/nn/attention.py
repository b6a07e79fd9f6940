"""A multi-head attention that tensor parallelism can split: ``nn.MultiheadAttention`` with separate Linears.

``nn.MultiheadAttention`` keeps q, k and v in one packed ``in_proj_weight`` that torch's fused functional
path (``F.multi_head_attention_forward`` and the encoder fast path) consumes whole, so it cannot be split
column-wise in place. :class:`SplittableMultiheadAttention` computes the same function with ``q_proj``,
``k_proj``, ``v_proj`` and ``out_proj`` ``nn.Linear`` layers and ``F.scaled_dot_product_attention``, and
reads its head count from ``num_heads`` (which a tensor-parallel plan divides per rank): every shape
inside ``forward`` is derived from the projections' outputs, never from ``embed_dim``.

State dict keys differ from ``nn.MultiheadAttention``'s (``in_proj_weight`` / ``q_proj_weight`` ... become
``q_proj.weight`` ...); loading a ``nn.MultiheadAttention`` state dict into this module works (the packed
keys are split on load), and :meth:`SplittableMultiheadAttention.to_multihead_attention` converts back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class SplittableMultiheadAttention(nn.Module):
    """``nn.MultiheadAttention`` (same constructor arguments, same ``forward``) with separate q/k/v Linears.

    ``add_bias_kv`` and ``add_zero_attn`` are not supported (they append learned or zero keys that would
    have to be split per head as well). ``need_weights=True`` returns the weights of the heads this module
    holds (all of them unless tensor parallelism split it).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if add_bias_kv or add_zero_attn:
            flag = "add_bias_kv" if add_bias_kv else "add_zero_attn"
            raise ValueError(
                f"SplittableMultiheadAttention does not support {flag}=True (the extra key/value it appends"
                " would have to be split per head too); keep this nn.MultiheadAttention as it is (its"
                " attention is then replicated under tensor parallelism) or build it with"
                f" {flag}=False"
            )
        if embed_dim <= 0 or num_heads <= 0 or embed_dim % num_heads:
            raise ValueError(
                f"embed_dim={embed_dim} must be a positive multiple of num_heads={num_heads}"
                " (each head gets embed_dim // num_heads features)"
            )
        kw = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **kw)
        self.k_proj = nn.Linear(self.kdim, embed_dim, bias=bias, **kw)
        self.v_proj = nn.Linear(self.vdim, embed_dim, bias=bias, **kw)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **kw)
        # No packed projection. torch's TransformerEncoderLayer reads these before taking its fused fast
        # path (torch._transformer_encoder_layer_fwd) and steps aside when in_proj_bias is None.
        self.in_proj_weight = None
        self.in_proj_bias = None
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.register_load_state_dict_pre_hook(_split_packed_keys)

    @classmethod
    def from_multihead_attention(cls, mha: nn.MultiheadAttention) -> SplittableMultiheadAttention:
        """The equivalent module, holding exact copies of ``mha``'s weights (on their device and dtype)."""
        if mha.bias_k is not None or mha.add_zero_attn:
            flag = "add_bias_kv" if mha.bias_k is not None else "add_zero_attn"
            raise ValueError(
                f"nn.MultiheadAttention with {flag}=True cannot be converted to SplittableMultiheadAttention"
                " (the extra key/value it appends would have to be split per head too); it stays as it is"
            )
        new = cls(mha.embed_dim, mha.num_heads, **_same_configuration(mha))
        new.load_state_dict(mha.state_dict())
        new.train(mha.training)
        return new

    def to_multihead_attention(self) -> nn.MultiheadAttention:
        """The equivalent ``nn.MultiheadAttention`` (exact weight copies; the module must not be split)."""
        mha = nn.MultiheadAttention(self.embed_dim, self.num_heads, **_same_configuration(self))
        with torch.no_grad():
            projections = (self.q_proj, self.k_proj, self.v_proj)
            if mha._qkv_same_embed_dim:
                mha.in_proj_weight.copy_(torch.cat([p.weight for p in projections]))
            else:
                for name, p in zip(("q_proj_weight", "k_proj_weight", "v_proj_weight"), projections):
                    getattr(mha, name).copy_(p.weight)
            if mha.in_proj_bias is not None:
                mha.in_proj_bias.copy_(torch.cat([p.bias for p in projections]))
                mha.out_proj.bias.copy_(self.out_proj.bias)
            mha.out_proj.weight.copy_(self.out_proj.weight)
        mha.train(self.training)
        return mha

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """As ``nn.MultiheadAttention.forward``: ``(attn_output, attn_weights or None)``."""
        if is_causal and attn_mask is None:
            raise RuntimeError(
                "is_causal=True is a hint that attn_mask is causal, so it needs attn_mask; create it with"
                " nn.Transformer.generate_square_subsequent_mask(L)"
            )
        batched = query.dim() == 3
        if not batched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        # (batch, length, features) -> (batch, heads, length, head_dim); -1 heads: per-rank count
        q = self.q_proj(query)
        b, tgt_len = q.shape[:2]
        q = q.view(b, tgt_len, self.num_heads, -1).transpose(1, 2)
        k = self.k_proj(key)
        k = k.view(b, k.shape[1], self.num_heads, -1).transpose(1, 2)
        v = self.v_proj(value)
        v = v.view(b, v.shape[1], self.num_heads, -1).transpose(1, 2)
        mask = self._merged_mask(attn_mask, key_padding_mask, b, tgt_len, k.shape[2], q.dtype)
        dropout_p = self.dropout if self.training else 0.0
        weights = None
        if need_weights:
            scores = (q * self.head_dim**-0.5) @ k.transpose(-2, -1)
            weights = torch.softmax(scores if mask is None else scores + mask, dim=-1)
            attn = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
            out = attn @ v
            if average_attn_weights:
                weights = weights.mean(dim=1)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        out = self.out_proj(out.transpose(1, 2).reshape(b, tgt_len, -1))
        if not batched:
            return out.squeeze(0), None if weights is None else weights.squeeze(0)
        return (out if self.batch_first else out.transpose(0, 1)), weights

    def _merged_mask(
        self,
        attn_mask: Tensor | None,
        key_padding_mask: Tensor | None,
        b: int,
        tgt_len: int,
        src_len: int,
        dtype: torch.dtype,
    ) -> Tensor | None:
        """``attn_mask`` (L, S) or (B * heads, L, S) plus ``key_padding_mask`` (B, S), as one additive float
        mask broadcastable to (B, heads, L, S); boolean masks mark positions that are not attended."""
        mask = None
        if attn_mask is not None:
            mask = _additive(attn_mask, "attn_mask", dtype)
            if mask.dim() == 2:
                if tuple(mask.shape) != (tgt_len, src_len):
                    raise RuntimeError(
                        f"The shape of the 2D attn_mask is {tuple(mask.shape)}, but should be"
                        f" {(tgt_len, src_len)}."
                    )
            elif mask.dim() == 3:
                if tuple(mask.shape) != (b * self.num_heads, tgt_len, src_len):
                    raise RuntimeError(
                        f"The shape of the 3D attn_mask is {tuple(mask.shape)}, but should be"
                        f" {(b * self.num_heads, tgt_len, src_len)} (batch * num_heads with num_heads="
                        f"{self.num_heads} on this rank; under tensor parallelism a per-head mask cannot be"
                        " used: pass a 2D mask or a key_padding_mask)"
                    )
                mask = mask.view(b, self.num_heads, tgt_len, src_len)
            else:
                raise RuntimeError(f"attn_mask's dimension {mask.dim()} is not supported (2 or 3)")
        if key_padding_mask is not None:
            if tuple(key_padding_mask.shape) != (b, src_len):
                raise RuntimeError(
                    f"key_padding_mask has shape {tuple(key_padding_mask.shape)}; expected {(b, src_len)}"
                    " (batch, source length)"
                )
            pad = _additive(key_padding_mask, "key_padding_mask", dtype).view(b, 1, 1, src_len)
            mask = pad if mask is None else mask + pad
        return mask


def _additive(mask: Tensor, name: str, dtype: torch.dtype) -> Tensor:
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))
    if not torch.is_floating_point(mask):
        raise TypeError(f"{name} of dtype {mask.dtype} is not supported; pass a bool or float mask")
    return mask.to(dtype)


def _split_packed_keys(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
    """Accept a ``nn.MultiheadAttention`` state dict: split its packed q/k/v keys into the three Linears."""
    names = ("q_proj", "k_proj", "v_proj")
    weight = state_dict.pop(prefix + "in_proj_weight", None)
    if weight is not None:
        for name, part in zip(names, weight.chunk(3)):
            state_dict[f"{prefix}{name}.weight"] = part
    for name in names:
        separate = state_dict.pop(f"{prefix}{name}_weight", None)
        if separate is not None:
            state_dict[f"{prefix}{name}.weight"] = separate
    bias = state_dict.pop(prefix + "in_proj_bias", None)
    if bias is not None:
        for name, part in zip(names, bias.chunk(3)):
            state_dict[f"{prefix}{name}.bias"] = part


def _same_configuration(attention: nn.Module) -> dict:
    """Constructor arguments (besides sizes) that rebuild ``attention`` as either attention class."""
    weight = attention.out_proj.weight
    return {
        "dropout": attention.dropout,
        "bias": attention.out_proj.bias is not None,
        "kdim": attention.kdim,
        "vdim": attention.vdim,
        "batch_first": attention.batch_first,
        "device": weight.device,
        "dtype": weight.dtype,
    }
