"""A Llama-style model (RMSNorm, rotary embeddings, SwiGLU, grouped KV heads) trained with tp_dp.

``tp_dp`` splits every transformer block over the devices of a node (tensor parallelism: q/k/v and the
SwiGLU up/gate projections column-wise, the attention output and down projection row-wise, inferred from
the data flow) and shards the result with FSDP2 across nodes. The model is plain PyTorch, written with
per-rank sizes in mind: attention reshapes with ``view(b, t, -1, head_dim)``, so a rank that holds 1/tp
of the heads needs no change. Byte-level data as in the GPT recipe.

Config: configs/llama_tp.yaml (header: launch commands). Quick start on one machine, 2 CPU processes:

    python recipes/llama.py fit --config recipes/configs/llama_tp.yaml
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import lightning as L
import torch
import torch.nn.functional as F
from optimization import adamw_warmup_cosine
from text_data import ByteTextData
from torch import nn
from training_logs import RecipeCLI, training_flops

# --- model ----------------------------------------------------------------------------------------------


@dataclass
class LlamaConfig:
    vocab_size: int = 256
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2  # grouped-query attention: each KV head serves n_heads / n_kv_heads query heads
    hidden_dim: int = 352  # SwiGLU width (about 8/3 * dim, a multiple of 32)
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5


def rotary_tables(
    head_dim: int, seq_len: int, theta: float, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device).float(), freqs)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (batch, seq, heads, head_dim); rotate the (even, odd) pairs by position-dependent angles
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds its share of the heads
        q = self.wq(x).view(b, t, -1, self.head_dim)
        k = self.wk(x).view(b, t, -1, self.head_dim)
        v = self.wv(x).view(b, t, -1, self.head_dim)
        q, k = apply_rotary(q, cos[:t], sin[:t]), apply_rotary(k, cos[:t], sin[:t])
        groups = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)  # gate
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)  # up
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rotary_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        for name, p in self.named_parameters():
            if p.ndim == 2:
                std = (
                    0.02 / math.sqrt(2 * cfg.n_layers) if name.endswith(("wo.weight", "w2.weight")) else 0.02
                )
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, self.rope_cos, self.rope_sin)
        return self.output(self.norm(x))


# --- training -------------------------------------------------------------------------------------------


class LlamaLanguageModel(L.LightningModule):
    """Next-byte prediction with AdamW, linear warm-up and cosine decay.

    Args:
        vocab_size, max_seq_len: filled in from the data.
        dim, n_layers, n_heads, n_kv_heads, hidden_dim: the transformer's size. Under tp_dp the
            tensor-parallel size must divide n_heads and n_kv_heads (the strategy says so otherwise).
        lr, weight_decay, warmup_steps: the optimizer and schedule.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        max_seq_len: int = 128,
        dim: int = 128,
        n_layers: int = 4,
        n_heads: int = 4,
        n_kv_heads: int = 2,
        hidden_dim: int = 352,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 50,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.config = LlamaConfig(
            vocab_size=vocab_size,
            dim=dim,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            hidden_dim=hidden_dim,
            max_seq_len=max_seq_len,
        )
        self.model = Llama(self.config)
        self.flops_per_batch: int | None = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        if self.flops_per_batch is None:  # for the throughput log (MFU on GPUs)
            self.flops_per_batch = training_flops(lambda: Llama(self.config), batch[0])

    def _loss(self, batch) -> torch.Tensor:
        tokens, targets = batch
        logits = self(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        loss = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        self.log("val_bits_per_byte", loss / math.log(2), sync_dist=True)

    def configure_optimizers(self):
        return adamw_warmup_cosine(self)


class LlamaCLI(RecipeCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data.block_size", "model.max_seq_len")
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")


def main(args: list[str] | None = None) -> LlamaCLI:
    return LlamaCLI(LlamaLanguageModel, ByteTextData, args=args)


if __name__ == "__main__":
    main()
