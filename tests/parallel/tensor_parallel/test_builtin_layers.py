"""Tensor parallelism on torch's nn.TransformerEncoder / nn.TransformerDecoder (attention converted and
split) and on a plain MLP (Linear chains paired), on 2 real gloo ranks: loss and gradients equal the
unsplit plain PyTorch model, and each rank holds half of every split projection.

Launches (1): 2 ranks, tensor_parallel 2.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import launch
from tests.reference import assert_rel_close
from tests.scenarios import tp_builtin as sc

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    names = ["encoder_decoder_tp2", "mlp_tp2"]
    return launch(
        [f"tests.scenarios.tp_builtin:{n}" for n in names],
        2,
        tmp_path_factory.mktemp("tp_builtin"),
        timeout=240,
    )


def _reference(name: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and gradients of the plain model, nn.MultiheadAttention's packed q/k/v rows split per projection."""
    model = sc.build_model(name)
    loss = sc.loss_of(model, name)
    loss.backward()
    grads = {}
    for n, p in model.named_parameters():
        prefix, _, leaf = n.rpartition(".")
        if leaf in ("in_proj_weight", "in_proj_bias"):
            for proj, part in zip(("q_proj", "k_proj", "v_proj"), p.grad.chunk(3)):
                grads[f"{prefix}.{proj}.{leaf.removeprefix('in_proj_')}"] = part
        else:
            grads[n] = p.grad
    return loss.detach(), grads


def _attention(prefix: str) -> list[str]:
    return [f"{prefix}.{p}" for p in ("k_proj", "out_proj", "q_proj", "v_proj")]


@pytest.mark.parametrize("name", ["encoder_decoder", "mlp"])
def test_tp2_on_builtin_layers_matches_unsplit_model(two, name):
    want_loss, want_grads = _reference(name)
    per_rank = two.scenario(f"{name}_tp2")
    for r in per_rank:
        assert_rel_close(r["loss"], want_loss, rel=1e-5, what=f"{name}: loss")
        assert set(r["grads"]) == set(want_grads)
        for k, expected in want_grads.items():
            if expected.abs().max() < 1e-6:
                # the key bias: its gradient is 0 in exact arithmetic (softmax ignores a score added to
                # every key), so only rounding noise is left to compare
                assert r["grads"][k].abs().max() < 1e-6, f"{name}: grad of {k}"
                continue
            assert_rel_close(r["grads"][k], expected, rel=1e-5, what=f"{name}: grad of {k}")
        # every split projection: this rank holds exactly half of each weight (and column biases)
        split_weights = {f"{path}.weight" for path in r["split"]}
        assert split_weights <= set(r["shares"]), f"{name}: not sharded: {split_weights - set(r['shares'])}"
        for param, (local, full) in r["shares"].items():
            assert 2 * local == full, f"{name}: {param} holds {local} of {full}"
    split = per_rank[0]["split"]
    if name == "mlp":
        assert split == ["0", "2"]
        return
    want = []
    for stack, kinds in (("encoder", ("self_attn",)), ("decoder", ("multihead_attn", "self_attn"))):
        for i in (0, 1):
            for kind in kinds:
                want += _attention(f"{stack}.layers.{i}.{kind}")
            want += [f"{stack}.layers.{i}.linear1", f"{stack}.layers.{i}.linear2"]
    assert split == sorted(want)
    assert any(
        "converted 6 nn.MultiheadAttention to SplittableMultiheadAttention" in n for n in per_rank[0]["notes"]
    )
