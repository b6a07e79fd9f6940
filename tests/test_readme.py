"""README.md, the front door, against the code, so its tables cannot drift from what the package has.

- Strategies: the strategy classes and names that importing lit_parallel registers in Lightning's
  `StrategyRegistry`. The first name in a row is the class's `strategy_name`.
- Callbacks and helpers: every public name in `lit_parallel.__all__` except the strategies, which have their
  own table, and `__version__`. That covers callbacks, functions, and the warning and error the callbacks
  use. Each row's kind is checked against the object.
- Commands: every command and sub-command of the real `lit-parallel` parser. The walk goes through its
  sub-parsers, and `lab`'s experiments count too (`lab NAME` runs one). Any option a row shows must
  belong to that command.
- Every link in the README points to a file of the repository.
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import sys

import pytest
from lightning.pytorch import Callback
from lightning.pytorch.strategies import Strategy, StrategyRegistry

import lit_parallel as lp
from lit_parallel.commands.cli import build_parser
from lit_parallel.commands.lab import EXPERIMENTS
from tests.doc_blocks import PYTHON, blocks_of, shell_commands
from tests.harness import PORT_CLASH, REPO_ROOT

README = (REPO_ROOT / "README.md").read_text()

# kind column of the callbacks-and-helpers table -> what the named object must be
KINDS = {
    "callback": lambda obj: inspect.isclass(obj) and issubclass(obj, Callback),
    "function": inspect.isfunction,
    "warning": lambda obj: inspect.isclass(obj) and issubclass(obj, Warning),
    "error": lambda obj: inspect.isclass(obj) and issubclass(obj, Exception) and not issubclass(obj, Warning),
    # a plain class (a result type): not a callback, warning or error
    "class": lambda obj: inspect.isclass(obj) and not issubclass(obj, (Callback, BaseException)),
}


def _table(heading: str) -> list[dict[str, str]]:
    """The rows of the first table under the README's `## heading`, keyed by the header's cells."""
    lines = README.splitlines()
    assert f"## {heading}" in lines, f"README.md has no '## {heading}' section"
    start = lines.index(f"## {heading}")
    rows: list[list[str]] = []
    for line in lines[start + 1 :]:
        if line.startswith("## "):
            break
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows:
            break
    assert len(rows) > 2, f"no table under '## {heading}'"
    header, rule, *body = rows
    assert set("".join(rule)) <= set("-:"), f"'## {heading}': the second table line is not a header rule"
    for row in body:  # a '|' inside a cell would shift the columns
        assert len(row) == len(header), (
            f"'## {heading}': {row} has {len(row)} cells, the header {len(header)}"
        )
    return [dict(zip(header, row)) for row in body]


def _linked_code(cell: str) -> tuple[str, str]:
    """`name` and target of a cell that is exactly one link around a code span: [`name`](target)."""
    match = re.fullmatch(r"\[`([^`]+)`\]\(([^)\s]+)\)", cell)
    assert match, f"{cell!r} is not a link around a code span, [`name`](docs/...)"
    return match.group(1), match.group(2)


def _registered_by_lit_parallel() -> dict[str, type]:
    return {
        name: entry["strategy"]
        for name, entry in StrategyRegistry.items()
        if entry["strategy"].__module__.split(".")[0] == "lit_parallel"
    }


def test_strategy_table_is_every_strategy_lit_parallel_registers_with_lightning():
    registered = _registered_by_lit_parallel()
    rows = _table("Strategies")
    assert rows[0].keys() == {"class", "registry name", "what it splits", "when to use it"}
    names_in_table: set[str] = set()
    for row in rows:
        class_name, page = _linked_code(row["class"])
        cls = getattr(lp, class_name, None)
        assert inspect.isclass(cls) and issubclass(cls, Strategy), (
            f"lit_parallel.{class_name} is not a strategy"
        )
        names = re.findall(r"`([^`]+)`", row["registry name"])
        assert names and names[0] == cls.strategy_name, (
            f"{class_name}: first name {names[:1]}, not {cls.strategy_name!r}"
        )
        for name in names:
            assert registered.get(name) is cls, f"{name!r} is not registered as {class_name}"
        names_in_table |= set(names)
        assert page == f"docs/reference/strategies/{cls.strategy_name}.md"
        assert row["what it splits"] and row["when to use it"], class_name
    assert names_in_table == set(registered)
    assert {_linked_code(row["class"])[0] for row in rows} == {cls.__name__ for cls in registered.values()}


def test_callbacks_and_helpers_table_lists_every_other_public_name_with_its_kind():
    strategies = {
        n for n in lp.__all__ if inspect.isclass(getattr(lp, n)) and issubclass(getattr(lp, n), Strategy)
    }
    expected = set(lp.__all__) - strategies - {"__version__"}
    rows = _table("Callbacks and helpers")
    assert rows[0].keys() == {"name", "kind", "what it does"}
    listed = []
    for row in rows:
        name, page = _linked_code(row["name"])
        assert name in expected, (
            f"{name} is not a public name of lit_parallel (or belongs in the strategy table)"
        )
        assert row["kind"] in KINDS, f"{name}: kind {row['kind']!r}; choose one of {', '.join(KINDS)}"
        assert KINDS[row["kind"]](getattr(lp, name)), f"lit_parallel.{name} is not a {row['kind']}"
        assert page.startswith("docs/reference/"), f"{name} links {page}, not a reference page"
        assert row["what it does"], name
        listed.append(name)
    assert sorted(listed) == sorted(expected), "every name once: " + ", ".join(sorted(expected))
    # each callback class has its own page
    pages = {
        name: _linked_code(row["name"])[1] for name, row in zip(listed, rows) if row["kind"] == "callback"
    }
    assert len(set(pages.values())) == len(pages)


def _sub_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    # argparse has no public way to list a parser's sub-commands
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _parser_of(path: tuple[str, ...]) -> argparse.ArgumentParser:
    """The parser of command `path`, with its own arguments (the CLI adds them only for the command named)."""
    parser = build_parser(list(path))
    for word in path:
        parser = _sub_parsers(parser)[word]
    return parser


def _commands(path: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    """Every command the parser runs: the paths to parsers without sub-commands."""
    subs = _sub_parsers(_parser_of(path))
    if not subs:
        return {path}
    return set().union(*(_commands((*path, name)) for name in subs))


def test_command_table_is_every_command_and_sub_command_of_the_parser():
    expected = _commands() | {("lab", name) for name in EXPERIMENTS}
    assert {("demo",), ("bench", "ddp"), ("consolidate",)} <= expected  # the walk reached the leaves
    rows = _table("Commands")
    assert rows[0].keys() == {"command", "what it does"}
    listed = set()
    for row in rows:
        text, page = _linked_code(row["command"])
        program, *words = text.split()
        assert program == "lit-parallel", text
        path = tuple(w for w in words if not w.startswith("-"))
        assert path in expected, f"{text!r}: no command {' '.join(path)!r} in the parser"
        options = [w for w in words if w.startswith("-")]
        parser = _parser_of(path[:1] if path[0] == "lab" else path)
        known = {s for action in parser._actions for s in action.option_strings}
        assert set(options) <= known, (
            f"{text!r}: {sorted(set(options) - known)} not options of {' '.join(path)}"
        )
        assert page.startswith("docs/"), f"{text} links {page}, not a docs page"
        assert row["what it does"], text
        listed.add(path)
    assert listed == expected, f"missing: {sorted(expected - listed)}"


def test_every_link_in_the_readme_points_to_a_file_of_the_repository():
    targets = re.findall(r"\]\(([^)\s]+)\)", README)
    local = [t for t in targets if not re.match(r"[a-z]+://", t) and not t.startswith("#")]
    assert len(local) > 30  # the three tables link every row
    missing = sorted({t for t in local if not (REPO_ROOT / t.split("#")[0]).exists()})
    assert not missing, f"README.md links files that do not exist: {missing}"


def test_the_two_commands_are_makefile_targets_and_ci_runs_the_test_command():
    heading = README.splitlines().index("## Two commands on a fresh machine") + 1
    after = [b for b in blocks_of(REPO_ROOT / "README.md") if b.line > heading]
    assert after and after[0].language == "bash", "README.md has no bash block under its two-commands heading"
    assert shell_commands(after[0]) == ["make demo", "make test"]
    targets = set(re.findall(r"^([a-z-]+):", (REPO_ROOT / "Makefile").read_text(), re.M))
    assert {"demo", "test"} <= targets
    assert re.search(r"^make test$", (REPO_ROOT / ".ci" / "run").read_text(), re.M)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_the_readmes_example_trains_on_two_cpu_ranks(tmp_path):
    blocks = [b for b in blocks_of(REPO_ROOT / "README.md") if b.language in PYTHON]
    assert len(blocks) == 1, "README.md's one Python example is run here; a new one needs a test"
    script = tmp_path / "example.py"
    script.write_text(blocks[0].text)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    for _ in range(2):  # Lightning's launcher picks a free port; another process may take it first: once more
        res = subprocess.run(
            [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=110
        )
        out = res.stdout + res.stderr
        if res.returncode == 0 or not any(m in out for m in PORT_CLASH):
            break
    assert res.returncode == 0, out[-4000:]
    assert "MEMBER: 2/2" in out and "ddp_tuned" in out, out[-4000:]
    assert "`Trainer.fit` stopped: `max_epochs=1` reached." in out, out[-4000:]
