"""The documentation: builds with `mkdocs build --strict`, has every page of its four parts in the navigation,
documents every argument of every strategy and callback, and holds the code's own tables as committed
Markdown (the advisor's rules, the API reference, the command synopses), so they read on GitHub too and
cannot drift from the code."""

from __future__ import annotations

import argparse
import html
import importlib.util
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
from lit_parallel.strategies import ALL_STRATEGIES
from tests.harness import REPO_ROOT

DOCS = REPO_ROOT / "docs"
PAGES = {
    lp.TunedDDPStrategy: "reference/strategies/ddp_tuned.md",
    lp.TransformerFSDPStrategy: "reference/strategies/fsdp_blocks.md",
    lp.HybridShardStrategy: "reference/strategies/hsdp.md",
    lp.TensorParallelStrategy: "reference/strategies/tp_dp.md",
    lp.PipelineParallelStrategy: "reference/strategies/pp_dp.md",
    lp.AutoStrategy: "reference/strategies/auto_parallel.md",
    lp.SetEpochCheck: "reference/callbacks/set_epoch_check.md",
    lp.CrossRankMetrics: "reference/callbacks/cross_rank_metrics.md",
    lp.SyncBatchNormConversion: "reference/callbacks/sync_batchnorm_conversion.md",
    lp.PitfallReport: "reference/callbacks/pitfall_report.md",
}
# the pages of the four parts: tutorials, how-to guides, reference, explanations
GUIDES = [
    "index.md",
    "tutorials/getting-started.md",
    "tutorials/first-multi-gpu-job.md",
    "lab/index.md",
    "lab/scaling.md",
    "lab/set-epoch.md",
    "lab/communication.md",
    "lab/memory.md",
    "lab/unused-parameters.md",
    "how-to/choosing-a-strategy.md",
    "how-to/migrate-from-lightning.md",
    "how-to/launching.md",
    "how-to/checkpoints.md",
    "how-to/troubleshooting.md",
    "how-to/recipes.md",
    "reference/strategies/expert_parallel.md",
    "reference/cli.md",
    "reference/api/strategies.md",
    "reference/api/callbacks.md",
    "reference/api/parallel.md",
    "reference/supported-models.md",
    "reference/reliability.md",
    "reference/limitations.md",
    "reference/versions.md",
    "explanations/how-advise-works.md",
    "explanations/advise-accuracy.md",
    "explanations/architecture.md",
    "explanations/compatibility.md",
    "explanations/validation.md",
]
STRATEGY_NAMES = [cls.strategy_name for cls in ALL_STRATEGIES]

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
    api = (site / "reference" / "api" / "strategies" / "index.html").read_text()
    for cls in (
        "TunedDDPStrategy",
        "TransformerFSDPStrategy",
        "HybridShardStrategy",
        "TensorParallelStrategy",
        "PipelineParallelStrategy",
        "AutoStrategy",
    ):
        assert f'id="{cls.lower()}"' in api, cls
    assert 'id="advise"' in (site / "reference" / "api" / "parallel" / "index.html").read_text()


def test_every_page_exists_and_is_in_the_navigation():
    nav = set(_nav_files(_mkdocs_config()["nav"]))
    for page in [*PAGES.values(), *GUIDES]:
        assert (DOCS / page).is_file(), page
        assert page in nav, f"{page} is not in mkdocs.yml's nav"
    on_disk = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md") if "hooks" not in p.parts}
    assert on_disk <= nav, (
        f"pages no reader can reach (add them to mkdocs.yml's nav): {sorted(on_disk - nav)}"
    )


def test_navigation_has_the_four_parts_in_order():
    sections = [next(iter(item)) for item in _mkdocs_config()["nav"] if isinstance(item, dict)]
    assert sections[1:] == ["Tutorials", "How-to guides", "Reference", "Explanations"], sections


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
    text = (DOCS / "how-to" / "troubleshooting.md").read_text()
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
    committed = (DOCS / "how-to" / "choosing-a-strategy.md").read_text()
    page = html.unescape((site / "how-to" / "choosing-a-strategy" / "index.html").read_text())
    for text in (committed, page):  # on GitHub (the Markdown) and on the site
        positions = [text.find(rule.when) for rule in RULES]
        assert all(p >= 0 for p in positions), [r.number for r, p in zip(RULES, positions) if p < 0]
        assert positions == sorted(positions)


def test_launching_page_covers_torchrun_slurm_and_network_variables():
    text = (DOCS / "how-to" / "launching.md").read_text()
    for needle in ("torchrun --nproc-per-node", "--nnodes=2", "srun", "MASTER_ADDR", "NCCL_SOCKET_IFNAME"):
        assert needle in text, needle


@pytest.mark.parametrize("page", ["how-to/launching.md", "tutorials/first-multi-gpu-job.md"])
def test_slurm_scripts_ask_for_the_preemption_signal_and_torchrun_restarts_resume(page):
    text = (DOCS / page).read_text()
    scripts = [b for b in re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL) if "#SBATCH" in b]
    assert scripts, f"{page} has no SLURM script"
    for script in scripts:  # without it SLURM sends no warning before it stops the job
        assert "#SBATCH --signal=USR1@90" in script, script
    assert "--max-restarts" in text and "auto_resume" in text


# --- generated sections: the committed Markdown is what the code gives ------------------------------------


def _generator():
    path = DOCS / "hooks" / "generated_sections.py"
    spec = importlib.util.spec_from_file_location("generated_sections", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_sections_are_what_the_code_gives():
    gen = _generator()
    stale = [str(path.relative_to(REPO_ROOT)) for path in gen.stale()]
    assert not stale, f"{stale} differ from the code: run {gen.COMMAND} to refresh"


def test_api_reference_has_an_entry_for_every_public_name():
    from lit_parallel import parallel

    text = "\n".join(
        (DOCS / "reference" / "api" / p).read_text() for p in ("strategies.md", "callbacks.md", "parallel.md")
    )
    headings = set(re.findall(r"^#+ `([\w.]+)`", text, flags=re.MULTILINE))
    public = [n for n in lp.__all__ if callable(getattr(lp, n))] + list(parallel.__all__)
    missing = [n for n in public if n not in headings]
    assert not missing, f"the API reference has no entry for {missing}"


def test_generated_section_markers_are_refused_when_missing():
    gen = _generator()
    with pytest.raises(ValueError, match="must hold the markers"):
        gen.refresh("# a page without markers\n", "api-strategies", "body")
    begin, end = gen._markers("x")
    assert (
        gen.refresh(f"head\n{begin}\nold\n{end}\ntail\n", "x", "new\n")
        == f"head\n{begin}\n\nnew\n\n{end}\ntail\n"
    )


# --- strategy pages: when to use it, a complete example, arguments, limitations ---------------------------

STRATEGY_PAGES = {cls.strategy_name: PAGES[cls] for cls in ALL_STRATEGIES}


@pytest.mark.parametrize("name", STRATEGY_NAMES)
def test_strategy_page_has_when_example_arguments_limitations_in_order(name):
    text = (DOCS / STRATEGY_PAGES[name]).read_text()
    headings = re.findall(r"^## (.+)$", text, flags=re.MULTILINE)
    wanted = ["When to use it", "Example", "Arguments", "Limitations"]
    assert all(h in headings for h in wanted), (name, headings)
    assert [headings.index(h) for h in wanted] == sorted(headings.index(h) for h in wanted), headings
    limitations = text.split("## Limitations", 1)[1].split("\n## ", 1)[0]
    assert f"../limitations.md#{name}" in limitations, (
        f"{name}'s Limitations section does not link its section"
    )


def test_limitations_page_has_a_section_per_strategy_and_general_ones():
    headings = re.findall(
        r"^## (.+)$", (DOCS / "reference" / "limitations.md").read_text(), flags=re.MULTILINE
    )
    assert headings == ["General", *(f"`{name}`" for name in STRATEGY_NAMES)], headings


# --- every page that lists the strategies lists all of them -----------------------------------------------


@pytest.mark.parametrize(
    "page",
    [
        "tutorials/getting-started.md",
        "how-to/choosing-a-strategy.md",
        "how-to/checkpoints.md",
        "reference/reliability.md",
        "reference/supported-models.md",
        "explanations/compatibility.md",
    ],
)
def test_pages_that_list_the_strategies_name_every_registered_one(page):
    text = (DOCS / page).read_text()
    missing = [name for name in STRATEGY_NAMES if f"`{name}`" not in text and f'"{name}"' not in text]
    assert not missing, f"{page} does not name {missing}"


def test_supported_models_table_has_a_column_per_registered_strategy():
    text = (DOCS / "reference" / "supported-models.md").read_text()
    header = next(line for line in text.splitlines() if line.startswith("| model |"))
    assert all(f"`{name}`" in header for name in STRATEGY_NAMES), header


def test_supported_models_moe_table_has_a_row_per_model_the_expert_parallel_tests_train():
    from tests.moe_models import MODELS as MOE_MODELS
    from tests.scenarios.expert_parallel import MODEL_NAMES

    spec = importlib.util.spec_from_file_location("supported_models", DOCS / "hooks" / "supported_models.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert list(gen.EXPERT_PARALLEL_MODELS) == list(MOE_MODELS) and set(MODEL_NAMES) <= set(MOE_MODELS)
    text = (DOCS / "reference" / "supported-models.md").read_text()
    header = next(line for line in text.splitlines() if line.startswith("| MoE model |"))
    assert all(f"`{name}`" in header for name in ("fsdp_blocks", "tp_dp", "pp_dp")), header
    for label, cells in gen.EXPERT_PARALLEL_MODELS.values():
        assert len(cells) == len(gen.EXPERT_PARALLEL_COLUMNS) and f"| {label} | {' | '.join(cells)} |" in text


def test_every_recipe_config_is_listed_in_both_recipe_guides():
    configs = sorted(p.name for p in (REPO_ROOT / "recipes" / "configs").glob("*.yaml"))
    for guide in (DOCS / "how-to" / "recipes.md", REPO_ROOT / "recipes" / "README.md"):
        text = guide.read_text()
        assert all(f"configs/{c}" in text for c in configs), (guide, configs)


# --- the version matrix states pyproject.toml's requirements ----------------------------------------------


def test_versions_page_states_the_requirements_of_pyproject():
    # pyproject.toml read as text: tomllib is Python 3.11+, the package supports 3.10
    pyproject = (REPO_ROOT / "pyproject.toml").read_text()
    text = (DOCS / "reference" / "versions.md").read_text()
    python = re.search(r'^requires-python = "([^"]+)"', pyproject, flags=re.MULTILINE).group(1)
    assert f"`{python}`" in text
    dependencies = re.search(r"^dependencies = \[(.*?)^\]", pyproject, flags=re.MULTILINE | re.DOTALL).group(
        1
    )
    for name in ("torch", "lightning", "torchmetrics"):
        spec = re.search(rf'"({name}[<>=!~][^"]*)"', dependencies).group(1)
        assert f"`{spec}`" in text, f"versions.md does not state {spec} (pyproject.toml)"


# --- cli.md: the synopses list every option of every command ----------------------------------------------


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def _parser_options(words: list[str]) -> dict[str, tuple[str, ...] | None]:
    """``--option -> choices`` of the command ``words`` (``["advise"]``, ``["bench", "pp"]``), as the
    command line builds it; hidden options (the ranks' ``--worker``) and ``--help`` left out."""
    from lit_parallel.commands.cli import build_parser

    parser = build_parser(words)
    for word in words:
        parser = _subparser(parser, word)
    return {
        option: tuple(a.choices) if a.choices else None
        for a in parser._actions
        if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)
        for option in a.option_strings
        if option.startswith("--")
    }


def _documented_synopses() -> dict[tuple[str, ...], str]:
    """cli.md's synopses (the ``text`` blocks' lines that start with ``lit-parallel``, with their indented
    continuations), joined per command."""
    text = (DOCS / "reference" / "cli.md").read_text()
    synopses: dict[tuple[str, ...], str] = {}
    for block in re.findall(r"```text\n(.*?)```", text, flags=re.DOTALL):
        current = None
        for line in block.splitlines():
            if line.startswith("lit-parallel "):
                words = [w for w in line.split()[1:] if not w.startswith(("[", "-"))]
                current = (words[0], words[1]) if words[0] == "bench" else (words[0],)
                current = () if words[0] == "COMMAND" else current
                synopses[current] = synopses.get(current, "") + " " + line
            elif current and line.startswith(" "):
                synopses[current] += " " + line
            else:
                current = None
    return synopses


def _commands() -> list[tuple[str, ...]]:
    from lit_parallel.commands.cli import BENCHMARKS, COMMANDS

    return [(), *((name,) for name in COMMANDS), *(("bench", name) for name in BENCHMARKS)]


@pytest.mark.parametrize("command", _commands(), ids=lambda c: " ".join(c) or "lit-parallel")
def test_cli_synopsis_lists_exactly_the_options_of_the_parser(command):
    synopsis = _documented_synopses().get(command)
    assert synopsis, f"docs/reference/cli.md has no synopsis for lit-parallel {' '.join(command)}"
    options = _parser_options(list(command))
    documented = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", synopsis))
    assert documented == set(options), (
        f"lit-parallel {' '.join(command)}: missing in cli.md {sorted(set(options) - documented)}, not in the"
        f" parser {sorted(documented - set(options))}"
    )
    for option, choices in options.items():
        if choices:
            assert f"{option} {'|'.join(choices)}" in synopsis, f"{option}: choices {choices} not shown"
