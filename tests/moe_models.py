"""MoE models for the expert-parallel tests: tiny transformers configs (built in code) and a hand-written
MoE of the kind most training code holds (an ``nn.ModuleList`` of expert MLPs and a linear router)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, HIDDEN, EXPERTS, TOP_K = 64, 16, 4, 2


# what every transformers test config shares: tiny sizes, top-2 routing, the load-balancing loss on, eager attention
_SHARED = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    num_attention_heads=2,
    num_key_value_heads=2,
    num_experts_per_tok=TOP_K,
    output_router_logits=True,
    router_aux_loss_coef=0.02,
    max_position_embeddings=64,
    attn_implementation="eager",
)


def mixtral(seed: int = 0, experts: int = EXPERTS, layers: int = 2) -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    config = MixtralConfig(
        **_SHARED,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_local_experts=experts,
    )
    return MixtralForCausalLM(config)


def qwen2_moe(seed: int = 0, experts: int = EXPERTS, layers: int = 2) -> nn.Module:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen2MoeConfig(
        **_SHARED,
        intermediate_size=32,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=32,
        num_hidden_layers=layers,
        num_experts=experts,
        norm_topk_prob=False,
    )
    return Qwen2MoeForCausalLM(config)


def olmoe(seed: int = 0, experts: int = EXPERTS, layers: int = 2) -> nn.Module:
    from transformers import OlmoeConfig, OlmoeForCausalLM

    torch.manual_seed(seed)
    config = OlmoeConfig(
        **_SHARED,
        intermediate_size=24,
        num_hidden_layers=layers,
        num_experts=experts,
    )
    return OlmoeForCausalLM(config)


class ExpertMLP(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, inner, bias=False)
        self.w2 = nn.Linear(inner, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inner, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class HandMoE(nn.Module):
    """Softmax router, top-k, renormalised weights, a loop over ``self.experts``; keeps its load-balancing
    loss in ``self.aux_loss`` (Switch Transformer's: experts x mean fraction x mean probability)."""

    def __init__(self, hidden: int = HIDDEN, experts: int = EXPERTS, top_k: int = TOP_K):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList([ExpertMLP(hidden, 2 * hidden) for _ in range(experts)])
        self.aux_loss = torch.zeros(())

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = self.gate(x).softmax(-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == i)
            out = out.index_add(0, token, expert(x[token]) * weights[token, slot, None])
        fraction = F.one_hot(chosen, len(self.experts)).float().sum(1).mean(0)
        self.aux_loss = len(self.experts) * (fraction * probs.mean(0)).sum()
        return out.reshape(shape)


class HandAttention(nn.Module):
    def __init__(self, hidden: int = HIDDEN, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.o_proj = nn.Linear(hidden, hidden)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (
            p(x).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class HandBlock(nn.Module):
    def __init__(self, hidden: int = HIDDEN):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden)
        self.attn = HandAttention(hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.moe = HandMoE(hidden)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.moe(self.norm2(x))


class HandMoELM(nn.Module):
    """A tiny causal LM of HandBlocks; ``aux_loss()`` sums the blocks' load-balancing losses."""

    def __init__(self, layers: int = 2, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList([HandBlock() for _ in range(layers)])
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def aux_loss(self) -> torch.Tensor:
        return sum(block.moe.aux_loss for block in self.blocks)


def hand_moe(seed: int = 0) -> nn.Module:
    return HandMoELM(seed=seed)


MODELS = {"mixtral": mixtral, "qwen2_moe": qwen2_moe, "olmoe": olmoe, "hand": hand_moe}


def lm_loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy plus the model's load-balancing loss (transformers' own for HF models)."""
    if isinstance(model, HandMoELM):
        logits = model(tokens)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()) + 0.02 * model.aux_loss()
    out = model(input_ids=tokens)
    ce = F.cross_entropy(out.logits.flatten(0, 1).float(), targets.flatten())
    return ce + model.config.router_aux_loss_coef * out.aux_loss
