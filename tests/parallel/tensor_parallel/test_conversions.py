"""SplittableMultiheadAttention equals nn.MultiheadAttention; conversions; plans for torch's built-in
transformer layers and for models without blocks (column/row pairs on Linear chains)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lit_parallel.nn import SplittableMultiheadAttention
from lit_parallel.parallel import infer_tp_plan
from lit_parallel.parallel.tensor_parallel.conversions import (
    convert_for_tensor_parallel,
    revert_tensor_parallel_conversions,
)
from lit_parallel.parallel.tensor_parallel.plan import TPPlanError

E, HEADS, B, L, S = 8, 2, 3, 4, 5


def _inputs(batch_first: bool, kdim: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, L, E, generator=g)
    kv = torch.randn(B, S, kdim, generator=g)
    if not batch_first:
        q, kv = q.transpose(0, 1), kv.transpose(0, 1)
    return q, kv


def _masks(kind: str):
    g = torch.Generator().manual_seed(1)
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[0, -2:] = True
    pad[2, -1] = True
    float_mask = torch.randn(L, S, generator=g)
    return {
        "none": {},
        "float attn_mask": {"attn_mask": float_mask},
        "bool attn_mask": {"attn_mask": torch.triu(torch.ones(L, S, dtype=torch.bool), diagonal=2)},
        "per-head attn_mask": {"attn_mask": torch.randn(B * HEADS, L, S, generator=g)},
        "key_padding_mask": {"key_padding_mask": pad},
        "both": {"attn_mask": float_mask, "key_padding_mask": pad},
    }[kind]


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("kdim", [E, 6])
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize(
    "masks", ["none", "float attn_mask", "bool attn_mask", "per-head attn_mask", "key_padding_mask", "both"]
)
def test_splittable_attention_equals_multihead_attention(batch_first, kdim, need_weights, masks):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, HEADS, batch_first=batch_first, kdim=kdim, vdim=kdim)
    ours = SplittableMultiheadAttention.from_multihead_attention(mha)
    q, kv = _inputs(batch_first, kdim)
    want = mha(q, kv, kv, need_weights=need_weights, **_masks(masks))
    got = ours(q, kv, kv, need_weights=need_weights, **_masks(masks))
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    if need_weights:
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    else:
        assert got[1] is None and want[1] is None


def test_splittable_attention_self_attention_per_head_weights_unbatched_and_gradients():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, HEADS, bias=False, batch_first=True)
    ours = SplittableMultiheadAttention.from_multihead_attention(mha)
    x = torch.randn(B, L, E, requires_grad=True)
    want = mha(x, x, x, average_attn_weights=False)
    got = ours(x, x, x, average_attn_weights=False)
    assert got[1].shape == (B, HEADS, L, L)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    (gx,) = torch.autograd.grad(got[0].square().sum(), x)
    (wx,) = torch.autograd.grad(want[0].square().sum(), x)
    torch.testing.assert_close(gx, wx, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours(x[0], x[0], x[0])[0], mha(x[0], x[0], x[0])[0], rtol=1e-5, atol=1e-6)


def test_splittable_attention_copies_weights_exactly_and_converts_back():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, HEADS, dropout=0.1, batch_first=True)
    ours = SplittableMultiheadAttention.from_multihead_attention(mha)
    w = mha.in_proj_weight.detach()
    assert torch.equal(ours.q_proj.weight, w[:E]) and torch.equal(ours.v_proj.weight, w[2 * E :])
    assert torch.equal(ours.k_proj.bias, mha.in_proj_bias.detach()[E : 2 * E])
    assert set(ours.state_dict()) == {
        f"{p}.{t}" for p in ("q_proj", "k_proj", "v_proj", "out_proj") for t in ("weight", "bias")
    }
    back = ours.to_multihead_attention()
    assert back.dropout == 0.1 and back.batch_first
    for key, value in mha.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key
    fresh = SplittableMultiheadAttention(E, HEADS, batch_first=True)
    fresh.load_state_dict(mha.state_dict())  # the original keys still load
    for key, value in ours.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key


def test_splittable_attention_refuses_what_it_cannot_split():
    with pytest.raises(ValueError, match="add_bias_kv=True"):
        SplittableMultiheadAttention.from_multihead_attention(
            nn.MultiheadAttention(E, HEADS, add_bias_kv=True)
        )
    with pytest.raises(ValueError, match="add_zero_attn"):
        SplittableMultiheadAttention(E, HEADS, add_zero_attn=True)
    with pytest.raises(RuntimeError, match="needs attn_mask"):
        SplittableMultiheadAttention(E, HEADS)(
            torch.zeros(L, B, E), torch.zeros(S, B, E), torch.zeros(S, B, E), is_causal=True
        )


def _encoder(batch_first: bool = True) -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=batch_first)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)


@pytest.mark.parametrize("batch_first", [True, False])
def test_converted_encoder_matches_original_in_train_and_eval_mode(batch_first):
    original = _encoder(batch_first)
    converted = copy.deepcopy(original)
    notes: list[str] = []
    names = convert_for_tensor_parallel(converted, notes)
    assert names == ["layers.0.self_attn", "layers.1.self_attn"]
    assert notes[0].startswith("converted 2 nn.MultiheadAttention to SplittableMultiheadAttention")
    assert not converted.use_nested_tensor
    x = torch.randn(3, 5, 16) if batch_first else torch.randn(5, 3, 16)
    pad = torch.zeros(3, 5, dtype=torch.bool)
    pad[1, -2:] = True
    causal = nn.Transformer.generate_square_subsequent_mask(5)
    for train in (True, False):
        original.train(train), converted.train(train)
        torch.testing.assert_close(converted(x), original(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(converted(x, mask=causal), original(x, mask=causal), rtol=1e-5, atol=1e-5)
        with torch.no_grad():  # eval + no grad: torch's fused fast paths (nested tensors) for the original
            want, got = original(x, src_key_padding_mask=pad), converted(x, src_key_padding_mask=pad)
        keep = ~pad if batch_first else ~pad.T  # the fast path zeroes padded positions
        torch.testing.assert_close(got[keep], want[keep], rtol=1e-5, atol=1e-5)
    assert revert_tensor_parallel_conversions(converted) == names
    for key, value in original.state_dict().items():
        assert torch.equal(converted.state_dict()[key], value), key


def test_converted_decoder_matches_original():
    torch.manual_seed(0)
    original = nn.TransformerDecoder(nn.TransformerDecoderLayer(16, 4, 32, dropout=0.0, norm_first=True), 2)
    converted = copy.deepcopy(original)
    assert len(convert_for_tensor_parallel(converted)) == 4
    tgt, memory = torch.randn(5, 3, 16), torch.randn(7, 3, 16)
    causal = nn.Transformer.generate_square_subsequent_mask(5)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[0, -3:] = True
    kw = {"tgt_mask": causal, "tgt_is_causal": True, "memory_key_padding_mask": pad}
    torch.testing.assert_close(
        converted(tgt, memory, **kw), original(tgt, memory, **kw), rtol=1e-5, atol=1e-5
    )


def test_attention_with_add_bias_kv_stays_and_is_named():
    model = nn.Sequential(nn.MultiheadAttention(E, HEADS, add_bias_kv=True))
    notes: list[str] = []
    assert convert_for_tensor_parallel(model, notes) == []
    assert isinstance(model[0], nn.MultiheadAttention)
    assert "0: nn.MultiheadAttention with add_bias_kv=True cannot be converted" in notes[0]


# --- plans -----------------------------------------------------------------------------------------------


def _styles(plan) -> dict[str, str]:
    return {layer.path: layer.style for layer in plan.layers}


def _attention_split(prefix: str) -> dict[str, str]:
    out = {f"{prefix}.{p}": "colwise" for p in ("q_proj", "k_proj", "v_proj")}
    return {**out, f"{prefix}.out_proj": "rowwise"}


def test_plan_for_transformer_encoder_splits_attention_and_feed_forward():
    plan = infer_tp_plan(_encoder(), 2)
    want = {}
    for i in (0, 1):
        want |= _attention_split(f"layers.{i}.self_attn")
        want |= {f"layers.{i}.linear1": "colwise", f"layers.{i}.linear2": "rowwise"}
    assert plan.how == "traced"
    assert _styles(plan) == want
    assert ("layers.0.self_attn", "num_heads", 4, 2) in plan.head_attributes
    assert any("converted 2 nn.MultiheadAttention to SplittableMultiheadAttention" in n for n in plan.notes)


def test_plan_for_transformer_decoder_splits_self_and_cross_attention():
    torch.manual_seed(0)
    decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(16, 4, 32, dropout=0.0), 2)
    plan = infer_tp_plan(decoder, 2)  # the layers take (tgt, memory): planned from the module structure
    want = {}
    for i in (0, 1):
        want |= _attention_split(f"layers.{i}.self_attn") | _attention_split(f"layers.{i}.multihead_attn")
        want |= {f"layers.{i}.linear1": "colwise", f"layers.{i}.linear2": "rowwise"}
    assert _styles(plan) == want
    heads = {(p, a, old, new) for p, a, old, new in plan.head_attributes}
    assert ("layers.1.multihead_attn", "num_heads", 4, 2) in heads
    with pytest.raises(TPPlanError, match="not divisible by 3"):
        infer_tp_plan(decoder, 3)


def test_plan_for_plain_mlp_pairs_linears_and_replicates_the_rest():
    model = nn.Sequential(
        nn.Linear(8, 16),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(16, 12),
        nn.GELU(),
        nn.Linear(12, 4),
        nn.Linear(4, 3),
    )
    plan = infer_tp_plan(model, 2)
    assert plan.how == "linear chains"
    want = {"0": "colwise", "2": "rowwise", "5": "colwise", "7": "rowwise", "8": "replicated"}
    assert _styles(plan) == want
    assert {layer.path: layer.reason for layer in plan.replicated} == {
        "8": "its output is the model's output"
    }
    assert "2 column/row pairs on chains of Linears, 1 Linear replicated" in plan.notes[-1]
    # 16 hidden features do not split over 3 ranks, 12 do: the plan says why 0 and 2 stay whole
    plan3 = infer_tp_plan(model, 3)
    assert _styles(plan3) == {**want, "0": "replicated", "2": "replicated"}
    reasons = {layer.path: layer.reason for layer in plan3.replicated}
    assert reasons["0"] == reasons["2"] == "16 hidden features are not divisible by 3"


def test_plan_for_mlp_does_not_pair_through_non_elementwise_operations():
    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c, self.d = (
                nn.Linear(8, 8),
                nn.Linear(8, 8),
                nn.Linear(8, 6),
                nn.Linear(6, 8),
            )

        def forward(self, x):
            h = self.a(x)
            h = h + self.b(torch.relu(h))  # a's output also reaches the residual add
            return self.d(torch.softmax(self.c(h), dim=-1))  # softmax mixes c's features

    plan = infer_tp_plan(Residual(), 2)
    assert not plan.split
    reasons = {layer.path: layer.reason for layer in plan.replicated}
    assert reasons["a"] == "its output goes through add"
    assert reasons["c"] == "its output goes through softmax"
    with pytest.raises(TPPlanError, match="sequence_parallel=True needs transformer blocks"):
        infer_tp_plan(Residual(), 2, sequence_parallel=True)
