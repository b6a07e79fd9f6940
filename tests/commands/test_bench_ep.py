"""`lit-parallel bench ep`: its arguments, the byte prediction it prints next to what it counts (worked out
here by hand from the model's sizes), and one short run on 2 gloo ranks whose counted bytes equal it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from lit_parallel.commands.bench import ep as bench_ep
from lit_parallel.commands.cli import build_parser, main

pytest.importorskip("transformers")

# A tiny Mixtral: H hidden, INNER wide inside each expert, E experts top-K, L layers, V vocabulary; 4 heads, no biases.
H, INNER, E, K, L, V, SEQ, BATCH = 32, 64, 8, 2, 2, 128, 16, 2
TINY = [f"--hidden={H}", f"--intermediate={INNER}", f"--experts={E}", f"--top-k={K}", f"--layers={L}"]
TINY += [f"--vocab={V}", f"--seq={SEQ}", f"--batch-size={BATCH}", "--heads=4"]


def _args(*argv: str):
    return build_parser(["bench", "ep"]).parse_args(["bench", "ep", *argv])


def test_expert_parallel_size_defaults_to_the_number_of_ranks():
    assert bench_ep.check_arguments(_args("--devices", "4")) == 4
    assert bench_ep.check_arguments(_args("--devices", "4", "--expert-parallel-size", "2")) == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--devices", "4", "--expert-parallel-size", "3"],
            "--expert-parallel-size=3 must be at least 2 and divide",
        ),
        (["--devices", "4", "--experts", "6"], "--expert-parallel-size=4 must be at least 2 and divide both"),
        (["--devices", "1"], "--devices=1: expert parallelism needs at least 2 ranks"),
        (["--top-k", "9"], "--top-k=9 must be between 1 and --experts=8"),
        (["--hidden", "30"], "--hidden=30 must be a multiple of --heads=4"),
        (["--warmup", "1"], "--warmup=1: repeats and steps must be at least 1 and warmup at least 2"),
    ],
)
def test_bad_sizes_exit_with_code_2_naming_the_value_and_the_rule(argv, message, capsys):
    assert main(["bench", "ep", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lit-parallel bench: error:") and message in err, err
    if "divide both" in message:
        assert "choose one of [2]" in err  # 6 experts on 4 ranks: only 2 divides both


def test_every_option_reaches_the_ranks(monkeypatch, tmp_path):
    """What run() hands torchrun parses, on the ranks, into the same settings (argument handling only)."""
    from lit_parallel.commands.bench import common

    seen = {}

    def capture(module, args, forwarded, print_report):
        seen.update(module=module, forwarded=forwarded)
        return 0

    monkeypatch.setattr(common, "launch_and_report", capture)
    argv = ["--devices", "4", "--expert-parallel-size", "2", *TINY, "--steps=3", "--warmup=2", "--repeats=2"]
    argv += ["--accelerator", "cpu", "--out", str(tmp_path / "plots")]
    args = _args(*argv)
    assert bench_ep.run(args) == 0
    assert seen["module"] == "lit_parallel.commands.bench.ep"
    on_ranks = _args(*seen["forwarded"], "--worker")
    hidden = {"worker", "result", "json", "command", "benchmark", "_run"}
    assert {k: v for k, v in vars(on_ranks).items() if k not in hidden} == {
        k: v for k, v in vars(args).items() if k not in hidden
    }


def _block_bytes(experts: bool) -> int:
    """fp32 bytes of one decoder layer: attention q, k, v, o (H x H each), two norms (H), the router (E x H),
    and the experts: gate_up (E x 2I x H) and down (E x H x INNER)."""
    return 4 * (4 * H * H + 2 * H + E * H + (3 * E * H * INNER if experts else 0))


ROOT_BYTES = 4 * (2 * V * H + H)  # embedding and lm_head (V x H), final norm (H)
EXPERT_BYTES = 4 * 3 * E * H * INNER  # one layer's experts


def test_prediction_of_fsdp_bytes_from_the_parameter_sizes():
    model = bench_ep.make_mixtral(
        SimpleNamespace(hidden=H, intermediate=INNER, experts=E, top_k=K, layers=L, heads=4, vocab=V, seq=SEQ)
    )
    block = _block_bytes(experts=True)
    # without EP every block is gathered in forward and again in backward, the root once; all reduce-scattered
    assert bench_ep.predicted_fsdp_bytes(model, 2, 1) == {
        "all_gather": 2 * L * block + ROOT_BYTES,
        "reduce_scatter": L * block + ROOT_BYTES,
    }
    # EP 2 on 2 ranks: each rank's experts are FSDP over one rank, which sends nothing
    outside = _block_bytes(experts=False)
    assert bench_ep.predicted_fsdp_bytes(model, 2, 2) == {
        "all_gather": 2 * L * outside + ROOT_BYTES,
        "reduce_scatter": L * outside + ROOT_BYTES,
    }
    # EP 2 on 4 ranks: half the experts per rank, gathered over the 2 ranks holding them
    assert bench_ep.predicted_fsdp_bytes(model, 4, 2) == {
        "all_gather": 2 * L * (outside + EXPERT_BYTES // 2) + ROOT_BYTES,
        "reduce_scatter": L * (outside + EXPERT_BYTES // 2) + ROOT_BYTES,
    }


def test_prediction_pads_the_first_dimension_to_a_multiple_of_the_ranks():
    # 6 experts, vocabulary 130 on 4 ranks: router 6 -> 8 rows, embedding and lm_head 130 -> 132 rows;
    # EP 2: 3 experts per rank, over 2 ranks -> 4
    sizes = dict(hidden=H, intermediate=INNER, experts=6, top_k=K, layers=L, heads=4, vocab=130, seq=SEQ)
    model = bench_ep.make_mixtral(SimpleNamespace(**sizes))
    outside = 4 * (4 * H * H + 2 * H + 8 * H)
    experts = 4 * 3 * 4 * H * INNER
    root = 4 * (2 * 132 * H + H)
    assert bench_ep.predicted_fsdp_bytes(model, 4, 2) == {
        "all_gather": 2 * L * (outside + experts) + root,
        "reduce_scatter": L * (outside + experts) + root,
    }


def test_prediction_of_all_to_all_bytes_from_the_routing():
    exchange = {"calls": 2, "rows_sent": 64, "rows_received": 70}
    # counts: E int64 per call; rows: received in dispatch, own rows back in combine, both again in backward
    assert bench_ep.predicted_all_to_all_bytes(exchange, E, H, 4) == 2 * E * 8 + 2 * (64 + 70) * H * 4


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_bench_ep_counts_exactly_the_predicted_bytes_on_2_ranks(tmp_path):
    path = tmp_path / "ep.json"
    res = subprocess.run(
        [sys.executable, "-m", "lit_parallel.commands.cli", "bench", "ep", "--devices=2", *TINY]
        + ["--steps=1", "--warmup=2", "--repeats=1", f"--json={path}"],
        capture_output=True,
        text=True,
        timeout=220,
        env=dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200"),
        check=False,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    result = json.loads(path.read_text())
    assert result["config"]["params"] == (L * _block_bytes(True) + ROOT_BYTES) // 4
    plain, ep = result["variants"]["fsdp_blocks"], result["variants"]["fsdp_blocks_ep"]
    assert plain["ratio_vs_fsdp_blocks"] == 1.0 and ep["ratio_vs_fsdp_blocks"] > 0
    tokens = BATCH * SEQ
    for rank in range(2):
        p, e = plain["ranks"][rank], ep["ranks"][rank]
        assert p["payload"] == {
            "all_gather": 2 * L * _block_bytes(True) + ROOT_BYTES,
            "reduce_scatter": L * _block_bytes(True) + ROOT_BYTES,
            "all_to_all": 0,
        }
        x = e["exchange"]
        assert x["calls"] == L and x["rows_sent"] == L * tokens * K and x["dropped"] == 0
        assert e["payload"] == {
            "all_gather": 2 * L * _block_bytes(False) + ROOT_BYTES,
            "reduce_scatter": L * _block_bytes(False) + ROOT_BYTES,
            "all_to_all": L * E * 8 + 2 * (x["rows_sent"] + x["rows_received"]) * H * 4,
        }
        assert p["matches_prediction"] and e["matches_prediction"]
        assert e["local"] == {}  # FSDP over one rank issued nothing
    # every pair one rank sends, another (or itself) receives
    assert sum(r["exchange"]["rows_received"] for r in ep["ranks"]) == 2 * L * tokens * K
    assert "bench ep" in res.stdout and "exact" in res.stdout
    png = tmp_path / "ep_bench.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and result["plots"] == [str(png)]
