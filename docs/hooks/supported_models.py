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


# Mixture-of-experts models under expert parallelism (``expert_parallel_size``): not part of the conformance
# suite (its models have no experts); tests/parallel/expert_parallel/test_expert_parallel.py runs them against
# one plain process. Keys: the test models' names (tests/moe_models.py MODELS); a cell: exact, or not run.
EXPERT_PARALLEL_COLUMNS = [
    "`fsdp_blocks`, 2 ranks: ep 2",
    "`fsdp_blocks`, 4 ranks: ep 2 (x 2 expert-data-parallel)",
    "`fsdp_blocks`, 4 ranks: ep 4",
    "`tp_dp`, dp 2 x tp 2: ep 2",
    "`pp_dp`, pp 2 x dp 2: ep 2",
]
EXPERT_PARALLEL_MODELS = {
    "mixtral": (
        "HF Mixtral (`MixtralForCausalLM`: stacked `MixtralExperts`, top-2, load-balancing loss)",
        ["exact (1/2)", "exact (1/4)", "exact (1/4)", "exact (1/2)", "not run"],
    ),
    "qwen2_moe": (
        "HF Qwen2-MoE (`Qwen2MoeForCausalLM`: stacked experts and a shared expert)",
        ["exact (1/2)", "exact (1/4)", "exact (1/4)", "exact (1/2)", "not run"],
    ),
    "olmoe": (
        "HF OLMoE (`OlmoeForCausalLM`: stacked experts, q/k norms over all heads)",
        ["exact (1/2)", "exact (1/4)", "exact (1/4)", "not run (see below)", "not run"],
    ),
    "hand": (
        "hand-written MoE (a router and an `nn.ModuleList` of SwiGLU experts, its own load-balancing loss)",
        ["exact (1/2)", "exact (1/4)", "exact (1/4)", "exact (1/2)", "exact"],
    ),
}
EXPERT_PARALLEL = """\
## Mixture-of-experts models under expert parallelism

Trained with `expert_parallel_size` ([Expert parallelism](strategies/expert_parallel.md)) by
`tests/parallel/expert_parallel/test_expert_parallel.py` (models in `tests/moe_models.py`) on 2 and 4 CPU
ranks (gloo), against one plain PyTorch process on the same global batches: fp32, 3 optimizer steps of 2
accumulated micro-batches with gradient clipping, every micro-batch loss and every parameter after
training within 1e-5 relative error. The number in brackets is the share of every expert weight one rank
holds; the test checks that the ranks' pieces add up to each weight exactly once (under `tp_dp` once per
tensor-parallel rank: the experts are not tensor-parallel). The `pp_dp` run cuts the hand-written model
into 2 stages; the transformers models are not run under `pp_dp`. With `activation_checkpointing=True`
(`fsdp_blocks`, 2 ranks, ep 2) Mixtral and the hand-written MoE are exact too.

| MoE model | {columns} |
|---|{rules}
{rows}

OLMoE is not run under `tp_dp`: it normalises q and k over all heads together (`q_norm` and `k_norm` of
the full width), which `tp_dp`'s plan cannot split, with or without experts. Other transformers 5 families
store their experts the same way (stacked `*Experts` modules called with the routing) and are found by
`find_moe_layers`, e.g. Qwen3-MoE, DeepSeek-V2 and Granite-MoE; they are not in these tests.
"""


def _expert_parallel_section() -> list[str]:
    rows = "\n".join(f"| {label} | {' | '.join(cells)} |" for label, cells in EXPERT_PARALLEL_MODELS.values())
    text = EXPERT_PARALLEL.format(
        columns=" | ".join(EXPERT_PARALLEL_COLUMNS), rules="---|" * len(EXPERT_PARALLEL_COLUMNS), rows=rows
    )
    return ["", *text.rstrip("\n").split("\n")]


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
    lines += _expert_parallel_section()
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
