"""Print the table of `auto_parallel`'s decisions at scale in docs/how-to/choosing-a-strategy.md, from dry runs.

Run from the repository root (about half a minute on 2 CPU cores; nothing is launched, no GPU is needed):

    PYTHONPATH=. python docs/hooks/auto_at_scale.py

For every cluster of 1 to 64 nodes of 8 GPUs of 80 GB, in bf16-mixed, each model of
tests/strategies/test_auto_at_scale.py (the recipes' models at their configs' sizes and a Llama-70B shape,
built on the meta device) is dry-run with ``strategy="auto_parallel"``: the advisor's rules choose, and the
chosen strategy's real setup runs for rank 0 on a simulated cluster (lit_parallel.strategies.dry_run). The
Markdown table goes to stdout; tests/strategies/test_auto_at_scale.py checks the page's copy against the rules
worked out by hand.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from lit_parallel.planner.rules import advise  # noqa: E402
from lit_parallel.strategies.dry_run import dry_run  # noqa: E402
from tests.large_models import llama_70b  # noqa: E402
from tests.strategies.test_auto_at_scale import (  # noqa: E402
    DEVICES,
    DOC_COLUMNS,
    MEMORY_GB,
    MODELS,
    NODES,
    USABLE,
)


def cell(run) -> str:
    """``pp_dp(pipeline_parallel_size=32, ...)`` (rule 4): what the table shows for one dry run."""
    args = ", ".join(f"{k}={v}" for k, v in run.kwargs.items())
    rule = re.search(r"\(rule (\d+)\)$", run.decision).group(1)
    return f"`{run.strategy}{f'({args})' if args else ''}` ({rule})"


def activations_gb(nodes: int, strategy: str) -> float:
    """The activations the advisor counts per rank for the Llama-70B shape under ``strategy``."""
    a = advise(model=llama_70b(), devices=DEVICES, nodes=nodes, memory_gb=MEMORY_GB)
    return (a.row("TP+DP").activation_bytes if strategy == "tp_dp" else a.activations.total_bytes) / 1e9


def main() -> int:
    head = ["nodes x GPUs", *DOC_COLUMNS, "Llama-70B rank 0: state (dry run) + activations"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    start = time.perf_counter()
    for nodes in NODES:
        cells, big = [], None
        for name in DOC_COLUMNS.values():
            run = dry_run(
                MODELS[name].build,
                "auto_parallel",
                devices=DEVICES,
                num_nodes=nodes,
                precision="bf16-mixed",
                memory_gb=MEMORY_GB,
                ranks="first",
            )
            if run.error is not None:
                raise SystemExit(f"{name} on {nodes} x {DEVICES}: {run.error}")
            cells.append(cell(run))
            big = run
        state, act = big.ranks[0].state_bytes / 1e9, activations_gb(nodes, big.strategy)
        fits = "fits" if (state + act) * 1e9 <= USABLE else "does not fit"
        lines.append(
            f"| {nodes} x {DEVICES} | " + " | ".join(cells) + f" | {state:.1f} + {act:.1f} GB: {fits} |"
        )
    print("\n".join(lines))
    print(f"\n({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
