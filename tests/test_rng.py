"""RNG states in checkpoints: the rank's own CUDA generator is saved and restored into the rank's own
device, whatever the number of visible devices at save and at load.

The device generators are reached through :class:`~lit_parallel.rng.DeviceGenerators`; here a stand-in
with N devices holding real generator states (``torch.Generator`` states) plays the role of
``torch.cuda``, so the selection runs on CPU; the states go through a real ``torch.save`` /
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch

from lit_parallel.rng import (
    CUDA,
    DeviceGenerators,
    capture_rng_state,
    cuda_state_for_device,
    restore_rng_state,
    state_from_bytes,
    state_to_bytes,
)


class Devices:
    """``count`` visible devices, each with its own generator state; ``current`` is the rank's device."""

    def __init__(self, count: int, current: int, seed: int = 0) -> None:
        self.states = [torch.Generator().manual_seed(seed + 100 * i).get_state() for i in range(count)]
        self.current = current

    def generators(self) -> DeviceGenerators:
        def set_state(state: torch.Tensor, device: int) -> None:
            self.states[device] = state.clone()  # raises IndexError past the visible devices, as torch does

        return DeviceGenerators(
            initialized=lambda: True,
            current_device=lambda: self.current,
            device_count=lambda: len(self.states),
            get_state=lambda device: self.states[device].clone(),
            set_state=set_state,
        )


def _save_and_load(state: dict, tmp_path) -> dict:
    torch.save(state, tmp_path / "rng.pt")
    return torch.load(tmp_path / "rng.pt", weights_only=True)


@pytest.mark.parametrize(
    ("saved", "loaded"),
    [
        ((8, 3), (1, 0)),  # 8 visible at save, one per rank (CUDA_VISIBLE_DEVICES per rank) at resume
        ((1, 0), (8, 3)),  # the reverse: the rank's generator is cuda:3 now
        ((8, 3), (8, 3)),  # the same layout
        ((4, 2), (2, 1)),
    ],
)
def test_the_ranks_own_cuda_generator_is_restored_into_the_ranks_device_for_any_visible_count(
    tmp_path, saved, loaded
):
    at_save = Devices(*saved, seed=0)
    rank_state = at_save.states[saved[1]].clone()
    state = _save_and_load(capture_rng_state(at_save.generators()), tmp_path)
    assert state["cuda"]["device"] == saved[1] and torch.equal(state["cuda"]["state"], rank_state)

    at_load = Devices(*loaded, seed=7)
    others = [s.clone() for s in at_load.states]
    restore_rng_state(state, at_load.generators())
    for i, s in enumerate(at_load.states):
        assert torch.equal(s, rank_state if i == loaded[1] else others[i]), f"device {i}"


def test_a_list_of_every_visible_devices_state_from_an_earlier_version_restores_the_ranks_entry():
    states = [torch.Generator().manual_seed(i).get_state() for i in range(8)]
    # as many visible as at save: the rank's device has the same index
    chosen, why = cuda_state_for_device(states, device=5, device_count=8)
    assert torch.equal(chosen, states[5]) and why == ""
    # one entry: the saving rank saw only its own device
    chosen, _ = cuda_state_for_device(states[2:3], device=6, device_count=8)
    assert torch.equal(chosen, states[2])


def test_a_list_that_does_not_tell_the_ranks_entry_leaves_the_generator_alone_with_a_warning(caplog):
    old = {**capture_rng_state(Devices(1, 0).generators()), "cuda": Devices(8, 0, seed=3).states}
    now = Devices(1, 0, seed=9)
    before = now.states[0].clone()
    with caplog.at_level(logging.WARNING, logger="lit_parallel"):
        restore_rng_state(old, now.generators())  # 8 saved, 1 visible: no IndexError
    assert torch.equal(now.states[0], before)
    assert "CUDA RNG states of 8 visible devices" in caplog.text and "cuda:0 of 1 visible" in caplog.text


def test_cpu_numpy_and_python_generators_round_trip_and_a_cuda_state_is_skipped_without_cuda(tmp_path):
    torch.manual_seed(3), np.random.seed(4), random.seed(5)
    state = capture_rng_state(Devices(2, 1).generators())
    expected = (torch.rand(4), np.random.rand(4), [random.random() for _ in range(3)])
    state = _save_and_load(state, tmp_path)
    torch.manual_seed(99), np.random.seed(99), random.seed(99)
    no_cuda = DeviceGenerators(
        initialized=lambda: False,
        current_device=lambda: pytest.fail("no device to ask"),
        device_count=lambda: 0,
        get_state=lambda d: pytest.fail("no device to read"),
        set_state=lambda s, d: pytest.fail("no device to set"),
    )
    restore_rng_state(state, no_cuda)  # a GPU run resumed on CPU
    got = (torch.rand(4), np.random.rand(4), [random.random() for _ in range(3)])
    assert torch.equal(got[0], expected[0]) and np.array_equal(got[1], expected[1]) and got[2] == expected[2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_generator_of_the_current_device_round_trips(tmp_path):
    torch.cuda.init()
    device = torch.cuda.current_device()
    torch.cuda.manual_seed(11)
    state = _save_and_load(capture_rng_state(), tmp_path)
    assert state["cuda"]["device"] == device
    expected = torch.rand(4, device="cuda")
    torch.cuda.manual_seed(12)
    restore_rng_state(state, CUDA)
    assert torch.equal(torch.rand(4, device="cuda"), expected)


def _assert_same_state(got, want) -> None:
    assert type(got) is type(want), (got, want)
    if isinstance(want, dict):
        assert list(got) == list(want)
        for k in want:
            _assert_same_state(got[k], want[k])
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    else:
        assert got == want


@pytest.mark.parametrize("gauss_next", [None, 0.123456789012345])
def test_a_state_encoded_as_bytes_decodes_to_the_same_tensors_numbers_and_strings(gauss_next):
    # what ranks exchange at save time: one uint8 tensor each, padded to the longest, decoded on rank 0
    random.seed(3)
    if gauss_next is not None:
        random.gauss(0.0, 1.0)  # leaves a cached second value (gauss_next), a float
    np.random.seed(5)
    np.random.randn()  # numpy caches a gaussian too
    state = capture_rng_state(Devices(3, current=2).generators())
    assert (state["python"]["gauss_next"] is None) == (gauss_next is None)
    data = state_to_bytes(state)
    assert data.dtype == torch.uint8 and data.dim() == 1
    # the bytes of every tensor plus a header: the tensors (5056 + 625*8 + 624*8 + CUDA's 5056) dominate
    tensor_bytes = 5056 + 625 * 8 + 624 * 8 + state["cuda"]["state"].numel()
    assert tensor_bytes < data.numel() < tensor_bytes + 1024
    padded = torch.cat([data, torch.full((37,), 255, dtype=torch.uint8)])
    _assert_same_state(state_from_bytes(padded), state)
    # a row of the gathered ranks' bytes starts at any offset of their storage (a view as int64 needs 8)
    row = torch.stack([padded, padded])[1] if padded.numel() % 8 else torch.cat([padded[:3], padded])[3:]
    assert row.storage_offset() % 8 != 0
    _assert_same_state(state_from_bytes(row), state)
