"""`lit-parallel`: every command has --help, errors exit non-zero with the value and the fix, and `demo`
and `bench all` run end to end (`advise` is in test_advise.py, `consolidate` on a real sharded checkpoint
in test_recipes.py, `doctor` in test_doctor.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lit_parallel.commands.cli import BENCHMARKS, COMMANDS, main


def _cli(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lit_parallel.commands.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200"),
        check=False,
    )


@pytest.mark.parametrize(
    "argv", [[name] for name in COMMANDS] + [["bench", name] for name in BENCHMARKS] + [["bench"], []]
)
def test_every_command_has_help(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main([*argv, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: lit-parallel") and "--help" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--devices", "0"], "--devices, --epochs and --batch-size must each be at least 1"),
        (["bench", "all", "--only", "ddp,nope"], "unknown benchmark(s) ['nope']; choose from ddp, fsdp, tp"),
        (["consolidate", "no/such/folder", "out.pt"], "no checkpoint at 'no/such/folder'"),
    ],
)
def test_errors_exit_with_code_2_and_say_what_to_do(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lit-parallel {argv[0]}: error:") and message in err


def test_unknown_commands_and_options_are_usage_errors(capsys):
    for argv in (["nope"], ["demo", "--strategy", "ddp"], ["advise"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
    assert "one of the arguments --params --model is required" in capsys.readouterr().err


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_demo_summary_shows_strategy_blocks_buckets_throughput_memory_metric_and_pitfalls(tmp_path):
    path = tmp_path / "demo.json"
    res = _cli("demo", "--strategy", "fsdp_blocks", "--epochs", "3", "--json", str(path), timeout=280)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout
    for row in (
        "strategy",
        "blocks wrapped",
        "bucket sizes",
        "throughput",
        "memory per rank",
        "final validation accuracy",
        "pitfalls",
    ):
        assert f"│ {row}" in out, row
    assert "fsdp_blocks on 2 ranks (gloo)" in out
    assert "3 x ResidualBlock found automatically" in out
    r = json.loads(path.read_text())
    # SGD with momentum in fp32: 4 (parameter) + 4 (gradient) + 4 (momentum) bytes, sharded over 2 ranks
    assert r["state_bytes"] == r["zero_bytes"] == 12 * r["params"] / 2
    assert r["samples_per_s"] > 0 and r["steps"] == 3 * 23  # 1,437 samples / (32 x 2) per step
    assert r["val_acc"] > 0.8  # chance is 0.1
    assert isinstance(r["pitfalls"], list)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_bench_all_writes_one_json_and_png_plots(tmp_path):
    res = _cli("bench", "all", "--only", "ddp", "--quick", "--out", str(tmp_path), timeout=280)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    assert set(report["benchmarks"]) == {"ddp"} and report["errors"] == {}
    result = report["benchmarks"]["ddp"]
    # --quick runs bench ddp's MLP of width 64 and depth 3 (its hidden layers, then a 10-way head)
    width, depth = 64, 3
    n_params = (depth - 1) * (width * width + width) + (width * 10 + 10)
    assert result["config"]["params"] == n_params
    variants = result["variants"]
    assert set(variants) == {"ddp_tuned", "lightning_ddp", "plain_ddp"}
    # one fp32 all-reduce of every gradient per step
    assert variants["ddp_tuned"]["bytes_per_step"] == 4 * n_params
    assert variants["plain_ddp"]["bytes_per_step"] == 4 * n_params
    assert variants["lightning_ddp"]["ratio_vs_lightning_ddp"] == 1.0
    assert "bench ddp" in res.stdout
    for name in ("step_time.png", "bytes_communicated.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert f"wrote {tmp_path / 'step_time.png'}" in res.stdout


def test_benchmark_variants_rotate_between_repeats():
    from lit_parallel.commands.bench.common import rotated

    # every variant once per repeat, each repeat starting one variant later
    assert "".join(rotated(("a", "b", "c"), 4)) == "abc" + "bca" + "cab" + "abc"


def test_bench_plots_draw_every_quantity_a_benchmark_reports(tmp_path):
    pytest.importorskip("matplotlib")
    from lit_parallel.commands.bench import plot

    report = {
        "settings": {"devices": 2, "accelerator": "cpu"},
        "benchmarks": {
            "fsdp": {
                "variants": {
                    "fsdp_blocks": {"median_step_s": 0.02, "state_bytes": 4e6, "sent_bytes_per_step": 6e6},
                    "ddp_tuned": {"median_step_s": 0.01, "state_bytes": 8e6, "sent_bytes_per_step": 4e6},
                }
            },
            "callbacks": {"variants": {"none": {"train_step_s": 0.01}}},
        },
    }
    written = plot(report, tmp_path)
    assert [p.name for p in written] == ["step_time.png", "bytes_per_rank.png", "bytes_communicated.png"]
