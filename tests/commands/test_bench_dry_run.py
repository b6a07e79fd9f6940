"""`lit-parallel bench dry-run`: its table and JSON (the times themselves are not asserted)."""

from __future__ import annotations

import json
import math

import pytest

from lit_parallel.commands.bench.dry_run import LAYOUTS, TINY
from lit_parallel.commands.cli import main


def test_every_layout_up_to_the_largest_world_is_dry_run_and_reported(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    out = tmp_path / "dry.json"
    assert (
        main(
            ["bench", "dry-run", "--model", "tiny", "--repeats", "2", "--max-world", "64", "--json", str(out)]
        )
        == 0
    )
    rows = json.loads(out.read_text())["rows"]
    expected = [(s, d * n) for s, _, d, n in LAYOUTS if d * n <= 64]
    assert [(r["strategy"], r["world_size"]) for r in rows] == expected
    for r in rows:
        assert len(r["times_s"]) == 2 and r["median_s"] > 0
    # fsdp_blocks over 64 ranks: the first and last rank; its state by hand: every parameter's rows padded to a
    # multiple of 64, 16 bytes each (bf16-mixed: fp32 parameter and gradient, AdamW's two fp32 states)
    fsdp = next(r for r in rows if r["strategy"] == "fsdp_blocks" and r["world_size"] == 64)
    h, f, v = TINY["hidden_size"], TINY["intermediate_size"], TINY["vocab_size"]
    shapes = [(h, h)] * 4 + [(f, h)] * 2 + [(h, f)] + [(h, 1)] * 2  # q k v o, gate up, down, two norms
    per_layer = sum(math.ceil(rows_ / 64) * cols for rows_, cols in shapes)
    elements = TINY["num_hidden_layers"] * per_layer + 2 * math.ceil(v / 64) * h + math.ceil(h / 64)
    assert fsdp["positions"] == 2 and fsdp["largest_rank_state_bytes"] == 16 * elements
    assert "dry-run time (median of the repeats)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"), [(["--repeats", "0"], "--repeats=0"), (["--max-world", "1"], "--max-world=1")]
)
def test_bad_arguments_are_refused(args, message, capsys):
    assert main(["bench", "dry-run", "--model", "tiny", *args]) == 2
    assert message in capsys.readouterr().err
