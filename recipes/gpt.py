"""A byte-level GPT (decoder-only transformer) trained with fsdp_blocks, hsdp across nodes, or pp_dp.

The model is plain PyTorch and knows nothing about parallelism: ``fsdp_blocks`` finds its transformer
blocks (the ``GPTBlock`` entries of ``self.model.h``) and shards each one with FSDP2; ``hsdp`` does the
same inside a node and replicates across nodes. Checkpoints are sharded (one file per rank); turn one
into a plain ``state_dict`` file with ``lit-parallel consolidate CHECKPOINT out.pt --strip-prefix model.``.

Data: the source code of Python's standard library (on every machine), or ``--data.path=your.txt``.
Configs: configs/gpt_fsdp.yaml (one node), configs/gpt_hsdp.yaml (several nodes) and configs/gpt_pp.yaml
(pp_dp: pipeline stages, the loss from ``pipeline_loss``); their headers have the launch commands. Quick start on one machine, 2 CPU processes:

    python recipes/gpt.py fit --config recipes/configs/gpt_fsdp.yaml
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

# --- model (nanoGPT's layout) ---------------------------------------------------------------------------


@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)  # q, k, v in one matrix
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, self.n_head, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class GPTBlock(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: residual projections scaled by depth
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


# --- training -------------------------------------------------------------------------------------------


class GPTLanguageModel(L.LightningModule):
    """Next-byte prediction with AdamW, linear warm-up and cosine decay.

    Args:
        vocab_size, block_size: filled in from the data.
        n_layer, n_head, n_embd, dropout: the transformer's size.
        lr: peak learning rate; warmup_steps: linear warm-up from 0.
        weight_decay: applied to matrices only (not to norms, biases or embeddings' positions).
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 50,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.config = GPTConfig(
            vocab_size=vocab_size,
            block_size=block_size,
            n_layer=n_layer,
            n_head=n_head,
            n_embd=n_embd,
            dropout=dropout,
        )
        self.model = GPT(self.config)
        self.flops_per_batch: int | None = None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        if self.flops_per_batch is None:  # for the throughput log (MFU on GPUs)
            self.flops_per_batch = training_flops(lambda: GPT(self.config), batch[0])

    def _loss(self, batch) -> torch.Tensor:
        idx, targets = batch
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    def pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of one micro-batch under pp_dp (which pipelines ``forward`` and logs train/val loss)."""
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


class GPTCLI(RecipeCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data.block_size", "model.block_size")
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")


def main(args: list[str] | None = None) -> GPTCLI:
    return GPTCLI(GPTLanguageModel, ByteTextData, args=args)


if __name__ == "__main__":
    main()
