"""The conformance suite: every model of tests/conformance_models.py under every strategy, on 2 gloo ranks.

Each cell (model x strategy) must (1) reproduce, micro-batch by micro-batch, the losses of one plain
PyTorch process trained on the same global batches (relative error < 1e-5, fp32, 3 optimizer steps of 2
accumulated micro-batches), and (2) really parallelise: under fsdp_blocks / hsdp every rank holds at most
1/N of each block's parameters (rows split unevenly round up); under tp_dp every attention and MLP
projection is split 1/tp; auto_parallel is checked as the strategy it chose, whose name and rule are
recorded. The expected values come from the reference loop and the table's own names, never from the
library.

Launches (3, each with a timeout): ddp_tuned + auto_parallel, fsdp_blocks + hsdp, tp_dp. A failing cell is
reported with its error and the others still run. The cells' summary is compared with the committed
tests/conformance_results.json, from which docs/hooks/supported_models.py generates
docs/reference/supported-models.md: after a change of behaviour, rerun with ``LP_UPDATE_CONFORMANCE=1`` and then
``python docs/hooks/supported_models.py``. That mode still checks every cell against the reference loop
and rewrites the snapshot only when all pass; it skips only the comparison with the committed snapshot,
and says so.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from tests.conformance_models import MODELS, build, dataset, loss_fn
from tests.harness import launch
from tests.reference import assert_rel_close, global_micro_batches, reference_training
from tests.scenarios import conformance as sc

WORLD = 2
RESULTS_JSON = Path(__file__).resolve().parent / "conformance_results.json"
REPO = RESULTS_JSON.parent.parent
LAUNCHES = {
    "ddp_auto": ("ddp_tuned", "auto_parallel"),
    "fsdp_hsdp": ("fsdp_blocks", "hsdp"),
    "tp": ("tp_dp",),
}
TIMEOUT_S = {"ddp_auto": 300, "fsdp_hsdp": 360, "tp": 360}
CELLS = [(m, s) for s in sc.STRATEGIES for m in MODELS]


def _run_launch(name: str, tmp: Path) -> dict:
    cells = [[m, s] for s in LAUNCHES[name] for m in MODELS]
    start = time.monotonic()
    result = launch(
        ["tests.scenarios.conformance:cells"],
        WORLD,
        tmp,
        args={"cells": cells},
        timeout=TIMEOUT_S[name],
        env={"LP_PG_TIMEOUT": "60"},
        expect_failure=True,
    )
    per_cell: dict[tuple[str, str], list[dict]] = {}
    for model, strategy in cells:
        files = [tmp.glob(f"launch-*/cell-{model}-{strategy}-rank{r}.pt") for r in range(WORLD)]
        found = [next(iter(f), None) for f in files]
        if all(found):
            per_cell[(model, strategy)] = [torch.load(f, weights_only=True) for f in found]
        else:
            error = f"launch {name!r} ended (failed or timed out) before this cell finished"
            lost = {"ok": False, "error": error, "traceback": result.describe_failure(), "wall_s": 0.0}
            per_cell[(model, strategy)] = [lost] * WORLD
    return {"cells": per_cell, "wall_s": time.monotonic() - start, "failed": result.failed}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = {name: _run_launch(name, tmp_path_factory.mktemp(f"conformance-{name}")) for name in LAUNCHES}
    for name, run in out.items():
        print(f"conformance launch {name}: {run['wall_s']:.1f}s wall, failed={run['failed']}")
    return out


def _cell(runs: dict, model: str, strategy: str) -> list[dict]:
    return next(run["cells"][(model, strategy)] for run in runs.values() if (model, strategy) in run["cells"])


# --- the checks: each returns (what it found, problems) ------------------------------------------------------

_REFERENCES: dict = {}


def _reference(model: str, dp: int) -> list[float]:
    if (model, dp) not in _REFERENCES:
        ref = reference_training(
            build(model),
            dataset(model),
            loss_fn(model),
            world_size=dp,
            per_rank_batch=sc.PER_RANK_BATCH,
            max_steps=sc.STEPS,
            lr=sc.LR,
            accumulate_grad_batches=sc.ACCUMULATE,
        )
        _REFERENCES[(model, dp)] = ref["losses"]
    return _REFERENCES[(model, dp)]


def check_losses(model: str, ranks: list[dict]) -> list[str]:
    dp = ranks[0]["dp_size"]
    by_dp: dict[int, dict] = {}
    problems = []
    for r in ranks:
        first = by_dp.setdefault(r["dp_rank"], r)
        if not torch.allclose(r["losses"], first["losses"], rtol=1e-6, atol=0):
            problems.append(f"ranks of data-parallel rank {r['dp_rank']} disagree on the losses")
    if sorted(by_dp) != list(range(dp)):
        return [*problems, f"data-parallel ranks {sorted(by_dp)} do not cover 0..{dp - 1}"]
    expected_order = global_micro_batches(len(dataset(model)), dp, sc.PER_RANK_BATCH, 1)[0]
    seen = [
        [i for k in sorted(by_dp) for i in by_dp[k]["indices"][step]]
        for step in range(len(ranks[0]["indices"]))
    ]
    if seen != expected_order[: len(seen)]:
        problems.append(
            f"global micro-batches {seen[:2]}... differ from DistributedSampler's {expected_order[:2]}..."
        )
    losses = torch.stack([by_dp[k]["losses"] for k in sorted(by_dp)]).mean(0)
    if len(losses) != sc.STEPS * sc.ACCUMULATE:
        return [*problems, f"{len(losses)} micro-batch losses, expected {sc.STEPS * sc.ACCUMULATE}"]
    try:
        assert_rel_close(losses, torch.tensor(_reference(model, dp)), rel=1e-5, what="losses")
    except AssertionError as err:
        problems.append(str(err))
    return problems


def _is_shard(placement: str) -> bool:
    """``Shard(d)`` prints as ``S(d)``; FSDP over a tensor-parallel shard as ``_S(d, n)`` (strided)."""
    return re.match(r"_?S\(", placement) is not None


def _share(params: dict, names) -> float:
    names = list(names)
    full = sum(params[n][1] for n in names)
    return sum(params[n][0] for n in names) / full if full else 1.0


def check_sharded(model: str, ranks: list[dict]) -> tuple[dict, list[str]]:
    """FSDP: every block parameter is a Shard DTensor holding at most ceil(rows / N) of its rows."""
    spec, problems, blocks = MODELS[model], [], {}
    for r in ranks:
        for name, (local, full, shape, placements) in r["params"].items():
            match = re.match(spec.block, name)
            if not match:
                continue
            blocks.setdefault(match.group(0), []).append(name)
            bound = math.ceil(shape[0] / WORLD) * (full // shape[0]) if shape else full
            if not any(_is_shard(p) for p in placements) or local > bound:
                problems.append(f"rank holds {local}/{full} of block parameter {name} ({placements})")
    if not blocks:
        problems.append(f"no parameter matches the table's block pattern {spec.block!r}")
    params = ranks[0]["params"]
    block_share = max((_share(params, names) for names in blocks.values()), default=1.0)
    replicated = sorted(n for n, v in params.items() if not any(_is_shard(p) for p in v[3]))
    found = {"blocks": len(blocks), "block_share": block_share, "replicated": replicated}
    return found, problems[:5]


def check_split(model: str, ranks: list[dict]) -> tuple[dict, list[str]]:
    """TP: every attention and MLP projection matrix is split 1/tp (a Shard placement, exact size)."""
    spec, problems, unsplit = MODELS[model], [], set()
    names = [n for n, v in ranks[0]["params"].items() if spec.tp and re.search(spec.tp, n) and len(v[2]) == 2]
    for r in ranks:
        for name in names:
            local, full, _, placements = r["params"][name]
            if local * sc.TP != full or not any(_is_shard(p) for p in placements):
                unsplit.add(name)
                problems.append(f"projection {name} not split: rank holds {local}/{full} ({placements})")
    if spec.tp and not names:
        problems.append(f"no parameter matches the table's projection pattern {spec.tp!r}")
    return {"projections": len(names), "unsplit": len(unsplit)}, problems[:5]


def _collapse(path: str) -> str:
    """``a.3.b`` -> ``a.*.b``: one line for a layer repeated in every block."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", path)


def _tp_summary(found: dict, params: dict, plan: dict) -> dict:
    """What tp_dp split, and what every rank holds whole (with the plan's reason where it gives one)."""
    split = sum(1 for v in params.values() if v[0] * sc.TP == v[1])
    if found["projections"]:
        done = found["projections"] - found["unsplit"]
        what = f"split: {done}/{found['projections']} attention/MLP projections 1/{sc.TP}"
    else:
        what = f"not split: no attention or MLP projection; {split} parameters split 1/{sc.TP}"
    # one line for a parameter repeated in every block, unless some of its copies are split
    patterns: dict[str, list[bool]] = {}
    for n, v in params.items():
        patterns.setdefault(_collapse(n), []).append(v[0] == v[1])
    whole = {p for p, flags in patterns.items() if all(flags)}
    whole |= {n for n, v in params.items() if v[0] == v[1] and not all(patterns[_collapse(n)])}
    reasons = {_collapse(p): why for p, style, why in plan.get("tp_layers", []) if style == "replicated"}
    modules = {n.rpartition(".")[0] for n in whole}
    replicated = [
        f"{n}: {reasons[n.rpartition('.')[0]]}" if n.rpartition(".")[0] in reasons else n for n in whole
    ]
    replicated += [f"{m}: {why}" for m, why in reasons.items() if m not in modules]
    return {"what": what, "replicated": sorted(replicated), "notes": plan.get("tp_notes", [])}


def evaluate(model: str, strategy: str, ranks: list[dict]) -> dict:
    """The cell's summary: status, per-rank parameter share, what is split or sharded, what is not and why."""
    if not all(r["ok"] for r in ranks):
        error = next(r["error"] for r in ranks if not r["ok"])
        return {"status": "fails", "problems": [error.splitlines()[0][:400]], "share": None}
    plan = ranks[0]["plan"]
    problems = check_losses(model, ranks)
    chosen = plan["strategy"]
    share = max(_share(r["params"], r["params"]) for r in ranks)
    out: dict = {"share": round(share, 3)}
    if strategy == "auto_parallel":
        out["chosen"] = f"{chosen} ({plan.get('advice_rule')})"
    if chosen in ("fsdp_blocks", "hsdp"):
        found, more = check_sharded(model, ranks)
        # the plan is described after fully_shard, which renames each block class to FSDP<Class>
        groups = re.sub(r"\bFSDP(?=[A-Z])", "", plan.get("groups", "").split(";")[0])
        out["what"] = f"sharded: {groups}; largest block share {found['block_share']:.2f}"
        out["replicated"] = found["replicated"]
    elif chosen == "tp_dp":
        found, more = check_split(model, ranks)
        out.update(_tp_summary(found, ranks[0]["params"], plan))
    else:
        more = [] if share == 1.0 else [f"DDP rank holds {share:.3f} of the parameters, expected all"]
        out["what"] = "replicated: every rank holds the whole model (data parallel)"
    out["problems"] = problems + more
    out["status"] = "fails" if out["problems"] else "exact"
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("model,strategy", CELLS, ids=[f"{m}-{s}" for m, s in CELLS])
def test_cell_matches_single_process_and_really_parallelises(runs, model, strategy):
    ranks = _cell(runs, model, strategy)
    summary = evaluate(model, strategy, ranks)
    detail = next((r["traceback"][-4000:] for r in ranks if not r["ok"]), "")
    assert summary["status"] == "exact", (
        f"{model} x {strategy}: " + "\n".join(summary["problems"]) + "\n" + detail
    )


def results_table(runs: dict) -> dict:
    models = []
    for name, spec in MODELS.items():
        cells = {s: evaluate(name, s, _cell(runs, name, s)) for s in sc.STRATEGIES}
        models.append({"name": name, "family": spec.family, "cells": cells})
    return {
        "world_size": WORLD,
        "tensor_parallel_size": sc.TP,
        "strategies": list(sc.STRATEGIES),
        "models": models,
    }


def check_results(fresh: dict, snapshot: Path, *, update: bool, fresh_file: Path | None = None) -> str:
    """``fresh`` (:func:`results_table`) against the independent reference, then against ``snapshot``.

    In both modes every cell must be exact: its losses those of the single-process reference loop, its
    parameters sharded or split as the strategy promises (:func:`evaluate`). Then the snapshot: compared
    with ``fresh``; with ``update``, rewritten from ``fresh`` instead (and only then: a table that fails the
    reference is never written). Returns what was done, to print."""
    failing = [
        f"{m['name']} x {s}: " + "; ".join(c["problems"])
        for m in fresh["models"]
        for s, c in m["cells"].items()
        if c["status"] != "exact"
    ]
    assert not failing, (
        "cells that do not match the single-process reference"
        + (f" ({snapshot.name} was not rewritten)" if update else "")
        + ":\n"
        + "\n".join(failing)
    )
    text = json.dumps(fresh, indent=1, sort_keys=True) + "\n"
    if update:
        snapshot.write_text(text)
        return (
            f"LP_UPDATE_CONFORMANCE=1: every cell matches the single-process reference; {snapshot.name}"
            " rewritten from them, the comparison with the committed snapshot skipped"
        )
    committed = json.loads(snapshot.read_text()) if snapshot.exists() else None
    assert committed == json.loads(text), (
        f"the conformance results changed (fresh table: {fresh_file}); run"
        " LP_UPDATE_CONFORMANCE=1 pytest tests/test_conformance.py, then python docs/hooks/supported_models.py"
    )
    return f"every cell matches the single-process reference and the committed {snapshot.name}"


@pytest.mark.multiprocess
@pytest.mark.timeout(1200)
def test_results_equal_the_committed_table_the_docs_page_is_made_from(runs, tmp_path):
    fresh = results_table(runs)
    fresh_file = tmp_path / "conformance_results.json"
    fresh_file.write_text(json.dumps(fresh, indent=1, sort_keys=True) + "\n")
    for name, run in runs.items():
        cell_times = {
            f"{m}/{s}": round(max(r["wall_s"] for r in rs), 1) for (m, s), rs in run["cells"].items()
        }
        print(f"launch {name}: {run['wall_s']:.1f}s; cells {cell_times}")
    update = os.environ.get("LP_UPDATE_CONFORMANCE") == "1"
    done = check_results(fresh, RESULTS_JSON, update=update, fresh_file=fresh_file)
    print(done)
    if update:  # shown in pytest's summary even when output is captured
        warnings.warn(done, stacklevel=1)


def test_update_mode_still_checks_the_reference_and_skips_only_the_snapshot_comparison(tmp_path):
    """check_results on stand-in tables (no launch): what LP_UPDATE_CONFORMANCE=1 does and does not do."""

    def table(status: str) -> dict:
        problems = [] if status == "exact" else ["losses: rel. error 3e-2 > 1e-05"]
        cells = {"ddp_tuned": {"status": "exact", "problems": [], "share": 1.0},
                 "fsdp_blocks": {"status": status, "problems": problems, "share": 0.5}}  # fmt: skip
        return {"world_size": 2, "models": [{"name": "mlp", "family": "MLP", "cells": cells}]}

    snapshot = tmp_path / "conformance_results.json"
    snapshot.write_text("committed\n")
    # update mode: a cell off the reference fails, naming it, and the snapshot is left as it was
    with pytest.raises(AssertionError, match="mlp x fsdp_blocks: losses: rel. error 3e-2") as err:
        check_results(table("fails"), snapshot, update=True)
    assert "was not rewritten" in str(err.value) and snapshot.read_text() == "committed\n"
    # update mode, every cell exact: rewritten, and the output says the comparison was skipped
    said = check_results(table("exact"), snapshot, update=True)
    assert (
        json.loads(snapshot.read_text()) == table("exact")
        and "comparison with the committed snapshot skipped" in said
    )
    # compare mode: the reference first, then the snapshot
    with pytest.raises(AssertionError, match="do not match the single-process reference"):
        check_results(table("fails"), snapshot, update=False)
    assert "committed" in check_results(table("exact"), snapshot, update=False)
    changed = table("exact")
    changed["models"][0]["cells"]["fsdp_blocks"]["share"] = 0.6
    with pytest.raises(AssertionError, match="the conformance results changed"):
        check_results(changed, snapshot, update=False)


def _generator():
    path = REPO / "docs" / "hooks" / "supported_models.py"
    spec = importlib.util.spec_from_file_location("supported_models", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("supported_models", module)
    spec.loader.exec_module(module)
    return module


def test_supported_models_page_is_generated_from_the_committed_results():
    gen = _generator()
    expected = gen.render(json.loads(RESULTS_JSON.read_text()))
    page = (REPO / "docs" / "reference" / "supported-models.md").read_text()
    assert page == expected, (
        "docs/reference/supported-models.md is stale: run python docs/hooks/supported_models.py"
    )


def test_committed_results_cover_every_model_and_strategy_of_the_table():
    committed = json.loads(RESULTS_JSON.read_text())
    assert [m["name"] for m in committed["models"]] == list(MODELS)
    for m in committed["models"]:
        assert sorted(m["cells"]) == sorted(sc.STRATEGIES), m["name"]
