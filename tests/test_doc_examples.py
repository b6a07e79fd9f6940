"""Every example in README.md and docs/ runs, or says why not (the markers: tests/doc_blocks.py).

- Python: a block is marked a fragment (``<!-- fragment -->``), is a migration-guide script
  (tests/test_migration.py), is README.md's example (tests/test_readme.py), or is a complete program that
  runs here as written: one torchrun launch of 2 ranks runs every 2-rank example in turn
  (tests/scenarios/doc_examples.py), the 4-rank ones run in the shared 4-rank launch (tests/conftest.py),
  and each is checked for what it trains and prints (``CHECKS``).
- Shell: a block is marked ``<!-- not run: REASON -->``, is the migration guide's commands, or each of its
  commands is in ``COMMANDS`` (run here as shown, in a fresh folder) or is a recipe's torchrun command that
  tests/test_recipes.py runs. A command that changes in the docs fails here until ``COMMANDS`` follows.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lit_parallel.commands.lab import EXPERIMENTS
from tests.doc_blocks import MARKERS, PYTHON, SHELL, all_blocks, shell_commands
from tests.harness import REPO_ROOT, launch
from tests.scenarios.doc_examples import RANKS, complete_examples
from tests.scenarios.recipes import recipe_module, single_machine_command
from tests.test_migration import GUIDE, GUIDE_BLOCKS
from tests.test_recipes import CONFIGS as RECIPE_CONFIGS

MIGRATION_GUIDE = str(GUIDE.relative_to(REPO_ROOT))
MARK_FRAGMENT = "put <!-- fragment --> on the line before the fence if it is not a whole program"
MARK_NOT_RUN = (
    "put <!-- not run: REASON --> on the line before the fence (GPUs, a cluster, minutes of training, ...)"
)

# --- the complete Python examples: what each one trains and prints ------------------------------------------

# each check gets the example's results, one dict per rank (tests/scenarios/doc_examples.py: "stdout",
# "warnings", "files", "folder" and its Trainer's "status", "strategy", "global_step", "current_epoch",
# "world_size", "metrics")
CHECKS: dict[str, Callable[[list[dict]], None]] = {}


def check(key: str):
    def register(fn: Callable[[list[dict]], None]) -> Callable[[list[dict]], None]:
        CHECKS[key] = fn
        return fn

    return register


def _trained(runs: list[dict], strategy: str, steps: int) -> None:
    for rank, run in enumerate(runs):
        where = f"{run['where']} (rank {rank})"
        assert run["status"] == "finished" and run["world_size"] == len(runs), where
        assert run["strategy"] == strategy, f"{where}: {run['strategy']}, not {strategy}"
        assert run["global_step"] == steps, f"{where}: {run['global_step']} steps, not {steps}"


def _last_line(run: dict) -> str:
    """What the example printed last (rank 0 prints Lightning's progress bar and summary before it)."""
    return run["stdout"].strip().splitlines()[-1].strip()


@check("docs/tutorials/getting-started.md")
def check_getting_started(runs):
    _trained(runs, "TunedDDPStrategy", steps=2 * 256 // (2 * 16))  # 2 epochs of 256 samples, 2 ranks x 16
    assert all("val_loss" in run["metrics"] for run in runs)


@check("docs/how-to/checkpoints.md")
def check_checkpoints(runs):
    _trained(runs, "TransformerFSDPStrategy", steps=64 // (2 * 8))  # 1 epoch of 64 sequences, 2 ranks x 8
    folder = Path(runs[0]["folder"])
    assert (folder / "checkpoints" / "last.ckpt").is_dir()  # sharded: a folder
    state = torch.load(folder / "tiny_lm.pt", weights_only=True)
    # TinyLM: the embedding, 4 encoder layers of 12 tensors (attention in/out weight and bias, 2 linears and
    # 2 norms with weight and bias), the head's weight and bias
    assert len(state) == 1 + 4 * 12 + 2 and not any(k.startswith("model.") for k in state)
    assert _last_line(runs[0]) == f"{len(state)} tensors in tiny_lm.pt"


@check("docs/how-to/choosing-a-strategy.md")
def check_choosing_a_strategy(runs):
    for run in runs:
        recommendation, state_bytes, *description = run["stdout"].splitlines()
        assert recommendation == "hsdp"
        # bf16-mixed: 2 + 2 + 12 bytes per parameter, sharded over the 8 devices of a node
        assert float(state_bytes) == 7e9 * 16 / 8
        assert any("-> hsdp (rule 3)" in line for line in description), run["stdout"]


def check_dry_run(runs):
    # tp_dp, tensor parallel 4 x FSDP over 128 data-parallel ranks (512 simulated ranks), rank 0, by hand: each
    # parameter's rows after the tensor-parallel split, padded to a multiple of 128, x 16 bytes (fp32 parameter
    # and gradient, AdamW's two fp32 states). Per layer: q (64 of 256 rows) 1 x 256, k and v (32 rows) 1 x 256
    # each, o (row-wise: 256 rows of 64) 2 x 64, gate and up (176 of 704 rows) 2 x 256 each, down (256 rows of
    # 176) 2 x 176, two norms 2 each; the embedding and the head (1000 rows, replicated by tensor parallelism)
    # 8 x 256 each, the final norm 2
    layer = 256 + 2 * 256 + 2 * 64 + 2 * 2 * 256 + 2 * 176 + 2 * 2
    elements = 4 * layer + 2 * 8 * 256 + 2
    for run in runs:
        mesh, figures = run["stdout"].splitlines()[-2:]
        assert (
            mesh == "data_parallel_replicate=1 x data_parallel_shard=128 x tensor_parallel=4 (world size 512)"
        )
        # 4 layers x 7 projections split; the embedding, the head, 8 layer norms and the final norm replicated
        assert figures.split() == ["0", str(16 * elements), "28", "11"], run["stdout"]


@check("docs/reference/strategies/ddp_tuned.md")
def check_ddp_tuned(runs):
    _trained(runs, "TunedDDPStrategy", steps=2 * 192 // (2 * 16))  # 2 epochs of 192 samples, 2 ranks x 16
    assert all("val_loss" in run["metrics"] for run in runs)
    assert all("buckets" in _last_line(run) for run in runs)


@check("docs/reference/strategies/fsdp_blocks.md")
def check_fsdp_blocks(runs):
    _trained(runs, "TransformerFSDPStrategy", steps=4)  # max_steps
    for run in runs:
        assert "TransformerEncoderLayer: 4 x" in _last_line(run), run["stdout"][-2000:]


@check("docs/reference/strategies/expert_parallel.md")
def check_expert_parallel(runs):
    _trained(runs, "TransformerFSDPStrategy", steps=4)
    # each rank routes its own 4 batches of 8 sequences x 16 tokens to top-2 of 4 experts in 2 layers
    pairs = 4 * 8 * 16 * 2 * 2
    for rank, run in enumerate(runs):
        lines = run["stdout"].strip().splitlines()
        assert "data_parallel 2 = expert_data_parallel 1 x expert_parallel 2" in lines, run["stdout"][-2000:]
        assert f"rank {rank} holds 2 of 4 experts" in lines
        assert f"rank {rank} sent {pairs} (token, expert) pairs, dropped 0" in lines
        assert _last_line(run) == "2 MoE layers (4 experts each) split over 2 expert-parallel ranks"


@check("docs/reference/strategies/hsdp.md")
def check_hsdp(runs):
    _trained(runs, "HybridShardStrategy", steps=4)
    assert all("data_parallel_replicate=2, data_parallel_shard=1" in _last_line(run) for run in runs)


@check("docs/reference/strategies/tp_dp.md")
def check_tp_dp(runs):
    _trained(runs, "TensorParallelStrategy", steps=4)
    for run in runs:
        plan = run["stdout"].split("tensor-parallel plan", 1)[1]
        assert "tensor_parallel_size=2" in plan and "colwise" in plan and "rowwise" in plan


@check("docs/reference/strategies/pp_dp.md")
def check_pp_dp(runs):
    assert len(runs) == 4
    _trained(runs, "PipelineParallelStrategy", steps=4)
    assert all("train_loss" in run["metrics"] for run in runs)  # "logs train_loss ... on every rank"


@check("docs/reference/strategies/auto_parallel.md")
def check_auto_parallel(runs):
    _trained(runs, "TunedDDPStrategy", steps=4)  # a tiny model fits: rule 1
    for run in runs:
        assert "ddp_tuned TunedDDPStrategy" in run["stdout"].splitlines(), run["stdout"][-2000:]
        assert "-> ddp_tuned (rule 1)" in run["stdout"]


@check("docs/reference/callbacks/cross_rank_metrics.md")
def check_cross_rank_metrics(runs):
    for run in runs:
        assert run["status"] == "finished" and run["global_step"] == 0  # validate only
        accuracy = run["metrics"]["val_acc"]
        # 15 samples counted once each: a multiple of 1/15, which k/16 (a padding repeat counted) is not
        assert abs(accuracy * 15 - round(accuracy * 15)) < 1e-5, accuracy
        assert f"'val_acc': {accuracy}" in _last_line(run)


@check("docs/reference/callbacks/pitfall_report.md")
def check_pitfall_report(runs):
    _trained(runs, "TunedDDPStrategy", steps=256 // (2 * 16))
    assert "'learning-rate scaling'" in _last_line(runs[0])
    # tuned for 16 samples, run with 2 x 16: SGD's learning rate scales linearly
    expected_lr = 0.1 * (2 * 16) / 16
    warned = [w for w in runs[0]["warnings"] if "PitfallReport: learning-rate scaling" in w]
    assert warned and f"gives {expected_lr:g} " in warned[0], runs[0]["warnings"]


@check("docs/reference/callbacks/set_epoch_check.md")
def check_set_epoch_check(runs):
    # mode="raise": finishing is the check (Lightning's sampler gets set_epoch)
    _trained(runs, "TunedDDPStrategy", steps=2 * 64 // (2 * 8))
    assert all(run["current_epoch"] == 2 for run in runs)


@check("docs/reference/callbacks/sync_batchnorm_conversion.md")
def check_sync_batchnorm_conversion(runs):
    _trained(runs, "TunedDDPStrategy", steps=64 // (2 * 8))
    assert all(_last_line(run) == "1" for run in runs)  # ConvNet has one BatchNorm2d


# --- the shell commands run here: each with what its output must show -------------------------------------


def _recommends(strategy: str) -> Callable[[str, Path], None]:
    def assert_recommends(output: str, folder: Path) -> None:
        assert f"recommendation: {strategy} " in output, output[-3000:]

    return assert_recommends


def _advise_7b_one_node(output: str, folder: Path) -> None:
    _recommends("fsdp_blocks")(output, folder)  # choosing-a-strategy.md's worked example
    assert re.search(r"model state\s+112\.00 GB", output)  # DDP: 7e9 x 16 bytes


def _advise_gpt_json(output: str, folder: Path) -> None:
    advice = json.loads((folder / "gpt.json").read_text())
    gpt = recipe_module("gpt.py").GPTLanguageModel()
    assert advice["params"] == sum(p.numel() for p in gpt.parameters())
    assert advice["recommendation"] and advice["devices"] == 8 and advice["memory_gb"] == 80


def _lab_list(output: str, folder: Path) -> None:
    names = [line.split()[0] for line in output.splitlines() if line.strip()][: len(EXPERIMENTS)]
    assert names == list(EXPERIMENTS), output


COMMANDS: dict[str, Callable[[str, Path], None]] = {
    "lit-parallel advise --params 7B --devices 8 --memory-gb 80": _advise_7b_one_node,
    "lit-parallel advise --params 7e9 --devices 8 --memory-gb 80 --block-params 0.2e9": _advise_7b_one_node,
    "lit-parallel advise --params 70e9 --devices 8 --nodes 4 --memory-gb 80 --block-params 0.8e9": _recommends(
        "pp_dp"
    ),
    "lit-parallel advise --params 7B --devices 8 --nodes 2 --memory-gb 80 --block-params 0.2e9": _recommends(
        "hsdp"
    ),
    "PYTHONPATH=.:recipes lit-parallel advise --model recipes.gpt:GPTLanguageModel --batch-size 8 --devices 8"
    " --memory-gb 80 --busbw-gbps 90 --latency-us 40 --json gpt.json": _advise_gpt_json,
    "lit-parallel lab --list": _lab_list,
    # how-advise-works.md: the tiny Mixtral's experts split by rule 5
    "lit-parallel advise --model tests.moe_models:mixtral --devices 2 --memory-gb 0.00025 --precision 32-true"
    " --device-type cpu --batch-size 1 --seq-len 2": _recommends("fsdp_blocks(expert_parallel_size=2)"),
}


def recipe_test_commands() -> set[str]:
    """The recipes' one-machine torchrun commands that tests/test_recipes.py runs (from the configs' headers)."""
    return {
        shlex.join(["torchrun", "--nproc-per-node=2", *single_machine_command(config, 2)])
        for config in RECIPE_CONFIGS
    }


def run_as_shown(command: str, folder: Path) -> str:
    """Runs a docs command in ``folder``: ``lit-parallel`` as this Python's module, leading ``VAR=value``
    assignments into the environment (relative ``PYTHONPATH`` entries are the clone's folders: the docs run
    from its root). Returns the output; a non-zero exit fails with it."""
    words = shlex.split(command)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    while re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        name, _, value = words.pop(0).partition("=")
        if name == "PYTHONPATH":
            value = os.pathsep.join([*(str(REPO_ROOT / entry) for entry in value.split(":")), env[name]])
        env[name] = value
    programs = {"lit-parallel": [sys.executable, "-m", "lit_parallel.commands.cli"]}
    assert words[0] in programs, f"{command!r}: no way to run {words[0]!r} here"
    res = subprocess.run(
        programs[words[0]] + words[1:], cwd=folder, env=env, capture_output=True, text=True, timeout=120
    )
    output = res.stdout + res.stderr
    assert res.returncode == 0, f"{command!r} exited with {res.returncode}:\n{output[-4000:]}"
    return output


# --- every block is run or marked -------------------------------------------------------------------------


def test_every_fenced_block_names_its_language():
    unnamed = [b.where for b in all_blocks() if not b.language]
    assert not unnamed, (
        f"fenced blocks without a language: {unnamed}; write ```text for output, ```bash for commands"
    )


def test_every_marker_is_one_the_tests_know():
    problems = []
    for block in all_blocks():
        if block.marker is None:
            continue
        if block.marker not in MARKERS:
            problems.append(f"{block.where}: <!-- {block.marker} --> is not one of {', '.join(MARKERS)}")
        elif block.marker == "not run" and not block.detail:
            problems.append(f"{block.where}: <!-- not run --> without a reason: <!-- not run: REASON -->")
        elif block.marker == "fragment" and block.language not in PYTHON:
            problems.append(
                f"{block.where}: <!-- fragment --> marks Python only; a command is <!-- not run -->"
            )
        elif block.marker == "migration-example" and (
            block.path != MIGRATION_GUIDE or block.detail not in GUIDE_BLOCKS
        ):
            problems.append(
                f"{block.where}: <!-- migration-example: {block.detail} --> is not one of the blocks"
                f" tests/test_migration.py runs ({', '.join(GUIDE_BLOCKS)} in {MIGRATION_GUIDE})"
            )
    assert not problems, "\n".join(problems)


def test_every_python_block_is_run_by_a_test_or_marked_a_fragment():
    examples = complete_examples()
    problems = []
    for block in all_blocks():
        if block.language not in PYTHON or block.marker is not None:
            continue
        if block.path == "README.md":
            continue  # tests/test_readme.py runs README.md's one example
        key = next(k for k, b in examples.items() if b == block)
        if key not in CHECKS:
            problems.append(
                f"{block.where}: a complete Python example with no check: add @check({key!r}) in"
                f" tests/test_doc_examples.py (what it trains and prints; 2 ranks, or RANKS in"
                f" tests/scenarios/doc_examples.py), or {MARK_FRAGMENT}"
            )
    stale = sorted(set(CHECKS) - set(examples))
    assert not stale, f"CHECKS names examples the docs no longer have (or that are marked now): {stale}"
    assert not problems, "\n".join(problems)


def test_every_shell_command_is_run_by_a_test_or_marked_not_run():
    run_elsewhere = recipe_test_commands()
    shown: set[str] = set()
    problems = []
    for block in all_blocks():
        if block.language not in SHELL or block.marker is not None:
            continue
        for command in shell_commands(block):
            shown.add(command)
            if command not in COMMANDS and command not in run_elsewhere:
                problems.append(
                    f"{block.where}: `{command}` is run by no test: add it to COMMANDS in"
                    f" tests/test_doc_examples.py if it is quick on CPU, or {MARK_NOT_RUN}"
                )
    assert not problems, "\n".join(problems)
    stale = sorted(set(COMMANDS) - shown)
    assert not stale, f"COMMANDS runs commands no unmarked docs block shows (update or remove them): {stale}"


@pytest.mark.timeout(150)
@pytest.mark.parametrize("command", list(COMMANDS))
def test_each_command_runs_as_shown(command, tmp_path):
    COMMANDS[command](run_as_shown(command, tmp_path), tmp_path)


# --- the complete Python examples run as written ----------------------------------------------------------


# the examples of dry runs: each simulates its own process group, so it runs in a plain process (not in the
# launch of the other examples); the value checks what it printed, or nothing more than exiting with 0
DRY_RUN_EXAMPLES = {"docs/how-to/dry-run.md": check_dry_run, "docs/how-to/choosing-a-strategy.md": None}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", list(DRY_RUN_EXAMPLES))
def test_each_dry_run_example_runs_as_written_in_a_plain_process(path, tmp_path):
    blocks = [
        b
        for b in all_blocks()
        if b.path == path and b.language in PYTHON and b.marker == "not run" and "dry run" in b.detail
    ]
    assert len(blocks) == 1, (
        f"{path}: expected one Python dry-run example marked not run, found {len(blocks)}"
    )
    script = tmp_path / "example.py"
    script.write_text(blocks[0].text)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    res = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280
    )
    assert res.returncode == 0, f"{blocks[0].where}:\n{(res.stdout + res.stderr)[-4000:]}"
    check = DRY_RUN_EXAMPLES[path]
    if check is not None:
        check([{"stdout": res.stdout}])


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory) -> dict[str, list[dict]]:
    """One torchrun launch of 2 ranks runs every 2-rank example in turn; its results by example."""
    res = launch(
        "tests.scenarios.doc_examples:two_rank_examples",
        2,
        tmp_path_factory.mktemp("doc_examples"),
        timeout=400,
    )
    per_rank = res.scenario("two_rank_examples")
    return {key: [rank[key] for rank in per_rank] for key in per_rank[0]}


@pytest.mark.multiprocess
@pytest.mark.timeout(500)
@pytest.mark.parametrize("key", [k for k in CHECKS if RANKS.get(k, 2) == 2])
def test_each_two_rank_example_runs_as_written(two_rank_runs, key):
    assert key in two_rank_runs, f"{key}: no complete example there (is it marked now?)"
    CHECKS[key](two_rank_runs[key])


@pytest.mark.multiprocess
@pytest.mark.timeout(1600)
@pytest.mark.parametrize("key", [k for k in CHECKS if RANKS.get(k, 2) == 4])
def test_each_four_rank_example_runs_as_written_in_the_shared_launch(four_ranks, key):
    per_rank = four_ranks.scenario("four_rank_examples")
    assert key in per_rank[0], f"{key}: no complete example there (is it marked now?)"
    CHECKS[key]([rank[key] for rank in per_rank])
