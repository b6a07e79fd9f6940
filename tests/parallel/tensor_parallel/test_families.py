"""Tensor parallelism splits the attention and MLP of Hugging Face families exactly (one launch, 2 gloo ranks).

For GPT-2 (Conv1D, packed c_attn), Llama / Mistral / Qwen2 (grouped key/value heads), OPT, BERT, ViT and
T5 (relative position bias, cross-attention), the split model's loss and parameter gradients equal the
unsplit model's in one plain process, and each rank holds half of every attention and MLP projection.
"""

from __future__ import annotations

import pytest
import torch

from lit_parallel.parallel.tensor_parallel import REPLICATED
from tests.harness import launch
from tests.reference import assert_rel_close
from tests.scenarios import tp_families as sc

pytestmark = pytest.mark.multiprocess
TP = 2
ZERO = 1e-7  # relative to the model's largest gradient: "zero up to rounding"


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    run = launch(
        ["tests.scenarios.tp_families:split_families"], TP, tmp_path_factory.mktemp("tpfam"), timeout=420
    )
    return run.scenario("split_families")


def _assert_grad_close(got: torch.Tensor, want: torch.Tensor, floor: float, what: str) -> None:
    """Relative error < 1e-5; a gradient that is zero up to rounding (a key bias, which softmax ignores:
    below ``floor``) must stay below ``floor``."""
    if want.abs().max().item() < floor:
        assert got.abs().max().item() < floor, f"{what}: {got.abs().max().item():.3e} where ~0 is expected"
    else:
        assert_rel_close(got, want, what=what)


def _reference(name: str) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    model = sc.build(name)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    loss = sc.loss_of(name, model)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, state


@pytest.mark.parametrize("name", list(sc.FAMILIES))
def test_tp_split_family_matches_single_process(split, name):
    loss, grads, state = _reference(name)
    floor = ZERO * max(g.abs().max().item() for g in grads.values() if g is not None)
    for rank, result in enumerate(split):
        got = result[name]
        assert_rel_close(got["loss"], loss, what=f"{name} loss on rank {rank}")
        assert sorted(got["grads"]) == sorted(n for n, g in grads.items() if g is not None)
        for n, g in got["grads"].items():
            _assert_grad_close(g, grads[n], floor, what=f"{name} grad {n} on rank {rank}")
        # state dicts keep the original keys, shapes and (for packed q/k/v) the original layout
        assert got["state_shapes"] == {k: tuple(v.shape) for k, v in state.items()}
        for k, v in got["fused_state"].items():
            assert torch.equal(v, state[k]), f"{name}: {k} is not in the original layout"


@pytest.mark.parametrize("name", list(sc.FAMILIES))
def test_tp_each_rank_holds_half_of_every_projection(split, name):
    for result in split:
        got = result[name]
        assert got["shares"], f"{name}: nothing split"
        replicated = [p for p, s in got["styles"].items() if s == REPLICATED]
        assert not replicated, f"{name}: {replicated} left replicated"
        for path, share in got["shares"].items():
            assert share == pytest.approx(1 / TP), f"{name}: {path} holds {share} of its weight per rank"


def test_gpt2_packed_qkv_is_split_per_head(split):
    got = split[0]["gpt2"]
    assert got["styles"]["transformer.h.0.attn.c_attn"] == "colwise (fused)"
    assert sorted(got["fused_state"]) == [
        f"transformer.h.{i}.attn.c_attn.{p}" for i in range(2) for p in ("bias", "weight")
    ]
    attrs = {(path, attr): (old, new) for path, attr, old, new in got["head_attributes"]}
    assert attrs[("transformer.h.0.attn", "split_size")] == (32, 16)
    assert attrs[("transformer.h.0.attn", "num_heads")] == (4, 2)
