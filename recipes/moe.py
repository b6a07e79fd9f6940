"""A small Mixtral-style mixture-of-experts model (transformers' ``MixtralForCausalLM``) trained with
fsdp_blocks and expert parallelism.

Every MoE layer's experts are split over ``expert_parallel_size`` of the data-parallel ranks: each rank
keeps ``num_local_experts / expert_parallel_size`` experts of every layer, the tokens travel to the ranks
of the experts their router chose and back by all-to-all, and everything else (attention, routers, norms,
embeddings) is FSDP-sharded over all ranks as without it. The model is transformers' own, built from the
sizes in the config (no download, no pretrained weights); the strategy finds its MoE layers (the
``MixtralExperts`` of every decoder layer). The loss is the next-byte cross-entropy plus the model's
load-balancing loss (``router_aux_loss_coef x aux_loss``), as Mixtral was trained. Byte-level data as in
the GPT recipe. Needs transformers (the ``moe`` extra: ``pip install -e ".[recipes,moe]"``; tested with
transformers 5, which stores the experts stacked).

Config: configs/moe_ep.yaml (header: launch commands). Quick start on one machine, 2 CPU processes:

    python recipes/moe.py fit --config recipes/configs/moe_ep.yaml
"""

from __future__ import annotations

import math

import lightning as L
import torch
import torch.nn.functional as F
from optimization import adamw_warmup_cosine
from text_data import ByteTextData
from torch import nn
from training_logs import RecipeCLI

from lit_parallel.parallel import expert_parameter_count


def mixtral(
    vocab_size: int,
    max_seq_len: int,
    dim: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int,
    hidden_dim: int,
    num_experts: int,
    top_k: int,
    router_aux_loss_coef: float,
) -> nn.Module:
    """transformers' ``MixtralForCausalLM`` of these sizes, randomly initialised."""
    try:
        from transformers import MixtralConfig, MixtralForCausalLM
    except ImportError as error:
        raise ImportError(
            "recipes/moe.py builds transformers' MixtralForCausalLM, and transformers is not installed:"
            ' pip install -e ".[recipes,moe]" (or pip install transformers)'
        ) from error
    config = MixtralConfig(
        vocab_size=vocab_size,
        hidden_size=dim,
        intermediate_size=hidden_dim,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv_heads,
        num_local_experts=num_experts,
        num_experts_per_tok=top_k,
        max_position_embeddings=max_seq_len,
        output_router_logits=True,  # the model returns its load-balancing loss as ``aux_loss``
        router_aux_loss_coef=router_aux_loss_coef,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return MixtralForCausalLM(config)


class MoELanguageModel(L.LightningModule):
    """Next-byte prediction with AdamW, linear warm-up and cosine decay.

    Args:
        vocab_size, max_seq_len: filled in from the data.
        dim, n_layers, n_heads, n_kv_heads, hidden_dim: the transformer's size (``hidden_dim``: one
            expert's SwiGLU width).
        num_experts, top_k: experts per MoE layer and experts each token uses. ``expert_parallel_size``
            (the strategy's) must divide ``num_experts``.
        router_aux_loss_coef: weight of the load-balancing loss in the training loss.
        lr, weight_decay, warmup_steps: the optimizer and schedule.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        max_seq_len: int = 128,
        dim: int = 64,
        n_layers: int = 2,
        n_heads: int = 4,
        n_kv_heads: int = 2,
        hidden_dim: int = 128,
        num_experts: int = 4,
        top_k: int = 2,
        router_aux_loss_coef: float = 0.02,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 20,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = mixtral(
            vocab_size,
            max_seq_len,
            dim,
            n_layers,
            n_heads,
            n_kv_heads,
            hidden_dim,
            num_experts,
            top_k,
            router_aux_loss_coef,
        )
        # FLOPs of a training step per token, for FLOP/s and MFU in the throughput log: 6 per weight a token
        # uses (forward and backward: each token runs top_k of the num_experts experts) and the attention
        # scores, 12 x layers x sequence x dim (a meta-device count, as the other recipes do, cannot run the
        # experts' routing)
        experts = expert_parameter_count(self.model)
        active = sum(p.numel() for p in self.model.parameters()) - experts * (1 - top_k / num_experts)
        self.flops_per_token = 6 * active + 12 * n_layers * max_seq_len * dim
        self.flops_per_batch: int | None = None

    def forward(self, tokens: torch.Tensor):
        return self.model(input_ids=tokens)

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        self.flops_per_batch = int(self.flops_per_token * batch[0].numel())

    def _losses(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, targets = batch
        out = self(tokens)
        ce = F.cross_entropy(out.logits.reshape(-1, out.logits.size(-1)), targets.reshape(-1))
        return ce, out.aux_loss

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        ce, aux = self._losses(batch)
        self.log("train_loss", ce, prog_bar=True)
        # top_k when the router spreads the tokens evenly over the experts, more when it favours some
        self.log("train_load_balance", aux)
        return ce + self.hparams.router_aux_loss_coef * aux

    def validation_step(self, batch, batch_idx: int) -> None:
        ce, _ = self._losses(batch)
        self.log("val_loss", ce, prog_bar=True, sync_dist=True)
        self.log("val_bits_per_byte", ce / math.log(2), sync_dist=True)

    def configure_optimizers(self):
        return adamw_warmup_cosine(self)


class MoECLI(RecipeCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data.block_size", "model.max_seq_len")
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")


def main(args: list[str] | None = None) -> MoECLI:
    return MoECLI(MoELanguageModel, ByteTextData, args=args)


if __name__ == "__main__":
    main()
