"""Tiny models for the tensor-parallel tests, written the way users write them (no lit_parallel imports).

tests/models.py has the Llama-style model the TP tests use as is. Its GPT splits the fused qkv output by
the full width taken from ``x.shape`` (``.split(c, dim=2)``), which no per-rank shard can satisfy (the
tests check that the plan refuses it clearly). Here:

- :class:`TPGPT`: GPT-style (LayerNorm, fused qkv, GELU MLP) written with per-rank sizes in mind:
  ``.chunk(3, dim=-1)`` and ``view(b, t, self.n_head, self.head_dim)``, so the head-count attribute
  must be divided by the tensor-parallel size.
- :class:`FlatLlama`: the Llama block of tests/models.py with its seven Linears directly in the block and
  named ``l1`` .. ``l7`` (nothing for a name-based plan to go on).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tests.models import Llama, LlamaConfig, _apply_rope


@dataclass
class TPGPTConfig:
    vocab_size: int = 64
    block_size: int = 16
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 32


class TPGPTAttention(nn.Module):
    def __init__(self, cfg: TPGPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, self.n_head, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, -1))


class TPGPTMLP(nn.Module):
    def __init__(self, cfg: TPGPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class TPGPTBlock(nn.Module):
    def __init__(self, cfg: TPGPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = TPGPTAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = TPGPTMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TPGPT(nn.Module):
    def __init__(self, cfg: TPGPTConfig | None = None):
        super().__init__()
        cfg = cfg or TPGPTConfig()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList(TPGPTBlock(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class FlatLlamaBlock(nn.Module):
    """tests.models.LlamaBlock with anonymous Linears: l1..l4 attention (q, k, v, out), l5..l7 SwiGLU
    (gate, up, down), all direct children of the block."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        hd = cfg.dim // cfg.n_heads
        self.head_dim = hd
        self.norm_a = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.l1 = nn.Linear(cfg.dim, cfg.n_heads * hd, bias=False)
        self.l2 = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.l3 = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.l4 = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=False)
        self.norm_b = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.l5 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.l6 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.l7 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.norm_a(x)
        q = self.l1(h).view(b, t, -1, self.head_dim)
        k = self.l2(h).view(b, t, -1, self.head_dim)
        v = self.l3(h).view(b, t, -1, self.head_dim)
        q, k = _apply_rope(q, cos[:t], sin[:t]), _apply_rope(k, cos[:t], sin[:t])
        rep = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.l4(y.transpose(1, 2).reshape(b, t, -1))
        h = self.norm_b(x)
        return x + self.l7(F.silu(self.l5(h)) * self.l6(h))


class FlatLlama(Llama):
    def __init__(self, cfg: LlamaConfig | None = None):
        super().__init__(cfg)
        self.layers = nn.ModuleList(FlatLlamaBlock(self.cfg) for _ in range(self.cfg.n_layers))
