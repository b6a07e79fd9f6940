"""The package's layers: a lower layer never imports a higher one, and no module imports itself back through
others, counting imports made inside functions and under ``TYPE_CHECKING`` (the contract ``make lint`` runs).

The contract is :data:`LAYERS`; docs/explanations/architecture.md shows it as a table that a test here holds against it.
Every import statement of every module is read from its source (``ast``), wherever it stands.
"""

from __future__ import annotations

import ast
import functools
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "lit_parallel"
ARCHITECTURE = ROOT / "docs" / "explanations" / "architecture.md"

# Top to bottom. A module may import modules of its own package and of any layer below its own; packages
# named in the same row are independent of each other.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("lit_parallel.commands",),
    ("lit_parallel",),  # the package's own __init__: the public names
    ("lit_parallel.strategies",),
    ("lit_parallel.callbacks", "lit_parallel.reliability", "lit_parallel.plugins"),
    ("lit_parallel.planner",),
    ("lit_parallel.parallel",),
    ("lit_parallel.measure", "lit_parallel.checkpoint", "lit_parallel.nn"),
    (
        "lit_parallel._compat",
        "lit_parallel._logging",
        "lit_parallel.rng",
        "lit_parallel.formatting",
        "lit_parallel.devices",
    ),
)

# Layers inside a package, top to bottom; a package not named here has no order inside, only no cycles.
INNER_LAYERS: dict[str, tuple[tuple[str, ...], ...]] = {
    "lit_parallel.planner": (
        ("lit_parallel.planner.rules",),
        ("lit_parallel.planner.memory",),
        ("lit_parallel.planner.time",),
        (
            "lit_parallel.planner.simulation",
            "lit_parallel.planner.pipeline_layout",
            "lit_parallel.planner.model_summary",
        ),
        ("lit_parallel.planner.activations",),
        (
            "lit_parallel.planner.fused_attention",
            "lit_parallel.planner.precision",
            "lit_parallel.planner.dry_run",
        ),
    ),
}

# Packages that must run without Lightning installed in the process (pure PyTorch).
NO_LIGHTNING = (
    "lit_parallel.parallel",
    "lit_parallel.planner",
    "lit_parallel.measure",
    "lit_parallel.checkpoint",
    "lit_parallel.nn",
)


def module_files() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _import_names(module: str, path: Path, node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        base = module.split(".")
        if path.name != "__init__.py":
            base = base[:-1]
        base = base[: len(base) - (node.level - 1)]
        prefix = ".".join(base + ([node.module] if node.module else []))
    else:
        prefix = node.module or ""
    return [f"{prefix}.{a.name}" for a in node.names] + [prefix]


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (any import statement anywhere in it)."""
    files = module_files()
    graph: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            names = _import_names(module, path, node)
            # `from pkg import a`: the submodule a if it is one, else pkg
            if isinstance(node, ast.ImportFrom):
                names = [n for n in names[:-1] if n in files] or names[-1:]
            for name in names:
                while name and name not in files:
                    name = name.rpartition(".")[0]
                if name and name != module:
                    graph[module].add(name)
    return graph


def external_imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module.split(".")[0])
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _owner(module: str, layers: tuple[tuple[str, ...], ...]) -> tuple[int, str] | None:
    """(layer index, the layer's package) of ``module``: its longest matching package."""
    best = None
    for i, row in enumerate(layers):
        for pkg in row:
            if (module == pkg or module.startswith(pkg + ".")) and (best is None or len(pkg) > len(best[1])):
                best = (i, pkg)
    return best


def layer_violations(
    graph: dict[str, set[str]], layers: tuple[tuple[str, ...], ...], within: str = ""
) -> list[str]:
    bad = []
    for src, targets in graph.items():
        if within and not src.startswith(within + "."):
            continue
        s = _owner(src, layers)
        for dst in targets:
            if within and not dst.startswith(within + "."):
                continue
            d = _owner(dst, layers)
            if s is None or d is None or s[1] == d[1]:
                continue
            if d[0] < s[0] or (d[0] == s[0] and d[1] != s[1]):
                how = "a higher layer" if d[0] < s[0] else "an independent package of its own layer"
                bad.append(f"{src} imports {dst} ({how}: {d[1]} over {s[1]})")
    return sorted(bad)


def test_every_module_belongs_to_a_layer():
    orphans = [m for m in module_files() if _owner(m, LAYERS) is None]
    assert not orphans, f"modules in no layer of LAYERS (add them to the contract): {orphans}"
    for pkg, layers in INNER_LAYERS.items():
        inside = [m for m in module_files() if m.startswith(pkg + ".") and _owner(m, layers) is None]
        assert not inside, f"modules of {pkg} in no layer of INNER_LAYERS[{pkg!r}]: {inside}"


def test_no_import_cycles_counting_function_level_imports():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_layers_import_only_downward():
    graph = import_graph()
    bad = layer_violations(graph, LAYERS)
    for pkg, layers in INNER_LAYERS.items():
        bad += layer_violations(graph, layers, within=pkg)
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_pure_pytorch_layers_import_no_lightning():
    bad = [
        f"{m} imports Lightning"
        for m, path in module_files().items()
        if any(m == p or m.startswith(p + ".") for p in NO_LIGHTNING)
        and external_imports(path) & {"lightning", "pytorch_lightning", "lightning_fabric"}
    ]
    assert not bad, bad


def test_the_checker_sees_function_level_imports_and_cycles():
    # the checker itself, on a graph with a function-level edge closing a loop and an upward edge
    graph = {"a.x": {"a.y"}, "a.y": {"a.x"}, "a.z": set()}
    assert cycles(graph) == [["a.x", "a.y"]]
    layers = (("a.x",), ("a.y", "a.z"))
    assert layer_violations({"a.y": {"a.x"}, "a.z": {"a.y"}, "a.x": set()}, layers) == [
        "a.y imports a.x (a higher layer: a.x over a.y)",
        "a.z imports a.y (an independent package of its own layer: a.y over a.z)",
    ]
    tree_src = "def f():\n    from lit_parallel.commands import cli\n"
    node = next(n for n in ast.walk(ast.parse(tree_src)) if isinstance(n, ast.ImportFrom))
    assert "lit_parallel.commands.cli" in _import_names("lit_parallel.parallel.mesh", PACKAGE / "x.py", node)


@functools.cache
def _dotted_strings() -> dict[str, list[str]]:
    """Every string in the package and the tests that names a lit_parallel module (``"lit_parallel.x.y"``,
    ``"lit_parallel.x:attr"``), with where it stands."""
    pattern = re.compile(r"^lit_parallel(\.\w+)+(:\w+)?$")
    found: dict[str, list[str]] = {}
    for path in [*PACKAGE.rglob("*.py"), *(ROOT / "tests").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and pattern.match(node.value):
                found.setdefault(node.value, []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def _top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.Import, ast.ImportFrom)):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            names |= {n.id for t in targets if t is not None for n in ast.walk(t) if isinstance(n, ast.Name)}
            names |= {(a.asname or a.name).split(".")[0] for a in getattr(node, "names", [])}
    return names


def test_modules_named_in_strings_exist():
    """Worker modules launched by name (``python -m lit_parallel...``, ``run_ranks("lit_parallel...")``), the
    command table's modules and ``module:attribute`` targets are found, not left behind by a move."""
    files = module_files()
    missing = []
    for name, where in _dotted_strings().items():
        module, _, attr = name.partition(":")
        if module not in files:  # ``lit_parallel.x.name``: a name defined in module lit_parallel.x
            module, _, attr = module.rpartition(".")
        if module not in files or (attr and attr not in _top_level_names(files[module])):
            missing.append(f"{name} ({', '.join(where)})")
    assert not missing, "strings naming modules or names that do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize(
    "module",
    sorted(
        m
        for m, path in module_files().items()
        if m.startswith("lit_parallel.commands") and "__main__" in path.read_text()
    ),
)
def test_modules_run_by_name_are_launchable(module):
    """Each module with a ``__main__`` entry (what ranks run by name) is named somewhere a launch names it."""
    names = {n.partition(":")[0] for n in _dotted_strings()}
    assert module in names or module == "lit_parallel.commands.cli", (
        f"{module} has a __main__ but nothing launches it"
    )


def _documented_layers() -> list[list[str]]:
    """The layer table of docs/explanations/architecture.md: one row per layer, its packages in backticks."""
    text = ARCHITECTURE.read_text()
    start = text.index("<!-- layers -->")
    end = text.index("<!-- /layers -->")
    rows = []
    for line in text[start:end].splitlines():
        if line.startswith("|") and "`lit_parallel" in line:
            rows.append(re.findall(r"`(lit_parallel[\w.]*)`", line.split("|")[2]))
    return rows


def test_architecture_page_shows_the_contract():
    assert _documented_layers() == [list(row) for row in LAYERS]
