"""`lit-parallel advise --dry-run`: the report, its JSON, and bad input."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from lit_parallel.commands.cli import main

MODEL = ["--model", "tests.planner.dry_run.test_dry_run:llama"]


def test_every_strategy_is_dry_run_with_its_formula_and_auto_parallels_choice(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    out = tmp_path / "dry.json"
    args = ["advise", *MODEL, "--devices", "2", "--nodes", "4", "--dry-run", "--pipeline-parallel-size", "2"]
    assert main([*args, "--precision", "32-true", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "8 simulated ranks" in text
    runs = json.loads(out.read_text())["dry_run"]["runs"]
    assert [r["strategy"] for r in runs][:5] == ["ddp_tuned", "fsdp_blocks", "hsdp", "tp_dp", "pp_dp"]
    for r in runs:
        assert r["error"] is None, r
        assert r["formula"]["equal"], r  # the planner's formula for the largest rank
        assert r["formula"]["state_bytes"] == max(rank["state_bytes"] for rank in r["ranks"])
    auto = runs[-1]
    assert auto["decision"].startswith(f"auto_parallel chose {auto['strategy']}")
    # pp_dp over 8 ranks: 2 stages x 4 data-parallel ranks, the first and last of each stage
    pp = runs[4]
    assert [(r["rank"], r["coordinates"]) for r in pp["ranks"]] == [
        (0, {"pipeline_parallel": 0, "data_parallel": 0, "tensor_parallel": 0}),
        (3, {"pipeline_parallel": 0, "data_parallel": 3, "tensor_parallel": 0}),
        (4, {"pipeline_parallel": 1, "data_parallel": 0, "tensor_parallel": 0}),
        (7, {"pipeline_parallel": 1, "data_parallel": 3, "tensor_parallel": 0}),
    ]
    assert "largest pipeline stage" in text and "tensor parallel splits 28 parameter(s)" in text
    assert sorted(runs[3]["tensor_parallel"]["replicated"])[:2] == [
        "lm_head.weight",
        "model.embed_tokens.weight",
    ]


def test_a_failing_setup_is_reported_with_its_fix_and_the_step_beside_advise(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    args = ["advise", *MODEL, "--devices", "8", "--nodes", "2", "--dry-run", "--step", "--seq-len", "32"]
    assert (
        main([*args, "--strategy", "tp_dp", "--tensor-parallel-size", "8", "--strategy", "fsdp_blocks"]) == 0
    )
    text = capsys.readouterr().out
    assert "setup fails" in text and "Choose tensor_parallel_size from 1 or 2" in text
    assert "one step of rank 0 on fake tensors (tokens (1, 32)), torch's MemTracker: peak" in text
    assert "lit_parallel's LiveMemory:" in text
    assert "advise's prediction for the same step" in text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--params", "7B", "--dry-run"], "--dry-run needs --model"),
        ([*MODEL, "--dry-run", "--verify", "--precision", "32-true"], "--dry-run and --verify are two runs"),
        (
            [*MODEL, "--dry-run", "--pipeline-parallel-size", "0"],
            "--pipeline-parallel-size=0 must be at least 1",
        ),
    ],
)
def test_bad_dry_run_input_is_refused_with_the_fix(args, message):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["advise", *args]) == 2
    assert message in err.getvalue()
