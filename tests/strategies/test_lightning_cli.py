"""Code written for Lightning's strategies keeps working with ours: LightningCLI builds every
strategy from ``class_path`` / ``init_args`` and from its registry name, and a sharded save into a folder
that is not a checkpoint is refused with the fix, leaving the folder as it was."""

from __future__ import annotations

import json
import os

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel
from torch.utils.data import DataLoader, TensorDataset

import lit_parallel as lp
from lit_parallel.checkpoint.write import ForeignDestinationError
from tests.models import Llama

# (class, init_args that differ from the defaults, where the strategy keeps each of them)
CLI_CASES = [
    ("TunedDDPStrategy", {"bucket_cap_mb": 4, "find_unused_parameters": True}, {"_bucket_cap_mb": 4}),
    ("TransformerFSDPStrategy", {"activation_checkpointing": True}, {"_activation_checkpointing": True}),
    ("HybridShardStrategy", {"shard_size": 1, "reshard_after_forward": False}, {"_shard_size": 1}),
    (
        "TensorParallelStrategy",
        {"tensor_parallel_size": 1, "sequence_parallel": True},
        {"_tp_size": 1, "_sequence_parallel": True},
    ),
    (
        "AutoStrategy",
        {"memory_gb": 2.5, "strategy_kwargs": {"fsdp_blocks": {"activation_checkpointing": True}}},
        {"_memory_gb": 2.5},
    ),
]


@pytest.fixture(autouse=True, scope="module")
def _leave_this_process_as_found():
    """The in-process fits below create a process group (kept until the process exits, by design) and
    Lightning sets MASTER_PORT, LOCAL_RANK, PL_GLOBAL_SEED, ... in os.environ: later tests must not inherit
    either."""
    environ, existed = dict(os.environ), dist.is_initialized()
    yield
    if dist.is_initialized() and not existed:
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)


def _cli(strategy: str, tmp_path) -> LightningCLI:
    args = ["--trainer.accelerator=cpu", "--trainer.devices=1", f"--trainer.default_root_dir={tmp_path}"]
    return LightningCLI(
        BoringModel, BoringDataModule, run=False, args=[*args, "--trainer.strategy", strategy]
    )


@pytest.mark.parametrize(("cls", "init_args", "kept"), CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_lightning_cli_builds_every_strategy_from_class_path(cls, init_args, kept, tmp_path):
    spec = json.dumps({"class_path": f"lit_parallel.{cls}", "init_args": init_args})
    strategy = _cli(spec, tmp_path).trainer.strategy
    assert type(strategy) is getattr(lp, cls)
    for attribute, value in kept.items():
        assert getattr(strategy, attribute) == value, attribute


def test_lightning_cli_builds_every_strategy_from_a_yaml_config(tmp_path):
    for cls, init_args, kept in CLI_CASES:
        config = tmp_path / f"{cls}.yaml"
        config.write_text(
            json.dumps(
                {"trainer": {"strategy": {"class_path": f"lit_parallel.{cls}", "init_args": init_args}}}
            )
        )
        args = ["--config", str(config), "--trainer.accelerator=cpu", "--trainer.devices=1"]
        cli = LightningCLI(BoringModel, BoringDataModule, run=False, args=args)
        assert type(cli.trainer.strategy) is getattr(lp, cls)
        for attribute, value in kept.items():
            assert getattr(cli.trainer.strategy, attribute) == value, (cls, attribute)


@pytest.mark.parametrize("name", ["ddp_tuned", "fsdp_blocks", "hsdp", "tp_dp", "auto_parallel"])
def test_lightning_cli_builds_every_registry_name(name, tmp_path):
    from lightning.pytorch.strategies import StrategyRegistry

    strategy = _cli(name, tmp_path).trainer.strategy
    assert type(strategy) is StrategyRegistry[name]["strategy"]


class _TinyLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = Llama()

    def training_step(self, batch, batch_idx):
        return self.model(batch[0][:, :-1]).float().pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_sharded_save_into_a_folder_that_is_not_a_checkpoint_is_refused_and_leaves_it_whole(tmp_path):
    # Lightning's ModelParallelStrategy writes its shards among the folder's files; ours never mixes a
    # checkpoint into what it did not write (docs/explanations/compatibility.md): the error says what to do.
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "notes.txt").write_text("the user's own file")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=lp.TransformerFSDPStrategy(),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = TensorDataset(torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0)))
    trainer.fit(_TinyLM(), DataLoader(data, batch_size=2))
    with pytest.raises(ForeignDestinationError) as info:
        trainer.save_checkpoint(folder)
    # the classes Lightning's own code and tests catch for a folder in the way
    assert isinstance(info.value, IsADirectoryError) and isinstance(info.value, FileExistsError)
    message = str(info.value)
    assert repr(str(folder)) in message and "notes.txt" in message and "not a checkpoint" in message
    assert "Choose a new path, or move that folder away yourself" in message
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]
    assert (folder / "notes.txt").read_text() == "the user's own file"
    # a new path inside it works
    trainer.save_checkpoint(folder / "checkpoint")
    assert {".metadata", "meta.pt"} <= {p.name for p in (folder / "checkpoint").iterdir()}


class _ManualNet(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = torch.nn.Linear(4, 2)
        self.seen: list = []

    def on_train_start(self) -> None:
        ddp = self.trainer.model
        self.seen.append((type(ddp).__name__, getattr(ddp, "find_unused_parameters", None)))

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(self.net(batch[0]).pow(2).mean())
        opt.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.timeout(120)
def test_manual_optimization_under_auto_runs_ddp_without_unused_parameter_detection():
    # no probe step under manual optimization: DDP from the start, with find_unused_parameters=False
    model = _ManualNet()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=lp.TunedDDPStrategy(),
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2))
    assert model.seen == [("DistributedDataParallel", False)]
