"""Optional extras: a command whose extra is not installed says which, and the pip line that adds it, before
it does any work; the extras the commands check are the ones pyproject.toml declares."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lit_parallel.commands.extras import EXTRAS, missing_modules, require_extra

ROOT = Path(__file__).resolve().parents[2]

# Runs the CLI in a Python where the given modules are not installed: every import finder answers "no such
# module" for them and importlib.metadata lists no distribution of theirs, as after a `pip install` without
# the extra. Then it runs each argv through the CLI's main and prints [exit code, stdout, stderr] of each.
WITHOUT = r"""
import contextlib, io, json, re, sys

modules, dists, runs = json.loads(sys.argv[1])


class Without:
    def __init__(self, finder):
        self.finder = finder

    def __getattr__(self, name):
        return getattr(self.finder, name)

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in modules:
            return None
        find = getattr(self.finder, "find_spec", None)
        return find(name, path, target) if find else None

    def find_distributions(self, *args, **kwargs):
        find = getattr(self.finder, "find_distributions", None)
        for dist in find(*args, **kwargs) if find else ():
            if re.sub(r"[-_.]+", "-", dist.metadata["Name"] or "").lower() not in dists:
                yield dist


sys.meta_path[:] = [Without(f) for f in sys.meta_path]
from lit_parallel.commands.cli import main

results = []
for argv in runs:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    results.append([code, out.getvalue(), err.getvalue()])
print(json.dumps(results))
"""


def test_the_extras_the_commands_check_are_declared_in_pyproject():
    tomllib = pytest.importorskip("tomllib")
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra, dists in EXTRAS.items():
        names = {re.split(r"[\s\[<>=!~;]", req, maxsplit=1)[0].lower() for req in declared[extra]}
        assert set(dists) <= names, (
            f"extra {extra!r}: {set(dists) - names} not in pyproject's {sorted(names)}"
        )


def test_an_installed_extra_passes_and_an_unknown_one_is_refused():
    assert missing_modules("demo") == {}  # scikit-learn comes with the test extra
    require_extra("demo", "this test")
    with pytest.raises(ValueError, match="extra='plots' is not an extra the commands need; choose from demo"):
        missing_modules("plots")


@pytest.mark.timeout(120)
def test_commands_refuse_before_any_work_naming_the_extra_and_the_pip_line(tmp_path):
    runs = {
        "demo": (["demo", "--json", str(tmp_path / "demo.json")], "scikit-learn", "sklearn", "demo"),
        "lab": (["lab", "set-epoch", "--out", str(tmp_path / "lab")], "matplotlib", "matplotlib", "bench"),
        "bench all": (["bench", "all", "--out", str(tmp_path / "all")], "matplotlib", "matplotlib", "bench"),
        "bench pp": (
            ["bench", "pp", "--out", str(tmp_path / "pp"), "--json", str(tmp_path / "pp.json")],
            "matplotlib",
            "matplotlib",
            "bench",
        ),
        "bench ep": (
            ["bench", "ep", "--out", str(tmp_path / "ep"), "--json", str(tmp_path / "ep.json")],
            "transformers",
            "transformers",
            "moe",
        ),
        "bench checkpoint": (
            ["bench", "checkpoint", "--out", str(tmp_path / "ck"), "--json", str(tmp_path / "ck.json")],
            "matplotlib",
            "matplotlib",
            "bench",
        ),
    }
    absent = [
        ["sklearn", "matplotlib", "transformers"],
        ["scikit-learn", "matplotlib", "transformers"],
        [r[0] for r in runs.values()],
    ]
    res = subprocess.run(
        [sys.executable, "-c", WITHOUT, json.dumps(absent)],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=tmp_path,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)),
        check=False,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    results = json.loads(res.stdout.splitlines()[-1])
    for (name, (argv, dist, module, extra)), (code, out, err) in zip(runs.items(), results):
        assert code == 2, (name, out, err)
        assert err.count("\n") == 1 and err.startswith(
            f"lit-parallel {argv[0]}: error: {dist} is not installed"
        )
        assert f"(no module named {module!r})" in err
        assert f'Install the optional "{extra}" extra: pip install "lit_parallel[{extra}]"' in err
        assert out == "", (name, out)  # nothing started: no "training on ..." or "=== bench ..." line
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "a refused command wrote files"
