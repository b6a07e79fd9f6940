"""The fenced code blocks of README.md and docs/**/*.md, with the marker comment on the line before each fence.

A marker says what a block is, for the tests that run the examples (tests/test_doc_examples.py,
tests/test_readme.py, tests/test_migration.py); docs/explanations/architecture.md ("A docs example") is where
the convention is written down for contributors:

- ``<!-- fragment -->``: a Python block that is not a whole program (a hook, a call, an excerpt);
- ``<!-- not run: REASON -->``: a block no test runs, and why (GPUs, a cluster, minutes of training, an
  optional package `make test` does not install);
- ``<!-- migration-example: NAME -->``: a block of the migration guide that tests/test_migration.py runs.

A block without a marker is run by a test: README.md's Python example by tests/test_readme.py, every other
complete Python block and every shell command by tests/test_doc_examples.py (a recipe's torchrun command by
tests/test_recipes.py, which runs it from the config's header).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from tests.harness import REPO_ROOT

PYTHON = {"python", "py", "python3"}
SHELL = {"bash", "sh", "shell", "console", "zsh"}
MARKERS = ("fragment", "not run", "migration-example")

_FENCE = re.compile(r"^\s*(?P<fence>```+|~~~+)\s*(?P<language>[\w+-]*)")
_MARKER = re.compile(r"^<!--\s*(?P<kind>[\w -]+?)\s*(?::\s*(?P<detail>.*?))?\s*-->$")


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is (``path`` relative to the repository, ``line`` of its opening fence,
    1-based), its language (``""`` when the fence names none), its text and its marker, if any."""

    path: str
    line: int
    language: str
    text: str
    marker: str | None = None  # "fragment", "not run", "migration-example", or another HTML comment's kind
    detail: str = ""  # what follows the marker's colon: the reason, the migration example's name

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def markdown_files() -> list[Path]:
    """README.md, then every page under docs/ (sorted)."""
    return [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]


def blocks_of(path: Path) -> list[Block]:
    """The fenced blocks of one Markdown file, in order."""
    lines = path.read_text().splitlines()
    relative = str(path.relative_to(REPO_ROOT))
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence = opening.group("fence")
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == fence), None)
        if end is None:
            raise ValueError(f"{relative}:{i + 1}: the block opened here is never closed with {fence}")
        marker = _MARKER.match(lines[i - 1].strip()) if i > 0 else None
        found.append(
            Block(
                path=relative,
                line=i + 1,
                language=opening.group("language").lower(),
                text="\n".join(lines[i + 1 : end]) + "\n",
                marker=marker.group("kind") if marker else None,
                detail=(marker.group("detail") or "") if marker else "",
            )
        )
        i = end + 1
    return found


def all_blocks() -> list[Block]:
    return [block for path in markdown_files() for block in blocks_of(path)]


def marked_block(path: Path, marker: str, detail: str) -> Block:
    """The one block of ``path`` marked ``<!-- marker: detail -->``."""
    matches = [b for b in blocks_of(path) if b.marker == marker and b.detail == detail]
    assert len(matches) == 1, f"{path} has {len(matches)} blocks marked <!-- {marker}: {detail} -->, not 1"
    return matches[0]


def shell_commands(block: Block) -> list[str]:
    """The commands of a shell block, one string each: continuation lines joined, comments and blank lines
    dropped, the words re-joined with single spaces (so spacing does not matter, quoting does)."""
    commands: list[str] = []
    pending = ""
    for line in block.text.splitlines():
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        words = shlex.split(pending + line, comments=True)
        pending = ""
        if words:
            commands.append(shlex.join(words))
    if pending.strip():  # the last line ended with a backslash
        commands.append(shlex.join(shlex.split(pending, comments=True)))
    return commands
