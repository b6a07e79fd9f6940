"""lit_parallel._compat is the one inventory of private torch / Lightning names, and every entry still exists.

An upgrade that moves or removes a private name fails here, in a test named after the entry.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from lit_parallel import _compat

PACKAGE = Path(_compat.__file__).parent
PRIVATE_ROOTS = ("torch", "lightning", "lightning_fabric", "pytorch_lightning", "torchmetrics")


@pytest.mark.parametrize("name", sorted(_compat.ENTRIES))
def test_compat_entry_resolves(name):
    _compat.check(name)


def test_every_handed_out_name_and_accessor_is_exported():
    for name in _compat.__all__:
        assert getattr(_compat, name) is not None, name
    identifiers = {n for n in _compat.ENTRIES if n.isidentifier()}
    assert identifiers <= set(_compat.__all__)


def test_every_entry_says_what_it_is_for_and_which_versions_were_checked():
    for name, entry in _compat.ENTRIES.items():
        assert entry.used_for and entry.public, name
        assert "torch" in entry.checked and "lightning" in entry.checked, name


def test_a_missing_private_name_fails_naming_the_entry(monkeypatch):
    entry = _compat.Entry("torch.utils._pytree:tree_flatten_gone", "a test", public="none")
    monkeypatch.setitem(_compat.ENTRIES, "gone", entry)
    with pytest.raises(ImportError, match=r"entry 'gone': torch\.utils\._pytree:tree_flatten_gone is gone"):
        _compat.check("gone")
    monkeypatch.setitem(
        _compat.ENTRIES, "gone", _compat.Entry("torch.nn:Module", "a test", attributes=("_nope",))
    )
    with pytest.raises(ImportError, match=r"entry 'gone': torch\.nn:Module has no _nope"):
        _compat.check("gone")


def test_compat_and_the_parallel_layer_import_no_lightning():
    # The package's __init__ imports Lightning, so load the modules under a bare package object.
    code = (
        "import sys, types\n"
        f"pkg = types.ModuleType('lit_parallel'); pkg.__path__ = [{str(PACKAGE)!r}]\n"
        "sys.modules['lit_parallel'] = pkg\n"
        "import lit_parallel._compat\n"
        "assert 'torch' not in sys.modules, 'importing _compat imports torch'\n"
        "import lit_parallel.parallel\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning'))\n"
        "assert not bad, bad[:5]\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def _is_private(dotted: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in dotted.split("."))


def _from_library(module: str | None) -> bool:
    return bool(module) and module.split(".")[0] in PRIVATE_ROOTS


def private_uses(path: Path) -> list[str]:
    """Private torch / Lightning names ``path`` imports, or reaches as an attribute of an imported name."""
    tree = ast.parse(path.read_text(), str(path))
    imported: set[str] = set()  # local names bound to torch / Lightning modules and objects
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not _from_library(alias.name):
                    continue
                imported.add(alias.asname or alias.name.split(".")[0])
                if _is_private(alias.name):
                    found.append(f"{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _from_library(node.module):
            for alias in node.names:
                imported.add(alias.asname or alias.name)
                if _is_private(f"{node.module}.{alias.name}"):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in imported:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return sorted(set(found), key=lambda s: int(s.split(":")[0]))


def test_the_private_use_scan_sees_imports_and_attributes(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "import torch\nimport torch.distributed as dist\nfrom torch.utils._pytree import tree_map\n"
        "from torch.nn.modules.batchnorm import _BatchNorm\nfrom lit_parallel._compat import tree_flatten\n"
        "dist.distributed_c10d._get_default_group()\ntorch.__version__\nself._x\n"
    )
    assert private_uses(source) == [
        "3: from torch.utils._pytree import tree_map",
        "4: from torch.nn.modules.batchnorm import _BatchNorm",
        "6: dist.distributed_c10d._get_default_group",
    ]


def test_only_compat_imports_private_torch_or_lightning_names():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "_compat.py" and path.parent == PACKAGE:
            continue
        uses = private_uses(path)
        if uses:
            offenders[str(path.relative_to(PACKAGE.parent))] = uses
    assert not offenders, "private torch / Lightning names outside lit_parallel/_compat.py:\n" + "\n".join(
        f"  {module}: {'; '.join(uses)}" for module, uses in offenders.items()
    )
