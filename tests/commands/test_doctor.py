"""`lit-parallel doctor`: environment checks, a live all-reduce on real ranks, and the fixes it prints."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from lit_parallel.commands.cli import main
from lit_parallel.commands.doctor import environment_checks
from lit_parallel.measure.collectives import bus_bandwidth


def _doctor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lit_parallel.commands.cli", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=150,
        env=dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200"),
        check=False,
    )


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_doctor_runs_the_all_reduce_sanity_check_on_three_ranks():
    res = _doctor("--devices", "3", "--repeats", "2")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    # ranks 0 + 1 + 2
    assert "got 3, expected N(N-1)/2 = 3" in res.stdout
    assert "all-reduce bandwidth (3 ranks, gloo, median)" in res.stdout
    assert "32 MiB" in res.stdout


def test_bus_bandwidth_follows_nccl_tests_definition():
    # 1 GB in 0.5 s on 4 ranks: algbw 2 GB/s, busbw 2 * 2 * 3 / 4 = 3 GB/s
    assert bus_bandwidth(10**9, 0.5, 4) == pytest.approx((2.0, 3.0))
    assert bus_bandwidth(10**9, 1.0, 1) == pytest.approx((1.0, 1.0))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the failure path of a machine without CUDA")
def test_nccl_without_cuda_fails_with_the_fix_and_starts_no_ranks(capsys):
    backend, checks, _ = environment_checks(2, "nccl")
    assert backend == "nccl" and not all(c.ok for c in checks)
    # in this process: the command refuses before it would launch any rank
    assert main(["doctor", "--devices", "2", "--backend", "nccl"]) == 1
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert "NCCL needs one CUDA device per rank" in out
    assert "process group initialises" not in out
