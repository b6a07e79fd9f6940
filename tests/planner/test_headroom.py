""" "Fits" leaves headroom: a row fits when its bytes are at most (1 - memory_headroom) x device memory, less
1 GB per process on a GPU (CUDA context, NCCL buffers).

The model states are ZeRO's figures: 1e9 parameters in bf16-mixed keep 2 + 2 + 12 = 16 bytes each, 16e9
bytes per rank under DDP, 16e9 / 8 under FSDP over 8 ranks. The device sizes below put DDP's 16e9 bytes
exactly on the bound and just past it.
"""

from __future__ import annotations

import pytest

from lit_parallel.planner.rules import CUDA_RESERVED_BYTES, DEFAULT_MEMORY_HEADROOM, GB, advise, usable_memory

DDP = 16e9  # 1e9 parameters x 16 bytes


def test_the_usable_memory_is_the_documented_formula():
    assert (DEFAULT_MEMORY_HEADROOM, CUDA_RESERVED_BYTES) == (0.1, 1e9)
    assert usable_memory(80e9, memory_headroom=0.1, device_type="cuda") == pytest.approx(71e9)
    assert usable_memory(80e9, memory_headroom=0.1, device_type="cpu") == pytest.approx(72e9)
    assert usable_memory(80e9, memory_headroom=0.0, device_type="cpu") == 80e9


@pytest.mark.parametrize(
    ("memory_gb", "memory_headroom", "device_type", "fits"),
    [
        (32, 0.5, "cpu", True),  # 32e9 x 0.5 = 16e9: exactly on the bound
        (31.99, 0.5, "cpu", False),
        (34, 0.5, "cuda", True),  # 34e9 x 0.5 - 1e9 = 16e9
        (33.99, 0.5, "cuda", False),
        (16.016, 0.0, "cpu", True),  # DDP at 99.9 % of the device: fitted before there was headroom
        (16.016, DEFAULT_MEMORY_HEADROOM, "cuda", False),  # and now does not
    ],
)
def test_ddp_fits_exactly_up_to_the_usable_memory(memory_gb, memory_headroom, device_type, fits):
    a = advise(1e9, devices=8, memory_gb=memory_gb, memory_headroom=memory_headroom, device_type=device_type)
    assert a.row("DDP").state_bytes == DDP
    assert a.row("DDP").fits is fits
    assert a.recommendation == ("ddp_tuned" if fits else "fsdp_blocks")
    assert a.usable_bytes == pytest.approx(
        memory_gb * GB * (1 - memory_headroom) - (1e9 if device_type == "cuda" else 0.0)
    )
    assert f"usable of {memory_gb:.2f} GB" in a.describe()


def test_given_memory_is_a_gpus_by_default_and_the_json_says_what_was_usable():
    a = advise(1e9, devices=8, memory_gb=80)
    d = a.as_dict()
    assert (d["device_type"], d["memory_headroom"]) == ("cuda", 0.1)
    assert d["usable_gb"] == pytest.approx(71.0)
    assert (
        "71.00 GB usable: 80.00 GB less 10% headroom and 1.00 GB for the CUDA context and NCCL"
        in a.describe()
    )


def test_the_block_rule_compares_with_the_usable_memory_too():
    # the largest block: 2e9 params x (2 + 2) bytes = 8e9, exactly 10 GB x 0.9 - 1 GB usable; 9.99 GB is
    # just short of it
    a = advise(1e12, devices=8, memory_gb=9.99, block_params=2e9)
    assert a.block_working_bytes == 8e9
    assert a.recommendation == "tp_dp" and a.rule.number == 2
    b = advise(1e12, devices=8, memory_gb=10, block_params=2e9)
    assert b.recommendation != "tp_dp"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"memory_headroom": 1.0}, "memory_headroom=1.0 must be at least 0 and below 1"),
        ({"memory_headroom": -0.1}, "memory_headroom=-0.1 must be at least 0 and below 1"),
        ({"memory_headroom": "10%"}, "memory_headroom='10%' must be a fraction"),
        ({"memory_gb": 1.0}, "1.00 GB per device leaves nothing to train in after 10% headroom"),
    ],
)
def test_a_headroom_or_memory_that_leaves_nothing_is_refused_with_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        advise(1e9, **{"devices": 8, "memory_gb": 80, **kwargs})


@pytest.mark.parametrize(("headroom", "chosen"), [("0", "ddp_tuned"), (None, "fsdp_blocks")])
def test_advise_command_takes_the_headroom(capsys, monkeypatch, headroom, chosen):
    from lit_parallel.commands.cli import main

    monkeypatch.setenv("COLUMNS", "200")
    args = ["advise", "--params", "1e9", "--devices", "8", "--memory-gb", "17.02"]  # 16.02 GB after 1 GB CUDA
    assert main(args + (["--memory-headroom", headroom] if headroom else [])) == 0
    out = capsys.readouterr().out
    assert f"recommendation: {chosen}" in out
    assert ("16.02 GB usable" if headroom else "14.32 GB usable") in out
