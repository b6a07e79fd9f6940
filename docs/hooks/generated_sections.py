"""Write the documentation's generated sections from the code, as plain Markdown committed with the pages.

A page holds a generated section between two marker comments::

    <!-- begin generated: NAME (python docs/hooks/generated_sections.py) -->
    ...
    <!-- end generated: NAME -->

so it reads on GitHub as it does on the site, and ``tests/test_docs.py`` fails when the committed text is
not what the code gives. The sections: the advisor's rule table (``lit_parallel.planner.rules.RULES``) in
``how-to/choosing-a-strategy.md``, and the API reference in ``reference/api/*.md``: every class and
function of ``lit_parallel.__all__``, of ``lit_parallel.parallel.__all__`` and the planner's public names
(:data:`PLANNER`), each with its signature, its docstring and its arguments. Run from the repository root:

    python docs/hooks/generated_sections.py          # rewrite the sections
    python docs/hooks/generated_sections.py --check  # exit 1, naming the pages, if one is stale
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
COMMAND = "python docs/hooks/generated_sections.py"

# the planner's public API (the planner has no __all__): the decision and what it is made of
PLANNER = [
    "lit_parallel.planner.rules.advise",
    "lit_parallel.planner.rules.Advice",
    "lit_parallel.planner.rules.Rule",
    "lit_parallel.planner.rules.RULES",
    "lit_parallel.planner.rules.usable_memory",
    "lit_parallel.planner.rules.expert_parallel_choice",
    "lit_parallel.planner.rules.rules_markdown",
    "lit_parallel.planner.memory.table.MemoryRow",
    "lit_parallel.planner.model_summary.summarize_model",
    "lit_parallel.planner.activations.estimate_activations",
    "lit_parallel.planner.dry_run.state.rank_state",
    "lit_parallel.planner.dry_run.state.RankState",
    "lit_parallel.planner.memory.rank_state.predicted_state",
    "lit_parallel.planner.dry_run.step.measure_step",
]

# lit_parallel.parallel.__all__, by where each name is defined: (section title, module prefixes)
PARALLEL_SECTIONS = [
    ("The parallelize pipeline", ("lit_parallel.parallel.parallelize",)),
    ("Meshes", ("lit_parallel.parallel.mesh",)),
    ("Simulated process groups (dry runs)", ("lit_parallel.parallel.simulated",)),
    ("Transformer blocks", ("lit_parallel.parallel.blocks",)),
    ("FSDP2", ("lit_parallel.parallel.fsdp",)),
    ("Tensor parallelism", ("lit_parallel.parallel.tensor_parallel",)),
    ("Expert parallelism", ("lit_parallel.parallel.expert_parallel",)),
    ("DDP: buckets and communication hooks", ("lit_parallel.parallel.ddp",)),
    ("Memory and communication estimates", ("lit_parallel.parallel.memory",)),
    ("Counting and timing collectives", ("lit_parallel.measure",)),
    ("Formatting", ("lit_parallel.formatting",)),
]
# constants carry no __module__: where each is defined
CONSTANT_MODULES = {
    "COMM_HOOKS": "lit_parallel.parallel.ddp.comm_hooks",
    "PLAN_PROVIDERS": "lit_parallel.parallel.tensor_parallel.families",
    "RULES": "lit_parallel.planner.rules",
}

# the members documented for the public classes that inherit Lightning's hooks (the hooks are Lightning's);
# attributes set on the instance are in the class docstring
MEMBERS = {
    "TunedDDPStrategy": ["find_unused_parameters"],
    "TransformerFSDPStrategy": ["parallel_dims"],
    "AutoStrategy": ["decide"],
    "PitfallReport": ["check", "table"],
}

# the user guide's page of each public class (relative to docs/reference/api/)
GUIDES = {
    "TunedDDPStrategy": "../strategies/ddp_tuned.md",
    "TransformerFSDPStrategy": "../strategies/fsdp_blocks.md",
    "HybridShardStrategy": "../strategies/hsdp.md",
    "TensorParallelStrategy": "../strategies/tp_dp.md",
    "PipelineParallelStrategy": "../strategies/pp_dp.md",
    "AutoStrategy": "../strategies/auto_parallel.md",
    "SetEpochCheck": "../callbacks/set_epoch_check.md",
    "CrossRankMetrics": "../callbacks/cross_rank_metrics.md",
    "SyncBatchNormConversion": "../callbacks/sync_batchnorm_conversion.md",
    "PitfallReport": "../callbacks/pitfall_report.md",
}

SECTION_NAMES = (
    "Args",
    "Arguments",
    "Attributes",
    "Raises",
    "Returns",
    "Yields",
    "Example",
    "Examples",
    "Note",
)
SIGNATURE_WIDTH = 100


# --- docstrings: Google style to Markdown -----------------------------------------------------------------


def _inline(text: str) -> str:
    """Sphinx roles and ``literals`` as Markdown code."""
    text = re.sub(r":(?:func|class|meth|mod|data|attr|exc|obj):`~?([^`]+)`", lambda m: f"`{_role(m)}`", text)
    return re.sub(r"``(.+?)``", r"`\1`", text)


def _role(match: re.Match) -> str:
    target = match.group(1).lstrip(".")
    return target.rsplit(".", 1)[-1] if match.group(0).split("`")[1].startswith("~") else target


def _cell(text: str) -> str:
    return _inline(" ".join(text.split())).replace("|", "\\|")


# names separated by ", " or " / " (``a / b: the same, ...``)
_ENTRY = re.compile(
    r"^(\*{0,2}[A-Za-z_][\w.]*(?:(?:, *| / )\*{0,2}[A-Za-z_][\w.]*)*)(?: \(([^)]*)\))?: ?(.*)$"
)
_NAMES_ONLY = re.compile(r"^\*{0,2}[A-Za-z_]\w*(?:, *\*{0,2}[A-Za-z_]\w*)*,$")


def _entries(lines: list[str]) -> list[tuple[str, str]]:
    """``name: text`` entries of an Args/Raises/Attributes section (continuations indented further; a list
    of names may wrap over several lines before its colon)."""
    entries: list[tuple[str, str]] = []
    pending = ""
    for line in lines:
        if not line.strip():
            continue
        if line.startswith(" ") and entries and not pending:
            entries[-1] = (entries[-1][0], entries[-1][1] + " " + line.strip())
            continue
        line = pending + line.strip()
        if _NAMES_ONLY.match(line):
            pending = line + " "
            continue
        pending = ""
        m = _ENTRY.match(line)
        if m:
            entries.append((m.group(1), m.group(3)))
        elif entries:
            entries[-1] = (entries[-1][0], entries[-1][1] + " " + line)
        else:
            entries.append(("", line))
    return entries


def _table(entries: list[tuple[str, str]], head: str) -> list[str]:
    rows = [f"| {head} | description |", "|---|---|"]
    for names, text in entries:
        cell = ", ".join(f"`{n.strip()}`" for n in re.split(r",| / ", names)) if names else ""
        rows.append(f"| {cell} | {_cell(text)} |")
    return rows


def _paragraphs(lines: list[str]) -> list[str]:
    """Plain docstring text: paragraphs as they are; indented lines (examples) as a text block."""
    out: list[str] = []
    block: list[str] = []
    for line in [*lines, ""]:
        if line.startswith("    ") and (block or not out or not out[-1] or out[-1].endswith("::")):
            block.append(line[4:])
            continue
        if block:
            if out and out[-1].endswith("::"):
                out[-1] = out[-1][:-1]
            out += ["", "```text", *block, "```", ""]
            block = []
        out.append(_inline(line))
    while out and not out[-1]:
        out.pop()
    return out


def docstring_markdown(obj: object) -> list[str]:
    """``obj``'s docstring as Markdown: the text, then Args / Attributes / Raises as tables."""
    doc = inspect.getdoc(obj) or ""
    lines = doc.splitlines()
    out: list[str] = []
    i = 0
    text: list[str] = []
    while i < len(lines):
        header = lines[i].strip().rstrip(":")
        if lines[i].rstrip().endswith(":") and header in SECTION_NAMES and not lines[i].startswith(" "):
            body = []
            i += 1
            while i < len(lines) and (not lines[i].strip() or lines[i].startswith(" ")):
                body.append(lines[i][4:] if lines[i].startswith("    ") else lines[i])
                i += 1
            out += _paragraphs(text)
            text = []
            if header in ("Args", "Arguments", "Attributes", "Raises"):
                head = {"Raises": "exception", "Attributes": "attribute"}.get(header, "argument")
                out += ["", *_table(_entries(body), head), ""]
            elif header in ("Example", "Examples"):  # code: shown, never run (a fragment of a program)
                while body and not body[-1].strip():
                    body.pop()
                while body and not body[0].strip():
                    body.pop(0)
                out += ["", f"**{header}:**", "", "<!-- fragment -->", "```python", *body, "```", ""]
            else:
                out += ["", f"**{header}:**", "", *_paragraphs(body), ""]
            continue
        text.append(lines[i])
        i += 1
    out += _paragraphs(text)
    cleaned: list[str] = []
    for line in out:  # at most one blank line in a row, none at the ends
        if line or (cleaned and cleaned[-1]):
            cleaned.append(line)
    while cleaned and not cleaned[-1]:
        cleaned.pop()
    return cleaned


# --- signatures -------------------------------------------------------------------------------------------


def _annotation(a: object) -> str:
    return a if isinstance(a, str) else inspect.formatannotation(a)


def _default(value: object) -> str:
    text = repr(value)
    return re.sub(r" at 0x[0-9a-f]+", "", text)


def signature_text(name: str, obj: Callable) -> str:
    """``name(arg: type = default, ...) -> return``: on one line when it fits, else one argument a line."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return f"{name}(...)"
    parts: list[str] = []
    star_done = False
    for p in sig.parameters.values():
        if p.name == "self":
            continue
        if p.kind is p.KEYWORD_ONLY and not star_done:
            parts.append("*")
            star_done = True
        prefix = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
        star_done = star_done or p.kind is p.VAR_POSITIONAL
        text = prefix + p.name
        if p.annotation is not p.empty:
            text += f": {_annotation(p.annotation)}"
        if p.default is not p.empty:
            text += (" = " if p.annotation is not p.empty else "=") + _default(p.default)
        parts.append(text)
        if p.kind is p.POSITIONAL_ONLY and (
            list(sig.parameters.values())[-1] is p
            or list(sig.parameters.values())[list(sig.parameters).index(p.name) + 1].kind
            is not p.POSITIONAL_ONLY
        ):
            parts.append("/")
    returns = ""
    if sig.return_annotation is not sig.empty and not inspect.isclass(obj):
        returns = f" -> {_annotation(sig.return_annotation)}"
    one_line = f"{name}({', '.join(parts)}){returns}"
    if len(one_line) <= SIGNATURE_WIDTH:
        return one_line
    return f"{name}(\n" + "".join(f"    {part},\n" for part in parts) + f"){returns}"


# --- entries ----------------------------------------------------------------------------------------------


def _kind(obj: object) -> str:
    if inspect.isclass(obj):
        return "exception" if issubclass(obj, BaseException) else "class"
    return "function" if callable(obj) else "constant"


def _constant_value(value: object) -> str:
    if isinstance(value, (list, tuple)) and value and all(hasattr(v, "name") for v in value):
        return f"{len(value)} entries: " + "; ".join(f"`{v.name}`" for v in value)
    if isinstance(value, (list, tuple)) and all(
        hasattr(v, "number") and hasattr(v, "strategy") for v in value
    ):
        return "; ".join(f"rule {v.number}: `{v.strategy}`" for v in value)
    return f"`{_default(value)}`"


def _members(cls: type, names: list[str] | None) -> list[tuple[str, object]]:
    """Public methods and properties of ``cls`` itself (or the ``names`` given), with their docstrings."""
    if names is None:
        names = [
            n
            for n, v in vars(cls).items()
            if not n.startswith("_")
            and (inspect.isfunction(v) or isinstance(v, (property, classmethod, staticmethod)))
            and inspect.getdoc(getattr(cls, n, None))
        ]
    return [(n, inspect.getattr_static(cls, n)) for n in names]


def entry(qualified: str, obj: object, level: int = 2, members: list[str] | None = None) -> list[str]:
    """One API entry: heading, where it lives, signature, docstring, then its documented members."""
    name = qualified.rsplit(".", 1)[-1]
    kind = _kind(obj)
    lines = [f"{'#' * level} `{name}`", ""]
    where = f"`{qualified}` ({kind})"
    if name in GUIDES:
        where += f"; the guide: [{Path(GUIDES[name]).stem}]({GUIDES[name]})"
    lines += [where, ""]
    if kind == "constant":
        return [*lines, _constant_value(obj), ""]
    if kind != "exception":  # an exception takes its message
        lines += ["```text", signature_text(name, obj), "```", ""]
    lines += [*docstring_markdown(obj), ""]
    if inspect.isclass(obj) and not issubclass(obj, BaseException):
        for member_name, member in _members(obj, members):
            lines += _member(name, member_name, member, level + 1)
    return lines


def _member(owner: str, name: str, member: object, level: int) -> list[str]:
    if isinstance(member, property):
        head, doc_of, sig = f"`{owner}.{name}` (property)", member.fget, None
    else:
        func = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
        head, doc_of, sig = f"`{owner}.{name}`", member, signature_text(name, func)
    lines = [f"{'#' * level} {head}", ""]
    if sig is not None:
        lines += ["```text", sig, "```", ""]
    return [*lines, *docstring_markdown(doc_of), ""]


def _resolve(qualified: str) -> object:
    module, _, name = qualified.rpartition(".")
    return getattr(importlib.import_module(module), name)


# --- the sections -----------------------------------------------------------------------------------------


def _top_level() -> tuple[list[str], list[str]]:
    """``lit_parallel.__all__``'s classes and functions: (strategies, everything else)."""
    from lightning.pytorch.strategies import Strategy

    import lit_parallel

    names = [n for n in lit_parallel.__all__ if callable(getattr(lit_parallel, n))]
    strategies = [
        n
        for n in names
        if inspect.isclass(getattr(lit_parallel, n)) and issubclass(getattr(lit_parallel, n), Strategy)
    ]
    return strategies, [n for n in names if n not in strategies]


def api_strategies() -> str:
    import lit_parallel

    strategies, _ = _top_level()
    lines: list[str] = []
    for n in strategies:
        lines += entry(f"lit_parallel.{n}", getattr(lit_parallel, n), members=MEMBERS.get(n, []))
    return "\n".join(lines).rstrip() + "\n"


def api_callbacks() -> str:
    import lit_parallel

    _, others = _top_level()
    lines: list[str] = []
    for n in others:
        lines += entry(f"lit_parallel.{n}", getattr(lit_parallel, n), members=MEMBERS.get(n, []))
    return "\n".join(lines).rstrip() + "\n"


def _defined_in(name: str, obj: object) -> str:
    module = getattr(obj, "__module__", None) if (inspect.isclass(obj) or callable(obj)) else None
    if module is None:
        if name not in CONSTANT_MODULES:
            raise ValueError(
                f"{name} is a constant without a module: add it to CONSTANT_MODULES in {__file__}"
            )
        module = CONSTANT_MODULES[name]
    return module


def api_parallel() -> str:
    from lit_parallel import parallel

    sections: dict[str, list[str]] = {title: [] for title, _ in PARALLEL_SECTIONS}
    for name in sorted(parallel.__all__, key=str.lower):
        module = _defined_in(name, getattr(parallel, name))
        title = next((t for t, prefixes in PARALLEL_SECTIONS if module.startswith(prefixes)), None)
        if title is None:
            raise ValueError(
                f"lit_parallel.parallel.{name} is defined in {module}, which no section of PARALLEL_SECTIONS"
                f" holds: add it there ({__file__})"
            )
        sections[title].append(name)
    lines = ["## Choosing a strategy (`lit_parallel.planner`)", ""]
    for qualified in PLANNER:
        lines += entry(qualified, _resolve(qualified), level=3)
    for title, names in sections.items():
        if names:
            lines += [f"## {title}", ""]
            for name in names:
                lines += entry(f"lit_parallel.parallel.{name}", getattr(parallel, name), level=3)
    return "\n".join(lines).rstrip() + "\n"


def advisor_rules() -> str:
    from lit_parallel.planner.rules import rules_markdown

    return rules_markdown() + "\n"


# page (relative to docs/) -> {section name: renderer}
SECTIONS: dict[str, dict[str, Callable[[], str]]] = {
    "how-to/choosing-a-strategy.md": {"advisor-rules": advisor_rules},
    "reference/api/strategies.md": {"api-strategies": api_strategies},
    "reference/api/callbacks.md": {"api-callbacks": api_callbacks},
    "reference/api/parallel.md": {"api-parallel": api_parallel},
}


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- begin generated: {name} ({COMMAND}) -->", f"<!-- end generated: {name} -->"


def refresh(text: str, name: str, body: str) -> str:
    """``text`` with section ``name``'s body replaced (the markers must be there, once each)."""
    begin, end = _markers(name)
    if text.count(begin) != 1 or text.count(end) != 1:
        raise ValueError(f"the page must hold the markers {begin!r} and {end!r} once each")
    head, rest = text.split(begin)
    _, tail = rest.split(end)
    return f"{head}{begin}\n\n{body}\n{end}{tail}"


def rendered() -> dict[Path, str]:
    """Every page with generated sections, as the code gives it now."""
    pages = {}
    for page, sections in SECTIONS.items():
        path = DOCS / page
        text = path.read_text()
        for name, render in sections.items():
            text = refresh(text, name, render())
        pages[path] = text
    return pages


def stale() -> list[Path]:
    """The pages whose committed text differs from :func:`rendered`."""
    return [path for path, text in rendered().items() if path.read_text() != text]


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(REPO))
    if "--check" in argv:
        old = stale()
        for path in old:
            print(f"{path.relative_to(REPO)} is stale: run {COMMAND}", file=sys.stderr)
        return 1 if old else 0
    for path, text in rendered().items():
        if path.read_text() != text:
            path.write_text(text)
            print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
