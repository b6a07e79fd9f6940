"""What the commands print fits the terminal: at 80 and 120 columns no line is wider, and every value of every
table is still there (not cut short with an ellipsis). `advise` runs for real; `doctor`, `bench` and the
demo's summary print result objects made by the code (or shaped as the code makes them)."""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import re
import textwrap

import pytest
from rich.console import Console
from rich.table import Table

from lit_parallel.commands.terminal import Column, fit_table
from lit_parallel.formatting import format_bytes

WIDTHS = (80, 120)


def _norm(text: str) -> str:
    """Whitespace collapsed, and none after a character a long word may break after (``(``, ``,``, ``=``,
    ``/``): the same text however it was wrapped."""
    return re.sub(r"([(,=/]) ", r"\1", " ".join(text.split()))


def _as_read(output: str) -> str:
    """``output`` as a reader takes it in: each table column by column, top to bottom (the lines of a cell
    that wraps joined up), the other lines as they are."""
    parts: list[str] = []
    table: list[list[str]] = []

    def end_table() -> None:
        parts.extend(" ".join(column) for column in zip(*table))
        table.clear()

    for line in output.splitlines():
        s = line.strip()
        if s[:1] in ("┃", "│"):
            table.append([cell.strip() for cell in re.split("[┃│]", s)[1:-1]])
        elif s[:1] in ("┏", "┌", "┡", "├", "└"):  # a border: the top one starts a table
            if s[:1] in ("┏", "┌"):
                end_table()
        else:
            end_table()
            parts.append(s)
    end_table()
    return _norm(" ".join(parts))


def assert_fits_and_shows(output: str, width: int, values) -> None:
    too_wide = [line for line in output.splitlines() if len(line) > width]
    assert not too_wide, f"{len(too_wide)} line(s) wider than {width} columns:\n" + "\n".join(too_wide)
    assert "…" not in output, f"a cell was cut short:\n{output}"
    text = f" {_as_read(output)} "
    lost = [v for v in map(str, values) if f" {_norm(v)} " not in text]
    assert not lost, f"missing at {width} columns: {lost}\n{output}"


# --- the renderer --------------------------------------------------------------------------------------------

COLUMNS = [Column("name"), Column("how", wrap=True), Column("size", "right"), Column("fits", "center")]
ROWS = [
    ["ZeRO-2", "fsdp_blocks(reshard_after_forward=False)", "15.75 GB", "yes"],
    ["DDP", "a replica of everything on every rank, gradients all-reduced", "112.00 GB", "no"],
]


def _render(renderable, width: int) -> str:
    console = Console(width=width, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(renderable)
    return console.export_text()


def test_a_table_that_fits_stays_a_table_with_long_text_wrapped_between_words():
    out = _render(fit_table(COLUMNS, ROWS, width=60, title="t"), 60)
    assert isinstance(fit_table(COLUMNS, ROWS, width=60), Table) and "┃ name" in out
    assert_fits_and_shows(out, 60, [c for row in ROWS for c in row])
    # the identifier, wider than its column, breaks after "(" and nowhere inside a name
    assert "│ fsdp_blocks(" in out and "reshard_after_forward=False)" in out


def test_a_table_that_cannot_fit_becomes_one_block_per_row():
    table = fit_table(COLUMNS, ROWS, width=40, title="t")
    out = _render(table, 40)
    assert not isinstance(table, Table) and "│" not in out
    assert_fits_and_shows(out, 40, [c.header for c in COLUMNS[1:]] + [c for row in ROWS for c in row])
    assert out.splitlines()[1] == "ZeRO-2" and out.splitlines()[2].split() == ["how", "fsdp_blocks("]


def test_a_wider_terminal_gets_a_table_a_narrower_one_the_same_values():
    wide, narrow = fit_table(COLUMNS, ROWS, width=120), fit_table(COLUMNS, ROWS, width=40)
    assert isinstance(wide, Table) and not isinstance(narrow, Table)
    assert "fsdp_blocks(reshard_after_forward=False)" in _render(wide, 120)  # on one line when it can be


def test_rows_must_have_a_cell_per_column():
    with pytest.raises(ValueError, match="every row needs 4 cells, one per column: \\[3\\]"):
        fit_table(COLUMNS, [["a", "b", "c"]], width=80)


# --- advise ------------------------------------------------------------------------------------------------


def _gb(n: float | None) -> str:
    return "-" if n is None else format_bytes(n, decimal=True)


@pytest.mark.parametrize("width", WIDTHS)
def test_advise_params_fits_the_terminal(width, capsys, monkeypatch):
    from lit_parallel.commands.cli import main
    from lit_parallel.planner.rules import advise

    monkeypatch.setenv("COLUMNS", str(width))
    assert main(["advise", "--params", "7B", "--devices", "8", "--memory-gb", "80"]) == 0
    out = capsys.readouterr().out
    a = advise(params=7_000_000_000, devices=8, memory_gb=80)
    values = ["lit_parallel", "shards", "params", "grads", "optimizer", "model state"]
    values.append(f"fits {_gb(a.usable_bytes)}")
    for r in a.rows:
        values += [r.name, r.strategy or "-", r.sharding]
        values += [_gb(b) for b in (r.param_bytes, r.grad_bytes, r.optimizer_bytes, r.state_bytes)]
        values.append("yes" if r.fits else "no")
    values += [evidence for _, _, evidence in a.evaluations]
    values.append(f"recommendation: {a.recommendation} (rule {a.rule.number}):")
    assert_fits_and_shows(out, width, values)
    if width == 120:  # the memory table is a table where it fits
        assert "┃ strategy" in out and "│ DDP " in out


@pytest.mark.parametrize("width", WIDTHS)
def test_advise_model_prediction_fits_the_terminal(width, capsys, monkeypatch, tmp_path):
    from lit_parallel.commands.cli import main
    from lit_parallel.measure.live_memory import CATEGORIES

    monkeypatch.setenv("COLUMNS", str(width))
    path = tmp_path / "advice.json"
    argv = ["advise", "--model", "tests.models:Llama", "--devices", "2", "--memory-gb", "2", "--no-step-time"]
    assert main([*argv, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    data = json.loads(path.read_text())
    values = [r["name"] for r in data["rows"]] + [_gb(r["activation_gb"] * 1e9) for r in data["rows"]]
    for entry in data["prediction"]["peak"].values():
        off, on = entry["activation_checkpointing_off"], entry["activation_checkpointing_on"]
        values += [entry["label"], _gb(off["total_bytes"]), _gb(on["total_bytes"])]
        values += [_gb(off[f"{c}_bytes"]) for c in CATEGORIES]
        moment = (
            off["moment"] if off["moment"] != off["phase"] else ""
        )  # the JSON's moment is at least the phase
        values.append(off["phase"] + (f" ({moment})" if moment else ""))
    assert_fits_and_shows(out, width, values)


@pytest.mark.parametrize("width", WIDTHS)
def test_advise_verification_table_fits_the_terminal(width, capsys, monkeypatch):
    from lit_parallel.commands.advise.compare import error_rows, print_verification
    from lit_parallel.commands.terminal import terminal_console
    from lit_parallel.measure.live_memory import MemoryPeak
    from lit_parallel.planner.memory.peak import LABELS, Peak

    monkeypatch.setenv("COLUMNS", str(width))
    predicted = Peak("zero2", 3.2e6, 1.1e6, 6.4e6, 2.5e6, 0.4e6, "forward", "block 3's all-gather")
    by_category = {"params": 3_100_000, "grads": 1_100_000, "optimizer": 6_400_000, "activations": 2_300_000}
    measured = MemoryPeak(total=sum(by_category.values()) + 500_000, by_category=by_category)
    step = {"compute_s": 0.010, "optimizer_s": 0.002, "comm_s": 0.004, "step_s": 0.0165}
    # torch's MemTracker's figures of the same step (its other categories are not shown)
    by_torch = {"total": 13_950_000, "PARAM": 3_100_000, "GRAD": 1_100_000}
    pairs = [(0.016, 0.015), (0.017, 0.0152)]
    rows = error_rows(LABELS["zero2"], predicted, measured, step, 0.0151, pairs, by_torch)
    print_verification(rows, terminal_console())
    out = capsys.readouterr().out
    values = ["each round's error", "within target", "MemTracker"]
    for row in rows:
        fmt = (lambda v: f"{v * 1e3:.1f} ms") if row["figure"].startswith("step") else _gb
        values += [row["strategy"], row["figure"], fmt(row["predicted"]), fmt(row["measured"])]
        values.append("-" if row["error"] is None else f"{row['error']:.1%}")
        values += [f"{e:+.0%}" for e in row.get("round_errors", [])]
        if row.get("mem_tracker") is not None:
            values += [fmt(row["mem_tracker"]), f"{row['mem_tracker_difference']:+.1%}"]
    assert_fits_and_shows(out, width, values)


# --- doctor ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("width", WIDTHS)
def test_doctor_report_fits_the_terminal(width, capsys, monkeypatch):
    from lit_parallel.commands.doctor import FIXES, SIZES, Check, environment_checks, print_report
    from lit_parallel.measure.collectives import bus_bandwidth

    monkeypatch.setenv("COLUMNS", str(width))
    _, checks, env_rows = environment_checks(2, "gloo")
    checks += [
        Check("process group initialises", True, "2 ranks on gloo in 0.41 s (launch 3.2 s)"),
        Check("all-reduce sanity (sum of ranks)", False, "got 3, expected N(N-1)/2 = 1", FIXES["wrong_sum"]),
    ]
    bandwidth = []
    for i, nbytes in enumerate(SIZES):
        time_s = 2e-5 * (i + 1) ** 3
        algbw, busbw = bus_bandwidth(nbytes, time_s, 2)
        bandwidth.append({"bytes": nbytes, "time_s": time_s, "algbw_gbps": algbw, "busbw_gbps": busbw})
    live = {"sum": 3, "world_size": 2, "backend": "gloo", "init_s": 0.41, "bandwidth": bandwidth}
    print_report(env_rows, checks, live)
    out = capsys.readouterr().out
    values = [v for row in env_rows for v in row] + [FIXES["wrong_sum"], "FAILED", "ok"]
    values += [v for c in checks for v in (c.name, c.detail)]
    for row in bandwidth:
        values += [format_bytes(row["bytes"]).replace(".00 ", " "), f"{row['time_s'] * 1e6:.1f}"]
        values += [f"{row['algbw_gbps']:.3f}", f"{row['busbw_gbps']:.3f}"]
    assert_fits_and_shows(out, width, values)


# --- bench -------------------------------------------------------------------------------------------------


def _bench_ddp_result() -> dict:
    from lit_parallel.commands.bench.ddp import VARIANTS, _report

    args = argparse.Namespace(devices=2, batch_size=32, steps=10, repeats=3, width=64, depth=3)
    times = {v: [0.0123 + 0.001 * i + 0.0004 * r for r in range(3)] for i, v in enumerate(VARIANTS)}
    sent = {"ddp_tuned": 35_520, "plain_ddp": 35_520, "lightning_ddp": None}
    tuned = {"bucket_caps_mb": [0.5, 25.0], "reason": "measured: 2 buckets overlap the backward best"}
    return _report(args, "gloo", times, sent, tuned)


def _bench_fsdp_result() -> dict:
    from lit_parallel.commands.bench.fsdp import VARIANTS

    counts = {"all_gather_into_tensor": 6, "reduce_scatter_tensor": 3}
    config = {"devices": 2, "backend": "gloo", "params": 3_712_512, "dim": 256, "layers": 4, "seq": 64}
    config |= {"batch_size": 4, "steps": 10, "repeats": 3, "zero3_bytes": 29_700_096.0}
    variants = {
        v: {
            "median_step_s": 0.081 + 0.01 * i,
            "samples_per_s": 8 / (0.081 + 0.01 * i),
            "ratio_vs_lightning_mp": 0.93 + 0.05 * i,
            "state_bytes": 29_812_224 * (1 + i),
            "state_vs_zero3": 1.004 * (1 + i),
            "sent_bytes_per_step": 44_568_576 - 1_000 * i,
            "sent_vs_ddp": 1.5 - 0.25 * i,
        }
        for i, v in enumerate(VARIANTS)
    }
    per_repeat = {v: [0.081, 0.082, 0.08] for v in VARIANTS}
    return {"config": config, "variants": variants, "collectives": dict.fromkeys(VARIANTS, counts)} | {
        "per_repeat": per_repeat
    }


def _bench_tp_result() -> dict:
    from lit_parallel.commands.bench.tp import VARIANTS

    config = {"devices": 2, "backend": "gloo", "params": 3_712_512, "dim": 256, "heads": 4, "layers": 4}
    config |= {"seq": 64, "global_batch": 8, "steps": 10, "repeats": 3, "tensor_parallel_size": 2}
    variants = {
        v: {
            "mesh": "1 x 2" if v != "fsdp_blocks" else "2 x 1",
            "median_step_s": 0.11 + 0.02 * i,
            "samples_per_s": 8 / (0.11 + 0.02 * i),
            "ratio_vs_fsdp": 1.31 - 0.1 * i,
            "param_bytes": 7_425_024 + 1_024 * i,
            "sent_bytes_per_step": 21_233_664 + 4_096 * i,
            "collectives": {"all_reduce": 16 + i, "all_gather_into_tensor": 2},
        }
        for i, v in enumerate(VARIANTS)
    }
    return {"config": config, "variants": variants, "per_repeat": {v: [0.11, 0.12] for v in VARIANTS}}


def _bench_pp_result() -> dict:
    from lit_parallel.commands.bench.pp import SCHEDULES
    from lit_parallel.parallel.pipeline.plan import bubble_fraction

    config = {"dim": 32, "layers": 2, "seq": 8, "batch_size": 8, "steps": 1}
    config |= {"devices": 2, "backend": "gloo", "params": 29_504}
    rows = [
        {
            "schedule": s,
            "microbatches": m,
            "theory": bubble_fraction(2, m),
            "idle": [0.31 / m, 0.37 / m],
            "step_s": 0.021 * m,
        }
        for s in SCHEDULES
        for m in (2, 4)
    ]
    plots = ["bench-pp/pp_bubble.png", "bench-pp/pp_timeline_GPipe.png"]
    return {"config": config, "rows": rows, "timelines": {}, "plots": plots}


def _bench_ep_result() -> dict:
    pytest.importorskip("transformers")
    from lit_parallel.commands.bench.ep import VARIANTS, _report

    sizes = dict(hidden=32, intermediate=64, experts=8, top_k=2, layers=2, heads=4, vocab=128, seq=16)
    args = argparse.Namespace(**sizes, batch_size=2, steps=10, repeats=3, expert_parallel_size=2)
    times = {v: [0.21 - 0.05 * i + 0.001 * r for r in range(3)] for i, v in enumerate(VARIANTS)}
    ranks = {
        v: [
            {
                "payload": {"all_gather": 889_984 // (1 + 8 * i), "reduce_scatter": 461_440 // (1 + 6 * i)}
                | {"all_to_all": i * (64 + 1_234 * r)},
                "local": {},
                "calls": {"all_gather": 5, "reduce_scatter": 3} | ({"all_to_all": 10} if i else {}),
                "exchange": {"calls": 2 * i, "rows_sent": 128 * i, "rows_received": (120 + 16 * r) * i}
                | {"rows_sent_remote": 64 * i, "rows_received_remote": 60 * i, "dropped": 0},
                "param_bytes": 230_528,
            }
            for r in range(2)
        ]
        for i, v in enumerate(VARIANTS)
    }
    return _report(args, 2, "gloo", times, ranks)


def _bench_callbacks_result() -> dict:
    from lit_parallel.commands.bench.callbacks import VARIANTS, _medians

    raw = {
        v: [
            {
                "train_step_s": 0.0100 + 0.0007 * i + 0.0001 * r,
                "val_step_s": 0.0040 + 0.0003 * i,
                "epoch_end_s": 0.0020 * i + 0.0001,
                "hook_s_per_step": 0.00002 * i,
                "val_hook_s_per_step": 0.00003 * i,
                "epoch_train_s": 0.2,
            }
            for r in range(3)
        ]
        for i, v in enumerate(VARIANTS)
    }
    config = {"devices": 2, "backend": "gloo", "strategy": "ddp", "params": 1_064_970, "batch_size": 256}
    config |= {"steps": 20, "epochs": 3, "repeats": 3}
    return {"config": config, "variants": _medians(raw), "per_repeat": raw}


def _bench_checkpoint_result() -> dict:
    from lit_parallel.commands.bench.checkpoint import STRATEGIES, modes_of, report

    def ranks(i: int, mode: str) -> list[dict]:
        background = mode != "sync"
        steps = [(0.3 + 0.01 * k, background and k % 3 == 1, False) for k in range(10)]
        saves = [((2.5 + 0.1 * i) / (20 if background else 1) * (1 + 0.1 * k), k == 2) for k in range(4)]
        writes = [3.1 + 0.2 * k for k in range(4)] if background else []
        host = 145_000_000 * (1 + (i % 2)) if mode == "async" else None
        return [
            {
                "steps": steps,
                "saves": saves,
                "writes": writes,
                "host_bytes": host,
                "host_allocated_bytes": host,
            }
            | {"most_in_flight": int(background)}
            | ({"verified": ["sharded"] * 4, "checkpoint_bytes": 290_000_000} if rank == 0 else {})
            for rank in range(2)
        ]

    runs = {name: {mode: ranks(i, mode) for mode in modes_of(name)} for i, name in enumerate(STRATEGIES)}
    config = {"devices": 2, "backend": "gloo", "params": 24_200_000, "state_bytes": 290_480_000, "saves": 4}
    return report(config | {"every": 8}, runs)


def _bench_values(name: str, result: dict) -> list[str]:
    """Every figure `bench NAME`'s table prints, formatted as its columns state them."""
    v = result.get("variants", {})
    if name == "ddp":
        return [
            s
            for k, x in v.items()
            for s in (
                k,
                f"{x['median_step_s'] * 1e3:.1f}",
                f"{x['samples_per_s']:.1f}",
                f"{x['ratio_vs_lightning_ddp']:.3f}",
                f"{x['ratio_vs_plain']:.3f}",
                "same reducer" if x["bytes_per_step"] is None else f"{x['bytes_per_step']:,}",
            )
        ] + [
            "step time (ms)",
            "vs lightning ddp",
            "vs plain loop",
            "bytes/step",
            result["ddp_tuned"]["reason"],
        ]
    if name == "fsdp":
        return [
            s
            for k, x in v.items()
            for s in (
                k,
                f"{x['median_step_s'] * 1e3:.1f}",
                f"{x['samples_per_s']:.1f}",
                f"{x['ratio_vs_lightning_mp']:.3f}",
                format_bytes(x["state_bytes"]),
                f"{x['state_vs_zero3']:.3f}",
                format_bytes(x["sent_bytes_per_step"]),
                f"{x['sent_vs_ddp']:.3f}",
            )
        ] + ["state bytes/rank", "vs 16P/N", "sent/step", "vs lightning_mp"]
    if name == "tp":
        return [
            s
            for k, x in v.items()
            for s in (
                k,
                x["mesh"],
                f"{x['median_step_s'] * 1e3:.1f}",
                f"{x['samples_per_s']:.1f}",
                f"{x['ratio_vs_fsdp']:.3f}",
                format_bytes(x["param_bytes"]),
                format_bytes(x["sent_bytes_per_step"]),
            )
        ] + ["mesh (dp x tp)", "vs fsdp_blocks", "params/rank"]
    if name == "pp":
        return [
            s
            for r in result["rows"]
            for s in (
                r["schedule"],
                str(r["microbatches"]),
                f"{r['theory']:.1%}",
                *(f"{x:.1%}" for x in r["idle"]),
                f"{r['step_s'] * 1e3:.1f}",
            )
        ] + ["theory (P-1)/(M+P-1)", "idle rank 0", "idle rank 1", *result["plots"]]
    if name == "ep":
        return [
            s
            for k, x in v.items()
            for s in (
                k,
                x["experts_per_rank"],
                f"{x['median_step_s'] * 1e3:.1f}",
                f"{x['tokens_per_s']:,.0f}",
                f"{x['ratio_vs_fsdp_blocks']:.3f}",
                format_bytes(x["param_bytes"]),
                *(
                    c
                    for r in x["ranks"]
                    for c in (
                        *(format_bytes(r["payload"][kind]) for kind in ("all_gather", "reduce_scatter")),
                        format_bytes(r["payload"]["all_to_all"]),
                        format_bytes(r["total"]),
                        "exact" if r["matches_prediction"] else format_bytes(r["predicted_total"]),
                    )
                ),
            )
        ] + ["experts/rank", "vs fsdp_blocks", "all-gather", "reduce-scatter", "all-to-all", "predicted"]
    if name == "checkpoint":
        from lit_parallel.commands.bench.checkpoint import MODE_CELLS

        return [
            s
            for n, x in result["strategies"].items()
            for mode, m in x["modes"].items()
            for s in (
                n,
                MODE_CELLS[mode],
                f"{m['blocked_s'] * 1e3:.1f}",
                f"{x['blocked_ratio'].get(f'{mode}_vs_sync', 1.0):.3f}",
                f"{m['first_blocked_s'] * 1e3:.1f}",
                "-" if m["write_s"] is None else f"{m['write_s'] * 1e3:.1f}",
                *([format_bytes(max(m["host_bytes_per_rank"]), decimal=True)] if mode == "async" else []),
                f"{m['step_s'] * 1e3:.1f}",
                "-" if m["slowdown"] is None else f"x{m['slowdown']:.2f}",
                f"{m['cost_per_save_s'] * 1e3:.1f}",
            )
        ] + ["blocked/save (ms)", "first save (ms)", "host copy/rank", "during a write", "cost/save (ms)"]
    base = v["none"]
    return [
        s
        for k, x in v.items()
        for s in (
            k if k != "SyncBatchNormConversion" else "SyncBatchNormConversion (sync cost)",
            f"{x['train_step_s'] * 1e3:.2f}",
            f"{(x['train_step_ratio'] - 1) * 100:+.1f}%",
            f"{x['hook_s_per_step'] * 1e6:.0f}",
            f"{x['hook_s_per_step'] / base['train_step_s'] * 100:.2f}%",
            f"{x['epoch_end_s'] * 1e3:.2f}",
            f"{x['epoch_end_share'] * 100:.2f}%",
            f"{(x['val_step_ratio'] - 1) * 100:+.1f}%",
            f"{x['val_hook_s_per_step'] * 1e6:.0f}",
        )
    ] + ["val hooks/step (us)", "epoch-end share", "val step overhead"]


BENCH_RESULTS = {
    "ddp": _bench_ddp_result,
    "fsdp": _bench_fsdp_result,
    "tp": _bench_tp_result,
    "pp": _bench_pp_result,
    "ep": _bench_ep_result,
    "callbacks": _bench_callbacks_result,
    "checkpoint": _bench_checkpoint_result,
}


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("name", list(BENCH_RESULTS))
def test_bench_report_fits_the_terminal(name, width, capsys, monkeypatch):
    import importlib

    from lit_parallel.commands.cli import BENCHMARKS

    monkeypatch.setenv("COLUMNS", str(width))
    result = BENCH_RESULTS[name]()
    importlib.import_module(BENCHMARKS[name][0]).print_report(result)
    assert_fits_and_shows(capsys.readouterr().out, width, _bench_values(name, result))


# --- demo --------------------------------------------------------------------------------------------------

DEMO_RESULT = {
    "strategy": "fsdp_blocks",
    "auto": "rule 7: sharded over all 2 ranks: 2.12 MB <= 14.40 GB usable of 16.00 GB of device memory",
    "world_size": 2,
    "backend": "gloo",
    "train_samples": 1437,
    "val_samples": 360,
    "model": "input layer, 3 residual MLP blocks, classifier",
    "params": 109_450,
    "blocks": "3 x ResidualBlock found automatically, each sharded with FSDP2 (90% of the parameters), then the"
    " rest as one group",
    "bucket_caps_mb": [0.125, 0.4],
    "bucket_reason": "first bucket small so that communication starts early; the rest measured on this machine",
    "find_unused": False,
    "samples_per_s": 5123.4,
    "steps": 69,
    "train_s": 1.92,
    "state_bytes": 656_700.0,
    "zero_bytes": 656_700.0,
    "val_acc": 0.9361,
    "pitfalls": ["SetEpochCheck (epoch 1): rank 0 read the same 719 samples as in epoch 0"],
}


def test_the_demo_result_here_has_the_keys_the_demo_reports():
    from lit_parallel.commands import demo

    tree = ast.parse(textwrap.dedent(inspect.getsource(demo._result)))
    returned = next(n.value for n in ast.walk(tree) if isinstance(n, ast.Return))
    assert {k.value for k in returned.keys} == set(DEMO_RESULT)


@pytest.mark.parametrize("width", WIDTHS)
def test_demo_summary_fits_the_terminal(width, capsys, monkeypatch):
    from lit_parallel.commands.demo import print_summary

    monkeypatch.setenv("COLUMNS", str(width))
    print_summary(DEMO_RESULT)
    out = capsys.readouterr().out
    r = DEMO_RESULT
    values = [
        f"{r['strategy']} on {r['world_size']} ranks ({r['backend']}); chosen by auto_parallel, {r['auto']}",
        f"{r['model']}, {r['params']:,} parameters",
        r["blocks"],
        f"{r['bucket_caps_mb']} MiB (first, rest): {r['bucket_reason']}",
        f"{r['samples_per_s']:.0f} samples/s over {r['steps']} steps ({r['train_s']:.1f} s)",
        format_bytes(r["state_bytes"]),
        f"{r['val_acc']:.4f}",
        *r["pitfalls"],
        "final validation accuracy",
        "find_unused_parameters",
    ]
    assert_fits_and_shows(out, width, values)
    assert "│ final validation accuracy │" in out  # a table of names and values at both widths
