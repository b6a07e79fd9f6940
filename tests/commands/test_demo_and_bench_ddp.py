"""`lit-parallel demo` and `lit-parallel bench ddp` end to end (real torchrun launches)."""

from __future__ import annotations

import json
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


@pytest.mark.timeout(240)
def test_bench_ddp_reports_all_variants_and_exact_bytes(tmp_path):
    path = tmp_path / "bench.json"
    res = _cli(
        "bench",
        "ddp",
        "--width",
        "64",
        "--depth",
        "3",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--repeats",
        "1",
        "--json",
        str(path),
        timeout=200,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    result = json.loads(path.read_text())
    width, depth = 64, 3
    n_params = (depth - 1) * (width * width + width) + (width * 10 + 10)
    assert result["config"]["params"] == n_params
    assert set(result["variants"]) == {"ddp_tuned", "lightning_ddp", "plain_ddp"}
    # one fp32 all-reduce of every gradient per step
    assert result["variants"]["ddp_tuned"]["bytes_per_step"] == 4 * n_params
    assert result["variants"]["plain_ddp"]["bytes_per_step"] == 4 * n_params
    assert result["variants"]["lightning_ddp"]["ratio_vs_lightning_ddp"] == 1.0
    assert "bench ddp" in res.stdout


def test_cli_refuses_bad_numbers_with_a_clear_message(capsys):
    from lit_parallel.commands.cli import main

    assert main(["bench", "ddp", "--repeats", "0"]) == 2
    assert "--repeats, --steps and --warmup must each be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser(["bench", "nope"]).parse_args(["bench", "nope"])
