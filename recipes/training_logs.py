"""What every recipe logs, and the LightningCLI they share.

- :class:`Throughput`: Lightning's ``ThroughputMonitor`` set up for ``(inputs, targets)`` batches
  (samples/s, and tokens/s for language models), configurable from YAML.
- :func:`training_flops`: FLOPs per training batch, for FLOP/s and MFU in the throughput log.
- :class:`ParallelDiagnostics`: what the strategy decided (bucket sizes, blocks wrapped, tensor-parallel
  plan, MoE layers split over expert-parallel ranks, auto_parallel's choice) as hyperparameters, and per
  epoch: the bytes of parameters, gradients and optimizer state this rank holds (measured at the second
  optimizer step; the largest rank), the problems ``PitfallReport`` and ``SetEpochCheck`` found, BatchNorm
  layers synchronized.
- :class:`RecipeCLI`: ``LightningCLI`` that also logs to TensorBoard when it is installed (next to the
  CSV logger of the configs) and overwrites its saved ``config.yaml`` on reruns.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.throughput import measure_flops
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger

import lit_parallel as lp  # noqa: F401  (registers ddp_tuned, fsdp_blocks, hsdp, tp_dp, auto_parallel)
from lit_parallel.parallel import training_state_bytes


def _batch_size(batch: Any) -> int:
    return batch[0].size(0)


def _tokens(batch: Any) -> int:
    return batch[0].numel()


class Throughput(ThroughputMonitor):
    """Samples per second (and tokens per second with ``tokens=True``) per device and in total.

    Args:
        tokens: the first element of a batch is a ``(batch, sequence)`` tensor of tokens.
        window_size: batches the rates are averaged over (first reported after this many).
    """

    def __init__(self, tokens: bool = False, window_size: int = 10) -> None:
        super().__init__(
            batch_size_fn=_batch_size, length_fn=_tokens if tokens else None, window_size=window_size
        )


def training_flops(build_model: Callable[[], torch.nn.Module], inputs: torch.Tensor) -> int:
    """FLOPs of one training step (forward + backward) on ``inputs``, counted on a copy of the model built
    on the meta device (no memory, no communication). Set it as ``flops_per_batch`` on the
    LightningModule and the throughput log adds FLOP/s (and MFU on GPUs Lightning knows)."""
    with torch.device("meta"):
        model = build_model()
    x = torch.empty(inputs.shape, dtype=inputs.dtype, device="meta")
    return measure_flops(model, lambda: model(x), lambda y: y.float().sum())


class ParallelDiagnostics(L.Callback):
    """Logs the strategy's decisions and the diagnostics of lit_parallel's callbacks."""

    def __init__(self) -> None:
        self._state_bytes: float | None = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        info: dict[str, Any] = {"strategy": type(strategy).__name__, "world_size": trainer.world_size}
        advice = getattr(strategy, "advice", None)
        if advice is not None:
            info["auto_parallel"] = f"{advice.choice} (rule {advice.rule.number})"
        plan = getattr(strategy, "plan", None)  # fsdp_blocks / hsdp / tp_dp
        if plan is not None:
            info["blocks_wrapped"] = plan.blocks.describe()
            info["mesh"] = plan.dims.describe()
        tp_plan = getattr(strategy, "tp_plan", None)
        if tp_plan is not None:
            info["tensor_parallel"] = (
                f"{len(tp_plan.split)} layers split, {len(tp_plan.replicated)} replicated"
            )
        expert_plan = getattr(strategy, "expert_plan", None)  # expert_parallel_size > 1
        if expert_plan is not None:
            info["expert_parallel"] = expert_plan.summary()
        for logger in trainer.loggers:
            logger.log_hyperparams({f"parallel/{k}": v for k, v in info.items()})

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        bucket_plan = getattr(trainer.strategy, "bucket_plan", None)  # ddp_tuned, known after its first step
        if trainer.global_step == 1 and bucket_plan is not None:
            for logger in trainer.loggers:
                logger.log_hyperparams(
                    {
                        "parallel/bucket_cap_mb": str(bucket_plan.cap_mb_list),
                        "parallel/bucket_reason": bucket_plan.reason,
                        "parallel/find_unused_parameters": bool(trainer.strategy.unused_parameters),
                    }
                )

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any
    ) -> None:
        # Gradients exist only between backward and the optimizer's zero_grad, and the optimizer state
        # from the first step on: the second step shows everything training holds.
        if trainer.global_step <= 1:
            self._state_bytes = float(training_state_bytes(pl_module, optimizer)["total"])

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        values = {}
        if self._state_bytes is not None:
            values["diagnostics/state_bytes_per_rank"] = self._state_bytes
        for cb in trainer.callbacks:
            if isinstance(cb, lp.PitfallReport):
                values["diagnostics/pitfall_problems"] = float(
                    sum(f.status == "problem" for f in cb.findings)
                )
            elif isinstance(cb, lp.SetEpochCheck):
                values["diagnostics/set_epoch_findings"] = float(len(cb.findings))
            elif isinstance(cb, lp.SyncBatchNormConversion):
                values["diagnostics/sync_batchnorm_layers"] = float(cb.converted)
        # the largest value over the ranks (every rank calls this, as sync_dist needs)
        pl_module.log_dict(values, sync_dist=True, reduce_fx="max")


class RecipeCLI(LightningCLI):
    """LightningCLI with the recipes' defaults: TensorBoard next to CSV when installed, config overwritten."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        super().__init__(*args, **kwargs)

    def instantiate_trainer(self, **kwargs: Any) -> L.Trainer:
        trainer = super().instantiate_trainer(**kwargs)
        csv = next((lg for lg in trainer.loggers if isinstance(lg, CSVLogger)), None)
        has_tensorboard = importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX")
        if csv is not None and has_tensorboard:
            from lightning.pytorch.loggers import TensorBoardLogger

            tensorboard = TensorBoardLogger(save_dir=csv.save_dir, name=csv.name, version=csv.version)
            trainer.loggers = [*trainer.loggers, tensorboard]
        return trainer
