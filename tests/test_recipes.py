"""The recipes: every config parses, every header shows the three launch commands, and each 2-rank config runs
as written on 2 CPU ranks through its first validation (one torchrun launch runs all five, as their headers
say; tests/scenarios/recipes.py; gpt_pp runs in tests/strategies/test_pipeline.py), logs loss, throughput and
diagnostics, and the sharded GPT checkpoint consolidates into a plain state_dict."""

from __future__ import annotations

import math
import os
import pickle
import re
import subprocess
import sys
from contextlib import redirect_stdout
from io import StringIO
from pathlib import Path

import pytest
import torch
import yaml

from tests.harness import REPO_ROOT, launch
from tests.scenarios.recipes import (
    column,
    config_path,
    header_commands,
    load_config,
    recipe_module,
    run_as_written,
)

CONFIGS = {
    "image_classification": ("image_classification.py", "ddp_tuned"),
    "gpt_fsdp": ("gpt.py", "lit_parallel.TransformerFSDPStrategy"),
    "gpt_hsdp": ("gpt.py", "lit_parallel.HybridShardStrategy"),
    "llama_tp": ("llama.py", "lit_parallel.TensorParallelStrategy"),
    "moe_ep": ("moe.py", "lit_parallel.TransformerFSDPStrategy"),
}


# --- runs inside the ranks (tests/harness.py scenario) -----------------------------------------------------


def train_every_recipe(ctx) -> dict:
    """Runs the header's single-machine command of every 2-rank config as written, one after the other
    (tests/scenarios/recipes.py: the step-counting configs end on their first validation)."""
    out = {}
    for config in CONFIGS:
        cli, out[config] = run_as_written(config, 2, Path(ctx.outdir) / config)
        if config == "image_classification":
            out[config]["sync_batchnorm_layers"] = next(
                cb.converted for cb in cli.trainer.callbacks if type(cb).__name__ == "SyncBatchNormConversion"
            )
    return out


# --- tests ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", list(CONFIGS))
def test_config_header_shows_launch_commands_for_one_machine_several_machines_and_slurm(config):
    script, _ = CONFIGS[config]
    commands = header_commands(config)
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
    module = recipe_module(script)
    out = StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        module.main(["fit", "--config", str(config_path(config)), "--print_config"])
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
    module = recipe_module("image_classification.py")
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
    module = recipe_module("text_data.py")
    corpus = module.stdlib_corpus()
    assert len(corpus) > 200_000 and b"def " in corpus
    data = module.ByteTextData(block_size=16, batch_size=2)
    data.setup("fit")
    x, y = data.train[3]
    assert x.shape == (16,) and torch.equal(x[1:], y[:-1]) and int(x.max()) < 256


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One torchrun launch of 2 ranks runs every config as written."""
    res = launch("tests.test_recipes:train_every_recipe", 2, tmp_path_factory.mktemp("recipes"), timeout=900)
    return res.scenario("train_every_recipe")


def _values(rows: list[dict[str, str]], name: str) -> list[float]:
    return [v for _, v in column(rows, name)]


@pytest.mark.multiprocess
@pytest.mark.timeout(1000)
def test_each_recipe_runs_as_written_through_its_validation(trained):
    r0 = trained[0]
    expected = {
        "image_classification": "TunedDDPStrategy",
        "gpt_fsdp": "TransformerFSDPStrategy",
        "gpt_hsdp": "HybridShardStrategy",
        "llama_tp": "TensorParallelStrategy",
        "moe_ep": "TransformerFSDPStrategy",
    }
    for config, strategy in expected.items():
        assert r0[config]["strategy"] == strategy, config
        trainer = load_config(config)["trainer"]
        rows = r0[config]["rows"]
        losses = _values(rows, "train_loss")
        assert losses and all(math.isfinite(v) for v in losses), config
        if "max_steps" in trainer:  # the language models: max_steps = val_check_interval, then one validation
            interval = trainer["val_check_interval"]
            assert r0[config]["global_step"] == interval, config
            assert [step for step, _ in column(rows, "val_loss")] == [interval - 1], config
            assert 0 < r0[config]["num_val_batches"][0] <= trainer["limit_val_batches"], config
            # bytes: log(256) = 5.5 nats at the start; 100 steps learn the common bytes and words
            assert losses[-1] < losses[0] - 1.0, (config, losses)
    # digits: every epoch validates; eight epochs of the ResNet are far above chance (0.1)
    image = r0["image_classification"]
    epochs = load_config("image_classification")["trainer"]["max_epochs"]
    assert image["epochs"] == epochs and len(_values(image["rows"], "val_acc")) == epochs
    assert _values(image["rows"], "val_acc")[-1] > 0.9
    assert image["sync_batchnorm_layers"] == 9  # stem + 2 per block + 2 shortcuts
    # hsdp on one node with shard_size auto shards over the node's 2 ranks: fsdp_blocks' layout, its losses
    fsdp, hsdp = (torch.tensor(_values(r0[c]["rows"], "train_loss")) for c in ("gpt_fsdp", "gpt_hsdp"))
    assert torch.allclose(fsdp, hsdp, rtol=1e-5, atol=0), (fsdp, hsdp)


@pytest.mark.multiprocess
@pytest.mark.timeout(1000)
def test_recipes_log_loss_throughput_and_diagnostics(trained):
    r0 = trained[0]
    for config in CONFIGS:
        rows = r0[config]["rows"]
        assert _values(rows, "train_loss"), config
        assert _values(rows, "train/samples"), config  # Lightning's throughput monitor
        assert _values(rows, "diagnostics/state_bytes_per_rank"), config
        assert _values(rows, "diagnostics/pitfall_problems"), config  # PitfallReport ran (its verdicts vary)
        hparams = yaml.safe_load((Path(r0[config]["log_dir"]) / "hparams.yaml").read_text())
        assert hparams["parallel/world_size"] == 2, config
    image = r0["image_classification"]["rows"]
    assert _values(image, "train/samples_per_sec") and _values(image, "val_acc")
    assert set(_values(image, "diagnostics/set_epoch_findings")) == {0.0}
    # ddp_tuned keeps everything: fp32 parameters + gradients + SGD momentum = 12 bytes per parameter
    assert set(_values(image, "diagnostics/state_bytes_per_rank")) == {
        12.0 * r0["image_classification"]["params"]
    }
    assert _values(r0["gpt_fsdp"]["rows"], "train/lengths")  # tokens
    hparams = yaml.safe_load((Path(r0["gpt_fsdp"]["log_dir"]) / "hparams.yaml").read_text())
    assert hparams["parallel/blocks_wrapped"].startswith(
        f"{load_config('gpt_fsdp')['model']['n_layer']} blocks"
    )
    moe = load_config("moe_ep")
    hparams = yaml.safe_load((Path(r0["moe_ep"]["log_dir"]) / "hparams.yaml").read_text())
    assert hparams["parallel/expert_parallel"] == (
        f"{moe['model']['n_layers']} MoE layers ({moe['model']['num_experts']} experts each) split over"
        f" {moe['trainer']['strategy']['init_args']['expert_parallel_size']} expert-parallel ranks"
    )
    assert _values(r0["moe_ep"]["rows"], "train_load_balance")  # the router's load-balancing loss


@pytest.mark.multiprocess
@pytest.mark.timeout(1000)
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
    gpt = recipe_module("gpt.py")
    config = load_config("gpt_fsdp")
    model = gpt.GPT(
        gpt.GPTConfig(
            n_layer=config["model"]["n_layer"],
            n_head=config["model"]["n_head"],
            n_embd=config["model"]["n_embd"],
            block_size=config["data"]["block_size"],
        )
    )
    model.load_state_dict(state, strict=True)  # every key and shape of the unsharded model
