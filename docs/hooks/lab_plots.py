"""Rebuild the plots and CSV files of the lab pages (docs/lab/*.md) with `lit-parallel lab all`.

Run from the repository root (about 10 minutes on 2 CPU cores):

    python docs/hooks/lab_plots.py            # the sizes the pages show
    python docs/hooks/lab_plots.py --quick    # the smallest sizes (what the tests run)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "docs" / "lab" / "results"


def main() -> int:
    cmd = [sys.executable, "-m", "lit_parallel.commands.cli", "lab", "all", "--out", str(OUT), *sys.argv[1:]]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.run(cmd, cwd=ROOT, env=env, check=False).returncode


if __name__ == "__main__":
    raise SystemExit(main())
