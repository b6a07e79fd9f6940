"""The recipes run as written, inside launched ranks: a config's own single-machine torchrun command from its
header, shortened only by ``max_steps`` (set to the config's ``val_check_interval``, so the run ends on its
first validation, with the config's ``limit_val_batches``); configs that count epochs run whole. Display
flags (progress bar, model summary) are the only other change. Used by tests/test_recipes.py (the 2-rank
configs) and tests/scenarios/pipeline.py (gpt_pp on 4 ranks); their models, built on the meta device
(:func:`recipe_model`), by tests/strategies/test_auto_at_scale.py."""

from __future__ import annotations

import csv
import importlib
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import torch
import yaml

from tests.harness import REPO_ROOT

RECIPES = REPO_ROOT / "recipes"
DISPLAY = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]


def config_path(config: str) -> Path:
    return RECIPES / "configs" / f"{config}.yaml"


def load_config(config: str) -> dict:
    """The config's YAML, as the recipe's LightningCLI reads it."""
    return yaml.safe_load(config_path(config).read_text())


def header_commands(config: str) -> list[list[str]]:
    lines = config_path(config).read_text().splitlines()
    header = [line[1:].strip() for line in lines if line.startswith("#")]
    return [shlex.split(line) for line in header if line.startswith(("python ", "torchrun ", "srun "))]


def single_machine_command(config: str, nproc: int) -> list[str]:
    """The arguments from the script on of the header's ``torchrun --nproc-per-node=<nproc>`` command."""
    for cmd in header_commands(config):
        if (
            cmd[0] == "torchrun"
            and f"--nproc-per-node={nproc}" in cmd
            and not any("--nnodes" in a for a in cmd)
        ):
            return cmd[next(i for i, a in enumerate(cmd) if a.endswith(".py")) :]
    raise AssertionError(
        f"{config}.yaml has no 'torchrun --nproc-per-node={nproc} ...' command in its header"
    )


def shortening(config: str) -> list[str]:
    """``max_steps`` = the config's ``val_check_interval`` when it counts steps; nothing when it counts epochs."""
    trainer = load_config(config)["trainer"]
    interval = trainer.get("val_check_interval")
    if isinstance(interval, int) and trainer.get("max_steps", -1) > interval:
        return [f"--trainer.max_steps={interval}"]
    return []


def recipe_module(script: str):
    if str(RECIPES) not in sys.path:
        sys.path.insert(0, str(RECIPES))
    return importlib.import_module(Path(script).stem)


def recipe_model(config: str, cls: str) -> Any:
    """The LightningModule ``cls`` of ``config``'s recipe (the script its header runs), built with the config's
    ``model`` section on the meta device: the recipe's model at its default size, no memory used."""
    script = next(a for a in header_commands(config)[0] if a.endswith(".py"))
    module = getattr(recipe_module(script), cls)
    with torch.device("meta"):
        return module(**load_config(config)["model"])


def run_as_written(config: str, nproc: int, folder: Path):
    """Runs ``config`` in ``folder`` (its logs go to ./runs there); returns the recipe's LightningCLI and a
    picklable summary of the run for the tests."""
    script, *args = single_machine_command(config, nproc)
    module = recipe_module(script)
    args = [str(REPO_ROOT / a) if a.startswith("recipes/") else a for a in args]
    folder.mkdir(parents=True, exist_ok=True)
    os.chdir(folder)
    sys.argv = [script]  # as the recipe's own command line would be
    try:
        cli = module.main(args + shortening(config) + DISPLAY)
        trainer = cli.trainer
        log_dir = Path(trainer.log_dir).resolve()  # relative to the folder the config logs in
    finally:
        os.chdir(REPO_ROOT)
    rows = []
    if trainer.global_rank == 0:  # the CSV logger writes on rank 0 only
        with open(log_dir / "metrics.csv") as f:
            rows = list(csv.DictReader(f))
    return cli, {
        "config": config,
        "strategy": type(trainer.strategy).__name__,
        "global_step": trainer.global_step,
        "epochs": trainer.current_epoch,
        "num_val_batches": list(trainer.num_val_batches),
        "rows": rows,
        "log_dir": str(log_dir),
        "checkpoints": sorted(str(p) for p in folder.glob("runs/*/version_*/checkpoints/*")),
        "params": sum(p.numel() for p in cli.model.parameters()),
    }


def column(rows: list[dict[str, str]], name: str) -> list[tuple[int, float]]:
    """(step, value) of every row of ``metrics.csv`` that logged ``name``."""
    return [(int(r["step"]), float(r[name])) for r in rows if r.get(name)]
