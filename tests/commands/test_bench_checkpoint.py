"""`lit-parallel bench checkpoint`: its arguments, the model size it picks, how it reduces the ranks'
measurements (worked out here by hand), and one short run on 2 gloo ranks whose every checkpoint is complete.
Times are measured by the program, never asserted here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lit_parallel.commands.bench import checkpoint as bench_checkpoint
from lit_parallel.commands.cli import build_parser, main


def _args(*argv: str):
    return build_parser(["bench", "checkpoint"]).parse_args(["bench", "checkpoint", *argv])


def test_the_strategies_asked_for_in_their_order_and_all_five_by_default():
    assert bench_checkpoint.check_arguments(_args()) == ["ddp_tuned", "fsdp_blocks", "hsdp", "tp_dp", "pp_dp"]
    assert bench_checkpoint.check_arguments(_args("--strategies", "pp_dp, ddp_tuned")) == [
        "pp_dp",
        "ddp_tuned",
    ]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--strategies", "ddp_tuned,fsdp"],
            "unknown strategy(s) ['fsdp']; choose from ddp_tuned, fsdp_blocks",
        ),
        (["--strategies", ","], "--strategies=',': unknown strategy(s) []"),
        (["--strategies", "hsdp,hsdp"], "--strategies='hsdp,hsdp' names a strategy twice"),
        (["--devices", "3"], "--devices=3 must be even and at least 2"),
        (["--saves", "1"], "--saves=1, --every=8, --warmup=3: at least 2 saves"),
        (["--every", "0"], "--saves=5, --every=0, --warmup=3: at least 2 saves"),
        (["--size-mb", "0"], "--size-mb=0.0 must be positive"),
        (["--checkpoint-dir", "no/such/folder"], "--checkpoint-dir='no/such/folder' is not a folder"),
    ],
)
def test_bad_arguments_exit_with_code_2_naming_the_value_and_the_rule(argv, message, capsys):
    assert main(["bench", "checkpoint", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lit-parallel bench: error:") and message in err, err


def test_every_option_reaches_the_ranks(monkeypatch, tmp_path):
    """What run() hands torchrun parses, on the ranks, into the same settings (argument handling only)."""
    from lit_parallel.commands.bench import common

    seen = {}

    def capture(module, args, forwarded, print_report):
        seen.update(module=module, forwarded=forwarded)
        return 0

    monkeypatch.setattr(common, "launch_and_report", capture)
    argv = ["--devices", "4", "--accelerator", "cpu", "--strategies", "hsdp,tp_dp", "--size-mb", "12.5"]
    argv += ["--saves", "3", "--every", "4", "--warmup", "2", "--checkpoint-dir", str(tmp_path)]
    argv += ["--out", str(tmp_path / "plots")]
    args = _args(*argv)
    assert bench_checkpoint.run(args) == 0
    assert seen["module"] == "lit_parallel.commands.bench.checkpoint"
    on_ranks = _args(*seen["forwarded"], "--worker")
    hidden = {"worker", "result", "json", "command", "benchmark", "_run"}
    assert {k: v for k, v in vars(on_ranks).items() if k not in hidden} == {
        k: v for k, v in vars(args).items() if k not in hidden
    }


def test_the_parameter_count_is_the_models_and_the_width_the_closest_to_the_size_asked():
    from lit_parallel.commands.bench.common import make_gpt

    for width in (32, 64, 96):
        model = make_gpt(bench_checkpoint._model_args(width))
        assert bench_checkpoint.gpt_parameters(width) == sum(p.numel() for p in model.parameters())
    step = bench_checkpoint.WIDTH_STEP
    for size_mb in (1.0, 30.0, 300.0):
        width = bench_checkpoint.width_for(size_mb)
        assert width % step == 0
        miss = abs(bench_checkpoint.state_bytes(width) - size_mb * 1e6)
        for other in (width - step, width + step):
            if other >= step:
                assert miss <= abs(bench_checkpoint.state_bytes(other) - size_mb * 1e6)


def _rank(steps, saves, writes, host=None, most_in_flight=0):
    return {
        "steps": steps,
        "saves": saves,
        "writes": writes,
        "host_bytes": host,
        "host_allocated_bytes": host,
        "most_in_flight": most_in_flight,
    }


def test_a_runs_figures_are_the_slowest_ranks_and_medians_over_the_saves_after_the_first():
    # per step (seconds, write pending at its start, ... at its end) on 2 ranks
    steps0 = [(0.10, False, False), (0.30, True, True), (0.20, True, False), (0.12, False, False)]
    steps1 = [(0.11, False, False), (0.25, False, True), (0.22, False, False), (0.10, False, True)]
    ranks = [
        _rank(
            steps0, [(2.0, False), (0.10, False), (0.30, True)], [1.0, 3.0, 2.0], host=100, most_in_flight=1
        ),
        _rank(
            steps1, [(1.0, False), (0.20, False), (0.10, False)], [1.5, 2.0, 4.0], host=90, most_in_flight=2
        ),
    ]
    ranks[0]["verified"], ranks[0]["checkpoint_bytes"] = ["sharded"] * 3, 1234
    m = bench_checkpoint.summarize(ranks, "async")
    assert m["blocked_per_save_s"] == [2.0, 0.20, 0.30]  # the slowest rank's, save by save
    assert m["first_blocked_s"] == 2.0 and m["blocked_s"] == pytest.approx(0.25)  # median of 0.20 and 0.30
    assert m["saves_that_waited_for_a_write"] == 1 and m["most_writes_in_flight"] == 2
    assert m["write_per_save_s"] == [1.5, 3.0, 4.0] and m["write_s"] == pytest.approx(3.5)
    # steps 1 and 2 began with a write pending (on rank 0); step 0 had none; step 3 ended with one on rank 1
    assert (m["steps_during_write"], m["steps_no_write"]) == (2, 1)
    assert m["step_during_write_s"] == pytest.approx(0.26) and m["step_s"] == pytest.approx(0.11)
    assert m["slowdown"] == pytest.approx(0.26 / 0.11)
    # 2 steps over 3 saves overlapped a write, each 0.15 s slower than a step without one
    assert m["cost_per_save_s"] == pytest.approx(0.25 + 2 / 3 * 0.15)
    assert m["host_bytes_per_rank"] == [100, 90] and m["host_allocated_bytes_per_rank"] == [100, 90]
    assert m["verified"] == ["sharded"] * 3
    assert m["checkpoint_bytes"] == 1234


def test_a_synchronous_run_has_no_write_and_no_slowdown_and_the_ratio_is_against_it():
    sync = [_rank([(0.1, False, False)] * 3, [(1.0, False), (2.0, False), (4.0, False)], [])] * 2
    background = [
        _rank([(0.1, False, False)] * 3, [(0.5, False), (0.1, False), (0.3, False)], [2.0] * 3, 7)
    ] * 2
    config = {"devices": 2}
    result = bench_checkpoint.report(config, {"fsdp_blocks": {"sync": sync, "async": background}})
    s = result["strategies"]["fsdp_blocks"]
    assert s["layout"] == "sharded over 2"
    assert s["modes"]["sync"]["write_s"] is None and s["modes"]["sync"]["slowdown"] is None
    assert "host_bytes_per_rank" not in s["modes"]["sync"]
    assert s["modes"]["sync"]["blocked_s"] == 3.0 and s["modes"]["async"]["blocked_s"] == pytest.approx(0.2)
    assert s["modes"]["sync"]["cost_per_save_s"] == 3.0  # no write overlaps a step
    assert s["blocked_ratio"] == {"async_vs_sync": pytest.approx(0.2 / 3.0)}


TINY = ["--size-mb=1", "--saves=2", "--every=2", "--warmup=1"]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_bench_checkpoint_saves_complete_checkpoints_and_reports_every_mode_on_2_ranks(tmp_path):
    path = tmp_path / "ck.json"
    res = subprocess.run(
        [sys.executable, "-m", "lit_parallel.commands.cli", "bench", "checkpoint", "--devices=2", *TINY]
        + ["--strategies=ddp_tuned,fsdp_blocks", f"--checkpoint-dir={tmp_path}", f"--json={path}"],
        capture_output=True,
        text=True,
        timeout=110,
        env=dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200"),
        check=False,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    result = json.loads(path.read_text())
    cfg = result["config"]
    width = bench_checkpoint.width_for(1)
    assert (cfg["devices"], cfg["backend"], cfg["width"]) == (2, "gloo", width)
    assert cfg["state_bytes"] == bench_checkpoint.state_bytes(width)
    assert list(result["strategies"]) == ["ddp_tuned", "fsdp_blocks"]
    ddp, fsdp = result["strategies"]["ddp_tuned"], result["strategies"]["fsdp_blocks"]
    assert list(ddp["modes"]) == ["sync", "async", "lightning_async"] and list(fsdp["modes"]) == [
        "sync",
        "async",
    ]
    assert set(ddp["blocked_ratio"]) == {"async_vs_sync", "lightning_async_vs_sync"}
    for strategy, kind in ((ddp, "file"), (fsdp, "sharded")):
        for mode, m in strategy["modes"].items():
            assert m["verified"] == [kind, kind], mode  # every save complete once fit returned
            assert len(m["blocked_per_save_s"]) == 2 and m["blocked_s"] > 0
            if mode == "sync":
                assert (m["steps_no_write"], m["steps_during_write"]) == (1 + 2 * 2, 0)
                assert m["most_writes_in_flight"] == 0
            else:
                assert m["steps_no_write"] + m["steps_during_write"] <= 1 + 2 * 2
            assert len(m["write_per_save_s"]) == (0 if mode == "sync" else 2)
            assert m["checkpoint_bytes"] > cfg["state_bytes"]  # the state and Lightning's entries
    # the host copy: rank 0 alone saves ddp_tuned's file; fsdp_blocks' ranks each hold half the state
    ddp_host = ddp["modes"]["async"]["host_bytes_per_rank"]
    assert ddp_host[0] >= cfg["state_bytes"] and ddp_host[1] == 0
    fsdp_host = fsdp["modes"]["async"]["host_bytes_per_rank"]
    assert all(0.45 * cfg["state_bytes"] < h < 0.55 * cfg["state_bytes"] for h in fsdp_host), fsdp_host
    # allocated at the first save and reused by the second: no byte allocated beyond the copy itself
    assert fsdp["modes"]["async"]["host_allocated_bytes_per_rank"] == fsdp_host
    assert all(s["modes"]["async"]["most_writes_in_flight"] <= 1 for s in (ddp, fsdp))  # one copy at most
    assert "bench checkpoint" in res.stdout and "Lightning ddp + AsyncCheckpointIO" in res.stdout
    png = tmp_path / "checkpoint_bench.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and result["plots"] == [str(png)]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("lit-parallel-bench")] == []  # removed
