"""One tensor-parallel rank's model on meta (lit_parallel/planner/memory/tensor_parallel.py), what tp_dp's memory is
predicted from; checked against a real launch's measured optimizer state in tests/commands/advise/test_advise.py."""

from __future__ import annotations

import torch

from lit_parallel.parallel.tensor_parallel.infer import infer_tp_plan
from lit_parallel.planner.memory.tensor_parallel import tp_local_model
from tests.conformance_models import gpt2, llama, mlp


def _shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def test_linears_split_column_wise_keep_their_input_and_row_wise_their_output():
    model = mlp()  # Linear 16->32, Tanh, 32->32, Tanh, 32->32, Tanh, 32->4: two pairs at tp 2
    local = tp_local_model(model, infer_tp_plan(model, tp_size=2))
    assert _shapes(local) == {
        "0.weight": (16, 16),
        "0.bias": (16,),  # column-wise: half the outputs, half the bias
        "2.weight": (32, 16),
        "2.bias": (32,),  # row-wise: half the inputs, the whole bias
        "4.weight": (16, 32),
        "4.bias": (16,),
        "6.weight": (4, 16),
        "6.bias": (4,),
    }
    assert all(p.is_meta for p in local.parameters())
    assert not any(p.is_meta for p in model.parameters())  # the model itself is left as it is
    x = torch.zeros(8, 16, device="meta")
    assert local(x).shape == (8, 4)  # the local model runs: each split layer meets the width it expects


def test_gpt2_transposed_conv1d_fused_qkv_and_head_counts_are_per_rank():
    model = gpt2()  # width 32, 4 heads, feed-forward 64; Conv1D stores its weight (in, out)
    local = tp_local_model(model, infer_tp_plan(model, tp_size=2))
    shapes = _shapes(local)
    assert shapes["transformer.h.0.attn.c_attn.weight"] == (32, 48)  # q, k, v: 2 of 4 heads each
    assert shapes["transformer.h.0.attn.c_attn.bias"] == (48,)
    assert shapes["transformer.h.0.attn.c_proj.weight"] == (16, 32)  # row-wise: half the inputs
    assert shapes["transformer.h.0.mlp.c_fc.weight"] == (32, 32)
    assert shapes["transformer.h.0.mlp.c_proj.weight"] == (32, 32)
    assert shapes["transformer.h.0.ln_1.weight"] == (32,) and shapes["transformer.wte.weight"] == (64, 32)
    assert local.transformer.h[0].attn.c_attn.nf == 48 and local.transformer.h[0].attn.c_proj.nf == 32
    logits = local(torch.zeros(2, 8, dtype=torch.long, device="meta")).logits
    assert logits.shape == (2, 8, 64)


def test_llama_grouped_heads_split_and_the_parameter_count_by_hand():
    model = llama()  # width 32, 4 heads of 8, 2 key/value heads, feed-forward 64, 2 layers, vocab 64
    local = tp_local_model(model, infer_tp_plan(model, tp_size=2))
    shapes = _shapes(local)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (16, 32)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (8, 32)  # 1 of 2 key/value heads
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (32, 16)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (32, 32)
    # per layer: q 16x32, k and v 8x32, o 32x16, gate and up 32x32, down 32x32, two norms of 32;
    # outside: embedding and head 64x32 each, the final norm 32
    layer = 16 * 32 + 2 * 8 * 32 + 32 * 16 + 3 * 32 * 32 + 2 * 32
    assert sum(p.numel() for p in local.parameters()) == 2 * layer + 2 * 64 * 32 + 32
