"""Production-shaped models for tests, always built on the meta device (no memory is used).

- :func:`llama_70b`: transformers' ``LlamaForCausalLM`` in Llama-3-70B's shape; :data:`LLAMA_70B_PARAMS`
  and :data:`LLAMA_70B_BLOCK_PARAMS` are its parameter counts, written out from the shape.
"""

from __future__ import annotations

import torch
from torch import nn

HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE, VOCAB = 8192, 80, 64, 8, 28672, 128256
SEQ_LEN = 2048  # max_position_embeddings: the sequence the advisor's activation estimate traces
_KV_DIM = KV_HEADS * (HIDDEN // HEADS)
# q_proj and o_proj (hidden x hidden), k_proj and v_proj (hidden x kv heads x head dim), the SwiGLU MLP's gate,
# up and down projections (hidden x intermediate), two RMSNorm weights; no biases
LLAMA_70B_BLOCK_PARAMS = 2 * HIDDEN * HIDDEN + 2 * HIDDEN * _KV_DIM + 3 * HIDDEN * INTERMEDIATE + 2 * HIDDEN
# the token embedding and the output head (vocabulary x hidden each, not tied), the blocks, the final RMSNorm
LLAMA_70B_PARAMS = 2 * VOCAB * HIDDEN + LAYERS * LLAMA_70B_BLOCK_PARAMS + HIDDEN


def llama_70b() -> nn.Module:
    """A Llama-3-70B-shaped ``LlamaForCausalLM`` on the meta device (70,553,706,496 parameters)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        intermediate_size=INTERMEDIATE,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ_LEN,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        return LlamaForCausalLM(config)
