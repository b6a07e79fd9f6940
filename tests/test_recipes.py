"""The recipes: every config parses, every header shows the three launch commands, and each recipe trains
for a few steps on 2 CPU ranks (one torchrun launch runs all four configs, as their headers say), logs
loss, throughput and diagnostics, and the sharded GPT checkpoint consolidates into a plain state_dict."""

from __future__ import annotations

import csv
import importlib
import math
import os
import pickle
import re
import shlex
import subprocess
import sys
from contextlib import redirect_stdout
from io import StringIO
from pathlib import Path

import pytest
import torch
import yaml

from tests.harness import REPO_ROOT, launch

RECIPES = REPO_ROOT / "recipes"
CONFIGS = {
    "image_classification": ("image_classification.py", "ddp_tuned"),
    "gpt_fsdp": ("gpt.py", "lit_parallel.TransformerFSDPStrategy"),
    "gpt_hsdp": ("gpt.py", "lit_parallel.HybridShardStrategy"),
    "llama_tp": ("llama.py", "lit_parallel.TensorParallelStrategy"),
}
# A few steps of a small model; logs go to the scenario's own folder.
QUICK = {
    "image_classification": ["--trainer.max_epochs=1"],
    "gpt_fsdp": [
        "--trainer.max_steps=3",
        "--trainer.val_check_interval=3",
        "--model.n_layer=2",
        "--model.n_embd=64",
    ],
    "gpt_hsdp": [
        "--trainer.max_steps=2",
        "--trainer.val_check_interval=2",
        "--trainer.strategy.init_args.shard_size=1",  # one machine: 2 replicas of 1 shard (the 2-D mesh)
        "--model.n_layer=2",
        "--model.n_embd=64",
    ],
    "llama_tp": [
        "--trainer.max_steps=2",
        "--trainer.val_check_interval=2",
        "--model.n_layers=2",
        "--model.dim=64",
        "--model.hidden_dim=96",
    ],
}
COMMON = [
    "--trainer.limit_val_batches=2",
    "--trainer.log_every_n_steps=1",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
]
LM_DATA = ["--data.block_size=32", "--data.batch_size=4", "--data.max_bytes=200000"]


def _recipe_module(script: str):
    if str(RECIPES) not in sys.path:
        sys.path.insert(0, str(RECIPES))
    return importlib.import_module(Path(script).stem)


def _header_commands(config: str) -> list[list[str]]:
    lines = (RECIPES / "configs" / f"{config}.yaml").read_text().splitlines()
    header = [line[1:].strip() for line in lines if line.startswith("#")]
    return [shlex.split(line) for line in header if line.startswith(("python ", "torchrun ", "srun "))]


def _single_machine_torchrun(config: str) -> list[str]:
    """The arguments after the script of the header's ``torchrun --nproc-per-node=2`` command."""
    for cmd in _header_commands(config):
        if cmd[0] == "torchrun" and "--nproc-per-node=2" in cmd and "--nnodes=2" not in " ".join(cmd):
            script = next(i for i, a in enumerate(cmd) if a.endswith(".py"))
            return cmd[script:]
    raise AssertionError(f"{config}.yaml has no 'torchrun --nproc-per-node=2 ...' command in its header")


# --- runs inside the ranks (tests/harness.py scenario) -----------------------------------------------------


def train_every_recipe(ctx) -> dict:
    """Runs the header's single-machine command of every config, shortened, one after the other."""
    out = {}
    for config, overrides in QUICK.items():
        script, *args = _single_machine_torchrun(config)
        module = _recipe_module(script)
        args = [str(REPO_ROOT / a) if a.startswith("recipes/") else a for a in args]
        folder = Path(ctx.outdir) / config
        folder.mkdir(exist_ok=True)
        os.chdir(folder)  # the configs log to ./runs
        extra = [] if config == "image_classification" else LM_DATA
        sys.argv = [script]  # as the recipe's own command line would be
        cli = module.main(args + overrides + COMMON + extra)
        trainer = cli.trainer
        checkpoints = sorted(str(p) for p in folder.glob("runs/*/version_*/checkpoints/*"))
        out[config] = {
            "strategy": type(trainer.strategy).__name__,
            "global_step": trainer.global_step,
            "train_loss": float(trainer.callback_metrics["train_loss"]),
            "val_acc": float(trainer.callback_metrics.get("val_acc", torch.tensor(float("nan")))),
            "log_dir": str(Path(trainer.log_dir).resolve()),
            "checkpoints": checkpoints,
            "params": sum(p.numel() for p in cli.model.parameters()),
        }
        if config == "image_classification":
            out[config]["sync_batchnorm_layers"] = next(
                cb.converted for cb in trainer.callbacks if type(cb).__name__ == "SyncBatchNormConversion"
            )
    os.chdir(REPO_ROOT)
    return out


# --- tests ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", list(CONFIGS))
def test_config_header_shows_launch_commands_for_one_machine_several_machines_and_slurm(config):
    script, _ = CONFIGS[config]
    commands = _header_commands(config)
    kinds = {
        "one machine, torchrun": [c for c in commands if c[0] == "torchrun" and "--nnodes=2" not in c],
        "several machines, torchrun": [c for c in commands if c[0] == "torchrun" and "--nnodes=2" in c],
        "SLURM": [c for c in commands if c[0] == "srun"],
    }
    for kind, found in kinds.items():
        assert found, f"{config}.yaml: no {kind} command in the header"
    for cmd in commands:
        assert f"recipes/{script}" in cmd and f"recipes/configs/{config}.yaml" in cmd, cmd
        assert (REPO_ROOT / f"recipes/{script}").is_file()
        if "--nnodes=2" in cmd or cmd[0] == "srun":
            # every rank must know the cluster's shape
            assert "--trainer.num_nodes=2" in cmd, cmd
            assert any(a.startswith("--node-rank") for a in cmd) or cmd[0] == "srun", cmd


@pytest.mark.parametrize("config", list(CONFIGS))
def test_config_parses_with_its_recipe(config, monkeypatch):
    script, strategy = CONFIGS[config]
    monkeypatch.setattr(sys, "argv", [script])
    module = _recipe_module(script)
    out = StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        module.main(["fit", "--config", str(RECIPES / "configs" / f"{config}.yaml"), "--print_config"])
    assert exit_info.value.code in (0, None)
    parsed = yaml.safe_load(out.getvalue())
    got = parsed["trainer"]["strategy"]
    assert (got if isinstance(got, str) else got["class_path"]) == strategy
    assert parsed["trainer"]["devices"] == 2 and parsed["trainer"]["accelerator"] == "cpu"


def test_cifar10_folder_in_the_python_format_is_read_with_three_channels(tmp_path):
    rng = torch.Generator().manual_seed(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = torch.randint(0, 256, (4, 3 * 32 * 32), generator=rng, dtype=torch.uint8).numpy()
        with open(tmp_path / name, "wb") as f:
            pickle.dump({"data": data, "labels": [0, 1, 2, 9]}, f)
    module = _recipe_module("image_classification.py")
    data = module.ImageData(cifar10_dir=str(tmp_path), batch_size=2)
    data.setup("fit")
    assert (data.num_channels, data.num_classes) == (3, 10)
    images, labels = data.train.tensors
    assert images.shape == (20, 3, 32, 32) and labels.tolist()[:4] == [0, 1, 2, 9]
    assert len(data.val) == 4
    assert images.mean(dim=(0, 2, 3)).abs().max() < 1e-5  # normalized per channel
    with pytest.raises(FileNotFoundError, match="lacks data_batch_1"):
        module.ImageData(cifar10_dir=str(tmp_path / "missing")).setup("fit")


def test_text_data_defaults_to_the_standard_library_source():
    module = _recipe_module("text_data.py")
    corpus = module.stdlib_corpus()
    assert len(corpus) > 200_000 and b"def " in corpus
    data = module.ByteTextData(block_size=16, batch_size=2)
    data.setup("fit")
    x, y = data.train[3]
    assert x.shape == (16,) and torch.equal(x[1:], y[:-1]) and int(x.max()) < 256


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One torchrun launch of 2 ranks trains every config."""
    res = launch("tests.test_recipes:train_every_recipe", 2, tmp_path_factory.mktemp("recipes"), timeout=420)
    return res.scenario("train_every_recipe")


def _metrics(log_dir: str) -> list[dict[str, str]]:
    with open(Path(log_dir) / "metrics.csv") as f:
        return list(csv.DictReader(f))


def _column(rows: list[dict[str, str]], name: str) -> list[float]:
    return [float(r[name]) for r in rows if r.get(name)]


@pytest.mark.multiprocess
@pytest.mark.timeout(480)
def test_each_recipe_trains_on_two_ranks_with_its_strategy(trained):
    r0 = trained[0]
    expected = {
        "image_classification": "TunedDDPStrategy",
        "gpt_fsdp": "TransformerFSDPStrategy",
        "gpt_hsdp": "HybridShardStrategy",
        "llama_tp": "TensorParallelStrategy",
    }
    for config, strategy in expected.items():
        assert r0[config]["strategy"] == strategy, config
        assert math.isfinite(r0[config]["train_loss"]), config
    assert r0["gpt_fsdp"]["global_step"] == 3 and r0["llama_tp"]["global_step"] == 2
    # digits: one epoch of the ResNet is far above chance (0.1)
    assert r0["image_classification"]["val_acc"] > 0.5
    assert r0["image_classification"]["sync_batchnorm_layers"] == 9  # stem + 2 per block + 2 shortcuts


@pytest.mark.multiprocess
@pytest.mark.timeout(480)
def test_recipes_log_loss_throughput_and_diagnostics(trained):
    r0 = trained[0]
    for config in QUICK:
        rows = _metrics(r0[config]["log_dir"])
        assert _column(rows, "train_loss"), config
        assert _column(rows, "train/samples"), config  # Lightning's throughput monitor
        assert _column(rows, "diagnostics/state_bytes_per_rank"), config
        assert _column(rows, "diagnostics/pitfall_problems"), config  # PitfallReport ran (its verdicts vary)
        hparams = yaml.safe_load((Path(r0[config]["log_dir"]) / "hparams.yaml").read_text())
        assert hparams["parallel/world_size"] == 2, config
    image = _metrics(r0["image_classification"]["log_dir"])
    assert _column(image, "train/samples_per_sec") and _column(image, "val_acc")
    assert _column(image, "diagnostics/set_epoch_findings") == [0.0]
    # ddp_tuned keeps everything: fp32 parameters + gradients + SGD momentum = 12 bytes per parameter
    assert _column(image, "diagnostics/state_bytes_per_rank") == [12.0 * r0["image_classification"]["params"]]
    assert _column(_metrics(r0["gpt_fsdp"]["log_dir"]), "train/lengths")  # tokens
    hparams = yaml.safe_load((Path(r0["gpt_fsdp"]["log_dir"]) / "hparams.yaml").read_text())
    assert hparams["parallel/blocks_wrapped"].startswith("2 blocks")


@pytest.mark.multiprocess
@pytest.mark.timeout(480)
def test_sharded_gpt_checkpoint_consolidates_into_a_plain_state_dict(trained, tmp_path):
    (checkpoint,) = trained[0]["gpt_fsdp"]["checkpoints"]
    output = tmp_path / "gpt.pt"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "lit_parallel.commands.cli",
            "consolidate",
            checkpoint,
            str(output),
            "--strip-prefix",
            "model.",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert re.search(r"wrote .*gpt\.pt: \d+ tensors", res.stdout)
    state = torch.load(output, weights_only=True)
    gpt = _recipe_module("gpt.py")
    model = gpt.GPT(gpt.GPTConfig(n_layer=2, n_embd=64, block_size=32))
    model.load_state_dict(state, strict=True)  # every key and shape of the unsharded model
