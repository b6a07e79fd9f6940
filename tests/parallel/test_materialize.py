"""Materialising from the meta device without a process group: every tensor must be written by an
initialiser (tracked while it runs, never read from memory), else an error names the module, the tensor and
the fixes; Hugging Face modules without ``reset_parameters`` (norms, rotary tables) use their model's
``_init_weights``. The rank-0 copy's bound is measured on 2 ranks in tests/strategies/test_fsdp.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lit_parallel.parallel.materialize import UninitializedStateError, materialize_blocks


def _materialize(model: nn.Module, blocks=(), **kwargs) -> None:
    for _ in materialize_blocks(model, list(blocks), torch.device("cpu"), **kwargs):
        pass


class Table(nn.Module):
    """A buffer computed in __init__ and no reset_parameters: a rotary table, a causal mask."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cos", torch.arange(8.0).cos(), persistent=False)


class HalfReset(nn.Module):
    """A reset_parameters that forgets the buffer its __init__ computed."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.weight = nn.Parameter(torch.empty(4))
        self.register_buffer("mask", torch.ones(4, 4).tril())

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class Model(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.inner = inner


def test_a_buffer_without_an_initialiser_is_an_error_naming_module_buffer_and_fixes_before_any_work():
    with torch.device("meta"):
        model = Model(Table())
    with pytest.raises(UninitializedStateError) as err:
        _materialize(model)
    text = str(err.value)
    assert "buffer 'cos' of module 'inner' (Table)" in text
    for fix in ("reset_parameters()", "on a real device", "init_from", "persistent=False"):
        assert fix in text
    assert model.embed.weight.is_meta  # refused before anything was materialised


def test_a_buffer_its_initialiser_does_not_write_is_an_error_though_memory_may_be_zero():
    with torch.device("meta"):
        model = Model(HalfReset())
    with pytest.raises(UninitializedStateError) as err:
        _materialize(model)
    text = str(err.value)
    assert "buffer 'mask' of module 'inner' (HalfReset)" in text
    assert "'weight'" not in text  # written by reset_parameters


def test_init_from_excuses_parameters_and_persistent_buffers_not_non_persistent_ones():
    with torch.device("meta"):
        model = Model(HalfReset())
    _materialize(model, filled_by_state_dict=True)  # the mask is persistent: the state dict fills it
    with torch.device("meta"):
        model = Model(Table())
    with pytest.raises(UninitializedStateError, match="buffer 'cos' of module 'inner'"):
        _materialize(model, filled_by_state_dict=True)


def test_a_buffer_built_on_a_real_device_inside_the_meta_context_is_kept():
    class RealTable(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.register_buffer("cos", torch.arange(8.0, device="cpu").cos(), persistent=False)

    with torch.device("meta"):
        model = Model(RealTable())
    _materialize(model)
    torch.testing.assert_close(model.inner.cos, torch.arange(8.0).cos(), rtol=0, atol=0)
    assert not model.embed.weight.is_meta


def test_a_reset_parameters_that_replaces_its_buffer_counts_as_initialising_it():
    class Replacing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("cos", torch.arange(8.0).cos(), persistent=False)

        def reset_parameters(self) -> None:
            self.cos = torch.arange(8.0, device=self.cos.device).cos()

    with torch.device("meta"):
        model = Model(Replacing())
    _materialize(model)
    torch.testing.assert_close(model.inner.cos, torch.arange(8.0).cos(), rtol=0, atol=0)


def test_hugging_face_llama_on_meta_gets_its_rotary_tables_and_norms_from_its_own_init_weights():
    from tests.conformance_models import SEQ, VOCAB, llama

    torch.manual_seed(0)
    reference = llama().eval()
    with torch.device("meta"):
        model = llama().eval()
    blocks = list(model.model.layers)
    # poison the allocator's pages first: a tensor nobody writes would come back holding this
    torch.full((1 << 16,), float("nan")).sum()
    _materialize(model, blocks)
    for name, buffer in reference.named_buffers():
        torch.testing.assert_close(model.get_buffer(name), buffer, rtol=0, atol=0, msg=name)
    for name, p in model.named_parameters():
        if "norm" in name:
            assert torch.equal(p, torch.ones_like(p)), name
    # with the reference's weights (persistent state) the outputs agree: the rotary tables are right
    model.load_state_dict(reference.state_dict())
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    torch.testing.assert_close(model(tokens).logits, reference(tokens).logits, rtol=0, atol=0)


def test_cpu_tensors_under_nccl_are_staged_on_the_gpu_in_pieces_of_at_most_the_cap(monkeypatch):
    """NCCL cannot send CPU tensors: they go through one buffer of at most the cap on the GPU (no GPU here:
    the staging device is the meta device and the collective is recorded, rank 0's side)."""
    import lit_parallel.parallel.materialize as mat

    monkeypatch.setattr(mat.dist, "get_backend", lambda *a: "nccl")
    monkeypatch.setattr(mat.torch.cuda, "current_device", lambda: 3)
    assert mat._comm_device(torch.device("cpu")) == torch.device("cuda", 3)
    monkeypatch.setattr(mat.dist, "get_backend", lambda *a: "cpu:gloo,cuda:nccl")
    assert mat._comm_device(torch.device("cpu")) == torch.device("cpu")
    monkeypatch.setattr(mat.dist, "get_backend", lambda *a: "gloo")
    assert mat._comm_device(torch.device("cpu")) == torch.device("cpu")

    sent: list[tuple[str, int]] = []
    monkeypatch.setattr(mat, "_distributed", lambda: True)
    monkeypatch.setattr(mat.dist, "get_rank", lambda *a: 0)
    monkeypatch.setattr(mat, "_comm_device", lambda device: torch.device("meta"))
    monkeypatch.setattr(mat.dist, "broadcast", lambda t, src: sent.append((t.device.type, t.nbytes)))
    cap = 1024
    big = torch.zeros(10 * cap // 4 + 3)  # 10 pieces of the cap and 12 bytes
    small = [torch.zeros(100) for _ in range(5)]  # 400 bytes each: two per packed buffer
    mat.broadcast_from_rank0([big, *small], chunk_bytes=cap)
    assert all(device == "meta" for device, _ in sent)
    assert sorted(n for _, n in sent) == sorted([cap] * 10 + [12] + [800, 800, 400])
