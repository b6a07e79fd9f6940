"""The device check's dry run: every section runs on the CPU (gloo, tiny sizes), so a section that is
miswired fails in ``make test`` rather than during the few minutes a GPU is lent."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.gpu.device_check import REPO_ROOT
from tests.gpu.sections import SECTIONS


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_every_section_of_the_device_check_runs_on_the_cpu(tmp_path):
    out = tmp_path / "dry.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.gpu.device_check", "--dry-run", "--budget", "380", "--out", str(out)],
        cwd=REPO_ROOT,
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=400,
    )
    report = json.loads(out.read_text())
    failed = {n: s.get("traceback") or s.get("error") for n, s in report["sections"].items() if not s["ok"]}
    assert not failed, "\n\n".join(f"--- {n} ---\n{e}" for n, e in failed.items())
    assert list(report["sections"]) == list(SECTIONS)
    assert report["dry_run"] is True and proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the CPU shows host syncs too (aten._local_scalar_dense): every strategy keeps to one per step
    syncs = report["checks"]["host_syncs_per_step_at_most_1"]
    assert syncs["ok"], syncs
    assert set(syncs["per_strategy"]) == {
        n[len("strategy_") :] for n in SECTIONS if n.startswith("strategy_")
    }


def test_an_unknown_section_is_refused_with_the_list_of_sections():
    proc = subprocess.run(
        [sys.executable, "-m", "tests.gpu.device_check", "--dry-run", "--sections", "nope"],
        cwd=REPO_ROOT,
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "unknown ['nope']" in proc.stderr and "strategy_pp_dp" in proc.stderr
