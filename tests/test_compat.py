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


# --- torch features by version: has_feature, and the one log line of what an older torch loses ----------


def test_every_feature_is_younger_than_the_oldest_supported_torch_and_says_what_an_older_one_does():
    for key, feature in _compat.FEATURES.items():
        assert feature.name and feature.older, key
        if feature.entry:  # a private name every supported torch has: an entry, no release number
            assert feature.entry in _compat.ENTRIES and not feature.since, key
            continue
        assert tuple(map(int, feature.since.split("."))) > tuple(map(int, _compat.OLDEST_TORCH.split("."))), (
            key
        )


@pytest.mark.parametrize("key", sorted(_compat.FEATURES))
def test_the_installed_torch_has_a_feature_exactly_when_its_release_is_at_least_the_features(key):
    # the probes look at torch itself (a signature, an attribute); the release numbers are the docs' claim
    import torch

    feature = _compat.FEATURES[key]
    if feature.entry:  # a private name: there exactly when its entry resolves (on every supported torch)
        _compat.check(feature.entry)
        assert feature.probe() is True, (key, torch.__version__)
        return
    release = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    since = tuple(int(p) for p in feature.since.split("."))
    assert feature.probe() is (release >= since), (key, torch.__version__)


def test_a_private_name_that_is_gone_is_a_feature_lost_and_its_line_names_the_entrys_checked_releases(
    monkeypatch, older_torch, caplog
):
    import torch

    gone = _compat.Entry("torch.distributed._tools.mem_tracker:NoSuchTracker", "a test", public="none")
    monkeypatch.setitem(_compat.ENTRIES, "MemTracker", gone)
    assert _compat.FEATURES["mem_tracker"].probe() is False  # the probe resolves the entry
    older_torch("mem_tracker")
    _compat.log_degraded("mem_tracker")
    _compat.log_degraded("mem_tracker")
    assert _lacks_lines(caplog) == [
        f"lit_parallel: torch {torch.__version__} lacks torch.distributed._tools.mem_tracker.MemTracker (a"
        f" private name, checked with {_compat.CHECKED}): advise --verify reports the peak of lit_parallel's own"
        " counter (LiveMemory) without torch's MemTracker peak beside it"
    ]


@pytest.fixture
def older_torch(monkeypatch, caplog):
    """Force features off (as on torch 2.11) with a fresh once-per-process log; yields a function doing so."""
    monkeypatch.setattr(_compat, "_FORCED", {})
    monkeypatch.setattr(_compat, "_LOGGED", set())
    for variable in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        monkeypatch.delenv(variable, raising=False)
    caplog.set_level("INFO", logger="lit_parallel")

    def force_off(*keys: str) -> None:
        _compat._FORCED.update(dict.fromkeys(keys, False))

    return force_off


def _lacks_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "lacks" in r.getMessage()]


def test_a_lost_feature_is_logged_once_naming_the_torch_that_has_it(older_torch, caplog):
    import torch

    older_torch("ddp_batched_grad_copy")
    assert _compat.has_feature("ddp_batched_grad_copy") is False
    for _ in range(3):
        _compat.log_degraded("ddp_batched_grad_copy")
    assert _lacks_lines(caplog) == [
        f"lit_parallel: torch {torch.__version__} lacks DistributedDataParallel(batched_grad_copy=) (torch 2.12"
        " and later have it): batched_grad_copy=True is ignored: DDP copies each gradient into its bucket one"
        " parameter at a time"
    ]
    assert [r.levelname for r in caplog.records if "lacks" in r.getMessage()] == ["WARNING"]


def test_only_rank_zero_logs_and_a_feature_replaced_exactly_is_not_logged(older_torch, caplog, monkeypatch):
    older_torch("pipelining_integer_tensors", "ddp_forward_sync_buffers")
    monkeypatch.setenv("LOCAL_RANK", "1")
    _compat.log_degraded("pipelining_integer_tensors")
    _compat.log_degraded("ddp_forward_sync_buffers")  # lost=False: the same behaviour, nothing to say
    monkeypatch.setenv("LOCAL_RANK", "0")
    _compat.log_degraded("ddp_forward_sync_buffers")
    assert _lacks_lines(caplog) == []


def test_an_unknown_feature_is_a_key_error():
    with pytest.raises(KeyError):
        _compat.has_feature("ddp_no_such_thing")


def test_batched_grad_copy_on_a_torch_without_it_is_dropped_with_the_line_and_ddp_still_builds(
    older_torch, caplog
):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from lit_parallel import TunedDDPStrategy

    older_torch("ddp_batched_grad_copy")
    strategy = TunedDDPStrategy(batched_grad_copy=True, check_reduction=False)
    assert (
        "batched_grad_copy" not in strategy._ddp_kwargs and strategy._ddp_kwargs["check_reduction"] is False
    )
    assert len(_lacks_lines(caplog)) == 1 and "batched_grad_copy" in _lacks_lines(caplog)[0]
    TunedDDPStrategy(batched_grad_copy=False)  # the default: nothing lost, nothing said
    TunedDDPStrategy(batched_grad_copy=True)  # said once per process
    assert len(_lacks_lines(caplog)) == 1
    with pytest.raises(ValueError, match=r"batched_grad_copy='yes' must be True or False"):
        TunedDDPStrategy(batched_grad_copy="yes")
    # the arguments left build DDP (a real one-rank gloo group)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(torch.nn.Linear(2, 2), **strategy._ddp_kwargs)
        ddp(torch.ones(1, 2)).sum().backward()
    finally:
        dist.destroy_process_group()


def test_forward_sync_buffers_without_the_ddp_argument_sets_the_flag_ddp_reads_before_each_forward(
    older_torch,
):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    older_torch("ddp_forward_sync_buffers")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for value in (False, True):
            ddp = DistributedDataParallel(torch.nn.BatchNorm1d(2))  # buffers synced at construction
            _compat.set_forward_sync_buffers(ddp, value)
            assert ddp.will_sync_module_buffers() is value
            ddp(torch.randn(4, 2))
    finally:
        dist.destroy_process_group()
