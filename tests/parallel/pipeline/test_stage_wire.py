"""On torch < 2.13 the integer inputs later pipeline stages read travel as floating tensors
(lit_parallel/parallel/pipeline/stage.py; _compat feature "pipelining_integer_tensors"): exact both ways, and
a gradient of zeros comes back for each (torch 2.11 sends a gradient back for every tensor a stage received).
"""

from __future__ import annotations

import pytest
import torch

from lit_parallel.parallel.pipeline.stage import _from_wire, _to_wire, _ZeroGradsForWire

EXTREMES = {
    torch.int64: [torch.iinfo(torch.int64).min, -1, 0, 1, 2**53 + 1, torch.iinfo(torch.int64).max],
    torch.int32: [torch.iinfo(torch.int32).min, -1, 0, 7, torch.iinfo(torch.int32).max],
    torch.int16: [torch.iinfo(torch.int16).min, -1, 0, torch.iinfo(torch.int16).max],
    torch.int8: [-128, -1, 0, 127],
    torch.uint8: [0, 1, 255],
    torch.bool: [True, False],
}


@pytest.mark.parametrize("dtype", list(EXTREMES), ids=str)
def test_integer_inputs_cross_as_floating_tensors_and_come_back_bit_for_bit(dtype):
    value = torch.tensor(EXTREMES[dtype], dtype=dtype).reshape(1, -1).expand(3, -1).contiguous()
    wire = _to_wire(value)
    assert wire.is_floating_point()
    # the same bytes where a floating type of that width exists, float32 (exact for 1-byte values) otherwise
    assert wire.element_size() == (value.element_size() if value.element_size() > 1 else 4)
    # what a stage receives: a new leaf asking for its gradient
    received = wire.clone().requires_grad_(True)
    back = _from_wire(received, dtype)
    assert back.dtype == dtype and torch.equal(back, value) and not back.requires_grad


def test_floating_inputs_and_non_tensors_pass_unchanged():
    x = torch.randn(2, 3)
    assert _to_wire(x) is x and _from_wire(x, torch.float32) is x
    assert _to_wire(5) == 5 and _from_wire(5, None) == 5


def test_the_received_integer_inputs_get_zero_gradients_and_the_activation_its_own():
    activation = torch.randn(2, 3, requires_grad=True)
    ids = _to_wire(torch.arange(6).reshape(2, 3)).clone().requires_grad_(True)
    mask = _to_wire(torch.ones(2, 3, dtype=torch.bool)).clone().requires_grad_(True)
    out = _ZeroGradsForWire.apply(activation, ids, mask)
    assert torch.equal(out, activation)
    (out * 3).sum().backward()
    assert torch.equal(activation.grad, torch.full((2, 3), 3.0))
    for wired in (ids, mask):
        assert wired.grad is not None and wired.grad.dtype == wired.dtype and not wired.grad.any()
