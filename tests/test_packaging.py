"""Release hygiene: one version number, and a wheel and an sdist that build offline and work.

The distribution is built from a copy of the repository, so the build's own output (`build/`, `*.egg-info`)
never lands in the checkout. It is built with `python -m build --no-isolation`, so the backend already
installed here is used and nothing is downloaded. The wheel is installed with `pip --target` into a folder
that goes first on `PYTHONPATH`. That folder shadows the editable checkout and reuses the torch and
Lightning already installed here; a fresh virtual environment would download gigabytes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import lit_parallel
from lit_parallel.commands.cli import COMMANDS, main
from tests.harness import REPO_ROOT

VERSION = lit_parallel.__version__
# top-level entries of a working copy that are outputs, not source (hidden ones, .git and .venv*, are skipped too)
OUTPUTS = {
    "build",
    "dist",
    "site",
    "lightning_logs",
    "runs",
    "bench-results",
    "contract-results",
    "lab-results",
}
# what the sdist must hold besides the package
SDIST_FILES = ("LICENSE", "README.md", "CHANGELOG.md", "pyproject.toml", "PKG-INFO")


def _run(args: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    res = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False, **kwargs)
    assert res.returncode == 0, (
        f"{' '.join(args)} exited {res.returncode}:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    )
    return res


def _copy_source(dest: Path) -> Path:
    def ignore(folder: str, names: list[str]) -> set[str]:
        skipped = {n for n in names if n == "__pycache__" or n.endswith((".egg-info", ".pyc"))}
        if Path(folder) == REPO_ROOT:
            skipped |= {n for n in names if n.startswith(".") or n in OUTPUTS}
        return skipped

    shutil.copytree(REPO_ROOT, dest, ignore=ignore)
    return dest


def _package_files() -> set[str]:
    """Every file of the package in the checkout, as a path inside the wheel."""
    root = REPO_ROOT / "lit_parallel"
    return {
        f"lit_parallel/{p.relative_to(root).as_posix()}"
        for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    }


def test_version_flag_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"lit-parallel {VERSION}\n"


@pytest.mark.timeout(300)
def test_wheel_and_sdist_build_offline_and_the_installed_wheel_runs_the_command(tmp_path):
    source = _copy_source(tmp_path / "source")
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(source)], timeout=240)
    wheel = dist / f"lit_parallel-{VERSION}-py3-none-any.whl"
    sdist = dist / f"lit_parallel-{VERSION}.tar.gz"
    assert sorted(p.name for p in dist.iterdir()) == sorted([wheel.name, sdist.name])

    # the wheel: every file of the package (py.typed included), the license and the version in its metadata
    assert (REPO_ROOT / "lit_parallel" / "py.typed").is_file()
    info = f"lit_parallel-{VERSION}.dist-info"
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        missing = _package_files() - names
        assert not missing, f"the wheel lacks {sorted(missing)}"
        assert whl.read(f"{info}/licenses/LICENSE") == (REPO_ROOT / "LICENSE").read_bytes()
        metadata = whl.read(f"{info}/METADATA").decode().splitlines()
        entry_points = whl.read(f"{info}/entry_points.txt").decode()
    assert f"Version: {VERSION}" in metadata
    assert "License-Expression: Apache-2.0" in metadata and "License-File: LICENSE" in metadata
    assert "lit-parallel = lit_parallel.commands.cli:main" in entry_points

    # the sdist: the package and the files that describe it; the test suite needs the whole repository
    with tarfile.open(sdist) as tar:
        members = set(tar.getnames())
    top = f"lit_parallel-{VERSION}"
    assert {f"{top}/{name}" for name in SDIST_FILES} <= members, sorted(members)[:20]
    assert f"{top}/lit_parallel/py.typed" in members
    assert not [m for m in members if m.startswith(f"{top}/tests/")]

    # the installed wheel, ahead of the editable checkout, with the dependencies already installed here
    site = tmp_path / "site"
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-index",
            "--no-deps",
            "--target",
            str(site),
            str(wheel),
        ],
        timeout=120,
    )
    env = dict(os.environ, PYTHONPATH=str(site), OMP_NUM_THREADS="1", COLUMNS="200")
    where = _run(
        [
            sys.executable,
            "-c",
            "import lit_parallel; print(lit_parallel.__file__); print(lit_parallel.__version__)",
        ],
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    file, version = where.stdout.split()
    assert Path(file).resolve() == (site / "lit_parallel" / "__init__.py").resolve()
    assert version == VERSION

    script = site / "bin" / "lit-parallel"
    help_text = _run([str(script), "--help"], timeout=120, cwd=tmp_path, env=env).stdout
    assert help_text.startswith("usage: lit-parallel")
    assert all(name in help_text for name in [*COMMANDS, "bench"])
    assert (
        _run([str(script), "--version"], timeout=120, cwd=tmp_path, env=env).stdout
        == f"lit-parallel {VERSION}\n"
    )
