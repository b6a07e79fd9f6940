"""Generate docs/reference/supported-models.md from the conformance suite's results (tests/conformance_results.json).

The results are what tests/test_conformance.py measured (and checks against this file on every run), so
the page cannot drift from the tests; tests/test_conformance.py also checks that the committed page equals
what this script renders. Run from the repository root:

    python docs/hooks/supported_models.py          # rewrite docs/reference/supported-models.md
    python docs/hooks/supported_models.py --check  # exit 1 if the page is stale
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "tests" / "conformance_results.json"
PAGE = REPO / "docs" / "reference" / "supported-models.md"

INTRO = """\
# Supported models

Every model below is trained under every strategy of the conformance suite (`tests/test_conformance.py`,
models in `tests/conformance_models.py`) on {world} CPU ranks (gloo), and each run is compared with one
plain PyTorch process trained on the same global batches (the order of Lightning's `DistributedSampler`):
fp32, 3 optimizer steps of 2 accumulated micro-batches, relative error of every micro-batch loss
below 1e-5. The suite also checks that the parallelism is real: under `fsdp_blocks` and `hsdp` each rank
holds at most 1/{world} of every block's parameters; under `tp_dp` (`tensor_parallel_size={tp}`) each rank
holds 1/{tp} of every attention and MLP projection; `auto_parallel` is checked as the strategy it chose.

This page is generated from the suite's results by `docs/hooks/supported_models.py`; do not edit it by
hand. A cell reads **exact** when the losses match and the parallelism checks pass, followed by the
per-rank parameter share (bytes of parameters one rank holds / bytes of the whole model's parameters); a
strategy the suite does not run yet has a column that says so, and why, below the table.
"""


# registered strategies the suite does not run yet: their column says so, with why and what tests them instead
NOT_IN_SUITE = {
    "pp_dp": (
        "`pp_dp` is not in the conformance suite yet: the suite's one LightningModule"
        " (`tests/scenarios/conformance.py`) computes each model's loss in `training_step`, and `pp_dp` needs a"
        " `pipeline_loss` hook and a `forward` that calls the blocks in order instead. So no model above has been checked under"
        " `pp_dp` by this suite. Its parity with one process is tested on the test suite's own GPT and Llama"
        " models (`tests/strategies/test_pipeline.py`: every schedule, pp2, pp2 x dp2, pp2 x dp2 x tp2) and on"
        " the GPT recipe (`recipes/configs/gpt_pp.yaml`)."
    ),
}


def _cell(cell: dict) -> str:
    if cell["status"] != "exact":
        return "**fails**"
    share = f"{cell['share']:.2f}"
    what = cell.get("what", "").split(":")[0]  # "replicated", "sharded", "split" or "not split"
    chosen = f"chose `{cell['chosen'].split(' ')[0]}`; " if "chosen" in cell else ""
    return f"exact, {chosen}{what} ({share})"


def _details(model: dict, strategies: list[str]) -> list[str]:
    lines = [f"### {model['family']}", ""]
    for strategy in strategies:
        cell = model["cells"][strategy]
        lines.append(
            f"- `{strategy}`: **{cell['status']}**" + (f"; {cell['what']}" if cell.get("what") else "")
        )
        if cell.get("chosen"):
            lines.append(f"    - chose {cell['chosen']}")
        if cell.get("share") is not None:
            lines.append(f"    - per-rank parameter share: {cell['share']:.3f}")
        replicated = cell.get("replicated") or []
        if replicated:
            lines.append(
                "    - replicated: " + "; ".join(f"`{r}`" if ":" not in r else r for r in replicated)
            )
        for note in cell.get("notes") or []:
            lines.append(f"    - note: {note}")
        for problem in cell.get("problems") or []:
            lines.append(f"    - problem: {problem}")
    return [*lines, ""]


def render(results: dict) -> str:
    """The page's Markdown for ``results`` (the JSON the conformance suite writes)."""
    strategies = results["strategies"]
    lines = [INTRO.format(world=results["world_size"], tp=results["tensor_parallel_size"]), "## Table", ""]
    absent = [s for s in NOT_IN_SUITE if s not in strategies]
    columns = [f"`{s}`" for s in strategies] + [f"`{s}` (not in the suite, see below)" for s in absent]
    lines.append("| model | " + " | ".join(columns) + " |")
    lines.append("|---|" + "---|" * len(columns))
    for model in results["models"]:
        cells = [_cell(model["cells"][s]) for s in strategies] + ["not run"] * len(absent)
        lines.append(f"| {model['family']} | {' | '.join(cells)} |")
    for s in absent:
        lines += ["", NOT_IN_SUITE[s]]
    lines += ["", "## What is split, what is replicated and why", ""]
    for model in results["models"]:
        lines += _details(model, strategies)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str]) -> int:
    text = render(json.loads(RESULTS.read_text()))
    if "--check" in argv:
        if PAGE.read_text() != text:
            print(f"{PAGE} is stale: run python docs/hooks/supported_models.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
