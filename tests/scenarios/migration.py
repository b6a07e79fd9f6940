"""Helpers and a scenario for the migration guide (docs/how-to/migrate-from-lightning.md,
tests/test_migration.py).

The guide's scripts run as ``python script.py`` (tests.harness.run_script); what the tests add to them comes
through the environment, so the scripts run unchanged:

- :func:`write_fsdp1_on_cpu_site`: a ``sitecustomize`` that lets Lightning's ``FSDPStrategy``, which runs
  only on CUDA devices, run on CPU processes (:func:`lightning_fsdp1_on_cpu`), in every rank.
- :func:`write_probe_plugin`: an entry point in Lightning's external-callback group
  (``lightning.pytorch.callbacks_factory``) that adds :class:`ResumeProbe`, which records what a resumed run
  starts from.

:func:`sharded_fsdp1_then_fsdp_blocks` (one torchrun launch): the guide's model trained by Lightning's
``FSDPStrategy`` with ``state_dict_type="sharded"``, then resumed from that folder by ``fsdp_blocks``.
"""

from __future__ import annotations

import os
import runpy
from functools import partial
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning_utilities.core.apply_func import apply_to_collection

PROBE_ENV = "LP_MIGRATION_PROBE"  # where ResumeProbe writes (rank 0); unset: no probe
PROBE_ENTRY_POINT = "tests.scenarios.migration:resume_probe"


class ResumeProbe(Callback):
    """What a run resumed from a checkpoint starts from: the global step, the full weights and the full
    optimizer state right after Lightning restored the checkpoint (``on_train_start``); and the step it ended
    at. Rank 0 writes them to ``path`` when training ends (``torch.save``, plain tensors)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.record: dict[str, Any] = {}

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        # collectives: every rank gathers, rank 0 keeps the full tensors. Copies: a tensor that is not sharded
        # (the optimizer's step count) comes back as the optimizer's own, which later steps change in place.
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model = trainer.strategy.model
        copy = partial(apply_to_collection, dtype=torch.Tensor, function=torch.Tensor.clone)
        self.record = {
            "start_step": trainer.global_step,
            "state_dict": copy(get_model_state_dict(model, options=options)),
            "optimizer": copy(get_optimizer_state_dict(model, trainer.optimizers[0], options=options)),
            "strategy": type(trainer.strategy).__name__,
        }

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.is_global_zero:
            torch.save({**self.record, "end_step": trainer.global_step}, self.path)


def resume_probe() -> list[Callback]:
    """Lightning's external-callback factory (entry point group ``lightning.pytorch.callbacks_factory``)."""
    path = os.environ.get(PROBE_ENV)
    return [ResumeProbe(path)] if path else []


def write_probe_plugin(folder: Path) -> Path:
    """A distribution (a ``.dist-info`` folder in ``folder``) whose entry point adds :class:`ResumeProbe` to
    every Trainer of a process that has ``folder`` on its ``PYTHONPATH`` and :data:`PROBE_ENV` set. Returns
    ``folder``."""
    info = folder / "lit_parallel_migration_probe-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lit-parallel-migration-probe\nVersion: 0\n")
    (info / "entry_points.txt").write_text(
        f"[lightning.pytorch.callbacks_factory]\nprobe = {PROBE_ENTRY_POINT}\n"
    )
    return folder


def lightning_fsdp1_on_cpu() -> None:
    """Let Lightning's ``FSDPStrategy`` (torch's FSDP1) run on CPU processes, in this process.

    Three things stop it on CPU, none of them about sharding: Lightning refuses ``FSDPStrategy`` with any
    accelerator but CUDA (its check compares the strategy's exact class); it passes FSDP1
    ``device_id=root_device.index``, ``None`` on CPU, where FSDP1 then refuses to run without an accelerator;
    and it gathers full state dicts with ``offload_to_cpu=True``, which crashes when the parameters already
    are in CPU memory. ``lightning.pytorch.strategies.FSDPStrategy`` becomes a subclass (a script importing it
    from there gets it) whose FSDP1 wrappers get ``device_id=cpu``, and full state dicts are gathered without
    offloading. Everything else is Lightning's and torch's own code.
    """
    import lightning.pytorch.strategies as strategies
    import torch.distributed.fsdp as torch_fsdp
    from lightning.pytorch.strategies import fsdp as lightning_fsdp
    from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel, StateDictType
    from torch.distributed.fsdp.api import FullOptimStateDictConfig

    if getattr(strategies.FSDPStrategy, "_on_cpu", False):
        return

    class FSDP1OnCPU(FullyShardedDataParallel):
        def __init__(self, module: torch.nn.Module, *args: Any, device_id: Any = None, **kwargs: Any) -> None:
            super().__init__(
                module, *args, device_id=torch.device("cpu") if device_id is None else device_id, **kwargs
            )

    class FSDPStrategy(lightning_fsdp.FSDPStrategy):
        _on_cpu = True

        def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
            # Lightning imports FullyShardedDataParallel from torch.distributed.fsdp when it wraps
            torch_fsdp.FullyShardedDataParallel = FSDP1OnCPU
            try:
                return super()._setup_model(model)
            finally:
                torch_fsdp.FullyShardedDataParallel = FullyShardedDataParallel

    def full_state_dict_context(module: torch.nn.Module, world_size: int, rank0_only: bool = True) -> Any:
        return FullyShardedDataParallel.state_dict_type(
            module=module,
            state_dict_type=StateDictType.FULL_STATE_DICT,
            state_dict_config=FullStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only),
            optim_state_dict_config=FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only),
        )

    strategies.FSDPStrategy = FSDPStrategy
    lightning_fsdp._get_full_state_dict_context = full_state_dict_context


def write_fsdp1_on_cpu_site(folder: Path) -> Path:
    """A ``sitecustomize.py`` in ``folder`` that runs :func:`lightning_fsdp1_on_cpu` when a Python process
    with ``folder`` on its ``PYTHONPATH`` starts (every rank Lightning's launcher starts inherits it).
    Returns ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(
        "from tests.scenarios.migration import lightning_fsdp1_on_cpu\n\nlightning_fsdp1_on_cpu()\n"
    )
    return folder


def sharded_fsdp1_then_fsdp_blocks(ctx: Any) -> dict:
    """The guide's model and data (``args["script"]``, the "before" script) trained for one epoch by
    Lightning's ``FSDPStrategy(auto_wrap_policy={Block}, state_dict_type="sharded")``, saving
    ``checkpoints/fsdp1.ckpt`` (a folder) in ``args["cwd"]``; then ``fsdp_blocks`` resumes from it for a second
    epoch, recorded by :class:`ResumeProbe` in ``args["probe"]``."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lit_parallel import TransformerFSDPStrategy

    lightning_fsdp1_on_cpu()
    from lightning.pytorch.strategies import FSDPStrategy

    guide = runpy.run_path(ctx.args["script"], run_name="migration_guide")  # classes only: not __main__
    os.chdir(ctx.args["cwd"])
    quiet = dict(devices=2, logger=False, enable_progress_bar=False, enable_model_summary=False)

    L.seed_everything(0)
    trainer = L.Trainer(
        strategy=FSDPStrategy(auto_wrap_policy={guide["Block"]}, state_dict_type="sharded"),
        max_epochs=1,
        callbacks=[ModelCheckpoint(dirpath="checkpoints", filename="fsdp1")],
        **quiet,
    )
    trainer.fit(guide["TinyGPT"](), guide["token_data"]())

    L.seed_everything(0)
    trainer = L.Trainer(
        strategy=TransformerFSDPStrategy(block_types={guide["Block"]}),
        max_epochs=2,
        callbacks=[ModelCheckpoint(dirpath="checkpoints", filename="fsdp2"), ResumeProbe(ctx.args["probe"])],
        **quiet,
    )
    trainer.fit(guide["TinyGPT"](), guide["token_data"](), ckpt_path="checkpoints/fsdp1.ckpt")
    return {}
