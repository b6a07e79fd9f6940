"""The documentation site: builds with `mkdocs build --strict`, has every page the user guide needs,
documents every argument of every strategy and callback, and shows the advisor's own rule table."""

from __future__ import annotations

import html
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import lit_parallel as lp
from lit_parallel.planner.rules import RULES
from tests.harness import REPO_ROOT

DOCS = REPO_ROOT / "docs"
PAGES = {
    lp.TunedDDPStrategy: "strategies/ddp_tuned.md",
    lp.TransformerFSDPStrategy: "strategies/fsdp_blocks.md",
    lp.HybridShardStrategy: "strategies/hsdp.md",
    lp.TensorParallelStrategy: "strategies/tp_dp.md",
    lp.PipelineParallelStrategy: "strategies/pp_dp.md",
    lp.AutoStrategy: "strategies/auto_parallel.md",
    lp.SetEpochCheck: "callbacks/set_epoch_check.md",
    lp.CrossRankMetrics: "callbacks/cross_rank_metrics.md",
    lp.SyncBatchNormConversion: "callbacks/sync_batchnorm_conversion.md",
    lp.PitfallReport: "callbacks/pitfall_report.md",
}
GUIDES = [
    "index.md",
    "getting-started.md",
    "choosing-a-strategy.md",
    "supported-models.md",
    "launching.md",
    "checkpoints.md",
    "troubleshooting.md",
    "compatibility.md",
    "validation.md",
    "recipes.md",
    "cli.md",
    "advise-accuracy.md",
    "lab/index.md",
    "lab/scaling.md",
    "lab/set-epoch.md",
    "lab/communication.md",
    "lab/memory.md",
    "lab/unused-parameters.md",
    "architecture.md",
    "api/strategies.md",
    "api/callbacks.md",
    "api/parallel.md",
]
# Lightning's own plumbing, set by the Trainer rather than by users
LIGHTNING_ARGS = {
    "accelerator",
    "parallel_devices",
    "cluster_environment",
    "checkpoint_io",
    "precision_plugin",
}


def _nav_files(nav) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [f for item in nav for f in _nav_files(item)]
    if isinstance(nav, dict):
        return [f for value in nav.values() for f in _nav_files(value)]
    return []


def _mkdocs_config() -> dict:
    # mkdocs.yml has no custom tags; plain YAML reads it
    return yaml.safe_load((REPO_ROOT / "mkdocs.yml").read_text())


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    res = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env=dict(os.environ, OMP_NUM_THREADS="1", NO_MKDOCS_2_WARNING="1"),
        check=False,
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    return out


@pytest.mark.timeout(300)
def test_site_builds_strictly_with_the_api_reference(site):
    api = (site / "api" / "strategies" / "index.html").read_text()
    for cls in (
        "TunedDDPStrategy",
        "TransformerFSDPStrategy",
        "HybridShardStrategy",
        "TensorParallelStrategy",
    ):
        assert f'id="lit_parallel.{cls}"' in api, cls
    assert 'id="lit_parallel.planner.rules.advise"' in (site / "api" / "parallel" / "index.html").read_text()


def test_every_page_exists_and_is_in_the_navigation():
    nav = set(_nav_files(_mkdocs_config()["nav"]))
    for page in [*PAGES.values(), *GUIDES]:
        assert (DOCS / page).is_file(), page
        assert page in nav, f"{page} is not in mkdocs.yml's nav"


@pytest.mark.parametrize("cls", list(PAGES), ids=lambda c: c.__name__)
def test_each_strategy_and_callback_page_documents_every_argument_and_an_example(cls):
    text = (DOCS / PAGES[cls]).read_text()
    params = [
        p.name
        for p in inspect.signature(cls.__init__).parameters.values()
        if p.name != "self" and p.kind is not p.VAR_KEYWORD and p.name not in LIGHTNING_ARGS
    ]
    missing = [name for name in params if f"`{name}`" not in text]
    assert not missing, f"{PAGES[cls]} does not document {missing}"
    assert "## Example" in text and "```python" in text.split("## Example", 1)[1]
    assert "Use it" in text or "use it" in text.lower()


def _table_rows(text: str) -> list[list[str]]:
    rows = [line for line in text.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]


@pytest.mark.parametrize(
    "symptom",
    [
        r"hangs at `init_process_group`",
        r"worse than on one device",
        r"Ranks diverge",
        r"learning rate not scaled",
        r"Poor scaling",
        r"out of memory",
        r"FSDP is slower than DDP for a model that fits",
        r"metrics change with the number of ranks, or jump between runs",
        r"BatchNorm .* small per-rank batches",
        r"find_unused_parameters",
        r"torch.compile",
    ],
)
def test_troubleshooting_table_has_symptom_cause_detection_and_fix(symptom):
    text = (DOCS / "troubleshooting.md").read_text()
    header = next(line for line in text.splitlines() if line.startswith("|"))
    assert [c.strip() for c in header.strip("|").split("|")] == [
        "symptom",
        "cause",
        "how lit_parallel detects it",
        "fix",
    ]
    rows = [r for r in _table_rows(text) if re.search(symptom, " ".join(r[:2]))]
    assert rows, f"no troubleshooting row for {symptom!r}"
    assert all(len(r) == 4 and all(r) for r in rows)


def test_decision_guide_shows_the_advisors_rules_in_order(site):
    page = html.unescape((site / "choosing-a-strategy" / "index.html").read_text())
    positions = [page.find(rule.when) for rule in RULES]
    assert all(p >= 0 for p in positions), [r.number for r, p in zip(RULES, positions) if p < 0]
    assert positions == sorted(positions)
    assert "<!-- advisor-rules -->" not in page


def test_launching_page_covers_torchrun_slurm_and_network_variables():
    text = (DOCS / "launching.md").read_text()
    for needle in ("torchrun --nproc-per-node", "--nnodes=2", "srun", "MASTER_ADDR", "NCCL_SOCKET_IFNAME"):
        assert needle in text, needle
