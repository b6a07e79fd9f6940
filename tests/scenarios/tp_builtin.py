"""Scenarios for tensor parallelism on torch's built-in transformer layers (nn.MultiheadAttention converted
to SplittableMultiheadAttention) and on a plain MLP (column/row pairs on its Linear chains), without a
Trainer. Each returns the loss, the full gradients and the per-rank share of every split parameter; the
test compares them with the unsplit plain PyTorch model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lit_parallel.parallel import ParallelDims, apply_tp, infer_tp_plan

VOCAB, WIDTH, HEADS, SEQ, BATCH = 13, 16, 4, 6, 3


class EncoderDecoder(nn.Module):
    """Tokens -> nn.TransformerEncoder -> memory of nn.TransformerDecoder (causal) -> logits."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, HEADS, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2)
        dec_layer = nn.TransformerDecoderLayer(
            WIDTH, HEADS, 32, dropout=0.0, batch_first=True, norm_first=True
        )
        self.decoder = nn.TransformerDecoder(dec_layer, 2)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        pad = tokens == 0  # token 0 is padding for the encoder
        memory = self.encoder(x, src_key_padding_mask=pad)
        causal = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        out = self.decoder(x, memory, tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=pad)
        return self.head(out)


def build_model(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "encoder_decoder":
        return EncoderDecoder()
    return nn.Sequential(
        nn.Linear(WIDTH, 32), nn.Tanh(), nn.Linear(32, WIDTH), nn.GELU(), nn.Linear(WIDTH, VOCAB)
    )


def batch(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    if name == "encoder_decoder":
        tokens = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
        tokens[0, -2:] = 0
        return tokens, targets
    return torch.randn(BATCH, SEQ, WIDTH, generator=g), targets


def loss_of(model: nn.Module, name: str) -> torch.Tensor:
    inputs, targets = batch(name)
    return F.cross_entropy(model(inputs).reshape(-1, VOCAB), targets.reshape(-1))


def _split_and_backward(name: str) -> dict:
    from torch.distributed.tensor import DTensor

    model = build_model(name)
    dims = ParallelDims(world_size=dist.get_world_size(), tensor_parallel=dist.get_world_size())
    mesh = dims.build_mesh("cpu")
    plan = infer_tp_plan(model, dims.tensor_parallel)
    apply_tp(model, mesh["tensor_parallel"], plan)
    loss = loss_of(model, name)
    loss.backward()
    grads, shares = {}, {}
    for n, p in model.named_parameters():
        if isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements):
            shares[n] = (p.to_local().numel(), p.numel())  # row-parallel biases are replicated
        g = p.grad
        grads[n] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
    return {
        "loss": loss.detach().clone(),
        "grads": grads,
        "shares": shares,
        "split": sorted(layer.path for layer in plan.split),
        "notes": list(plan.notes),
    }


def encoder_decoder_tp2(ctx) -> dict:
    return _split_and_backward("encoder_decoder")


def mlp_tp2(ctx) -> dict:
    return _split_and_backward("mlp")
