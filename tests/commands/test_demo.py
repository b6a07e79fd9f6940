"""`lit-parallel demo` with ddp_tuned end to end (a real torchrun launch); `bench ddp`'s figures are checked in
the run of `bench all --only ddp` (tests/commands/test_cli.py), which runs the same benchmark."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lit_parallel.commands.cli import build_parser

pytestmark = pytest.mark.multiprocess


def _cli(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "lit_parallel.commands.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


@pytest.mark.timeout(240)
def test_demo_trains_digits_on_two_ranks_and_reports_its_choices():
    res = _cli("demo", "--epochs", "4", timeout=200)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout
    assert "ddp_tuned on 2 ranks (gloo)" in out
    assert "bucket sizes" in out and "MiB" in out
    assert "find_unused_parameters" in out and "False" in out
    acc = float(out.split("final validation accuracy")[1].split()[1])
    assert acc > 0.85  # chance is 0.10; 4 epochs of this MLP give about 0.9


def test_cli_refuses_bad_numbers_with_a_clear_message(capsys):
    from lit_parallel.commands.cli import main

    assert main(["bench", "ddp", "--repeats", "0"]) == 2
    assert "--repeats, --steps and --warmup must each be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser(["bench", "nope"]).parse_args(["bench", "nope"])
