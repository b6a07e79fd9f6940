"""SyncBatchNormConversion: synchronized BatchNorm on every backend, converted before the model is wrapped."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Callback
from lightning.pytorch.utilities.data import extract_batch_size

from lit_parallel._compat import BatchNormBase as _BatchNorm
from lit_parallel._compat import disable_layer_sync
from lit_parallel._logging import info
from lit_parallel.callbacks.data_parallel import (
    DataParallelGroup,
    all_reduce,
    all_reduce_max_min,
    check_mode,
    data_parallel_group,
    report,
)
from lit_parallel.callbacks.patching import patch_attribute
from lit_parallel.nn.sync_batchnorm import SyncBatchNorm, batchnorm_layers


class SyncBatchNormConversion(Callback):
    """Converts every BatchNorm layer to synchronized BatchNorm over the data-parallel group.

    The conversion runs in ``setup`` and again right after the module's ``configure_model`` (for layers
    created there), so it happens before the strategy wraps the model. On CUDA with NCCL the layers
    become ``torch.nn.SyncBatchNorm``; on every other backend (CPU/gloo included, where Lightning's
    ``Trainer(sync_batchnorm=True)`` fails) :class:`lit_parallel.nn.SyncBatchNorm`. Forward outputs,
    gradients and running statistics then equal those of one process on the global batch, and the
    running statistics are identical on every rank (checked at the end of each training epoch).

    The number of converted layers is logged on rank 0 and kept in :attr:`converted`. A warning names
    the problem when the global batch a BatchNorm layer normalizes over (per-rank batch size x
    data-parallel ranks) is below ``min_batch_size``: statistics of so few samples make training noisy.

    Args:
        min_batch_size: smallest global batch for meaningful BatchNorm statistics (default 16).
        mode: ``"warn"`` or ``"raise"`` for the running-statistics check.
    """

    def __init__(self, min_batch_size: int = 16, mode: str = "warn") -> None:
        self.min_batch_size = min_batch_size
        self.mode = check_mode(mode, "SyncBatchNormConversion")
        self.converted = 0
        self.layer_class: type | None = None
        self._dp: DataParallelGroup | None = None
        self._checked_batch = False
        self._undo_configure: Callable[[], None] | None = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        self._dp = data_parallel_group(trainer.strategy)
        self._checked_batch = False
        self._disable_lightning_layer_sync(trainer)
        self._convert(trainer, pl_module)
        if _overrides_configure_model(pl_module) and self._undo_configure is None:
            original = pl_module.configure_model

            def configure_model() -> None:
                original()
                self._convert(trainer, pl_module)

            self._undo_configure = patch_attribute(pl_module, "configure_model", configure_model)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self._undo_configure is not None:
            self._undo_configure()
            self._undo_configure = None

    def _convert(self, trainer: Any, pl_module: Any) -> None:
        dp = self._dp
        # torch's fused layer where it runs (CUDA tensors over NCCL), ours everywhere else
        target = torch.nn.SyncBatchNorm if dp.device.type == "cuda" else SyncBatchNorm
        pending = [name for name, m in batchnorm_layers(pl_module) if type(m) is not target]
        if not pending and self.converted:
            return
        if target is torch.nn.SyncBatchNorm:
            for name, child in pl_module.named_children():
                new = torch.nn.SyncBatchNorm.convert_sync_batchnorm(child, process_group=dp.group)
                if new is not child:
                    pl_module.add_module(name, new)
        else:
            SyncBatchNorm.convert_sync_batchnorm(pl_module, process_group=dp.group)
        self.converted += len(pending)
        self.layer_class = target
        where = f"the data-parallel group of {dp.size} ranks"
        info(
            f"SyncBatchNormConversion: converted {len(pending)} BatchNorm layers to"
            f" {target.__module__}.{target.__name__} over {where}"
            if pending
            else "SyncBatchNormConversion: the model has no BatchNorm layers; nothing to convert"
        )

    def _disable_lightning_layer_sync(self, trainer: Any) -> None:
        # Lightning's sync_batchnorm=True would convert our layers again, into CUDA-only ones.
        if disable_layer_sync(trainer.strategy):
            info(
                "SyncBatchNormConversion: Trainer(sync_batchnorm=True) is handled by this callback (Lightning's"
                " conversion uses torch.nn.SyncBatchNorm, which runs only on CUDA)"
            )

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._checked_batch or not self.converted:
            return
        self._checked_batch = True
        dp = self._dp
        try:
            local = extract_batch_size(batch)
        except Exception:  # batch structure Lightning cannot read: nothing to judge
            local = -1
        sizes = all_reduce(torch.tensor([float(max(local, 0)), float(local < 0)]), dp)
        total, unknown = int(sizes[0]), bool(sizes[1])
        if not unknown and total < self.min_batch_size:
            report(
                [
                    f"SyncBatchNormConversion: the {self.converted} BatchNorm layers normalize over a global batch"
                    f" of {total} samples ({local} on this rank x {dp.size} data-parallel ranks), below"
                    f" {self.min_batch_size}: statistics of so few samples are noise and make training"
                    " unstable. Fix: raise the per-rank batch size, or replace BatchNorm with GroupNorm or"
                    " LayerNorm, which do not depend on the batch."
                ],
                mode="warn",
                is_global_zero=trainer.is_global_zero,
            )

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if not self.converted:
            return
        differing = running_stats_disagreement(pl_module, self._dp)
        if differing:
            text = ", ".join(f"{name} (max difference {diff:.3g})" for name, diff in differing[:5])
            report(
                [
                    f"SyncBatchNormConversion: running statistics differ across the data-parallel ranks in"
                    f" {len(differing)} BatchNorm layers: {text}. Evaluation and checkpoints then depend on"
                    " the rank. Fix: make sure these layers are synchronized (created before the strategy"
                    " wraps the model, not replaced later) and that no rank updates them on its own."
                ],
                mode=self.mode,
                is_global_zero=trainer.is_global_zero,
            )


def running_stats_disagreement(module: torch.nn.Module, dp: DataParallelGroup) -> list[tuple[str, float]]:
    """BatchNorm layers whose running statistics differ across ``dp`` (name, max absolute difference)."""
    layers = [
        (n, m)
        for n, m in batchnorm_layers(module)
        if isinstance(m, _BatchNorm) and m.running_mean is not None
    ]
    if not layers or not dp.distributed:
        return []
    flat = torch.cat(
        [
            torch.cat(
                [m.running_mean.detach().float().reshape(-1), m.running_var.detach().float().reshape(-1)]
            )
            for _, m in layers
        ]
    )
    high, low = all_reduce_max_min(flat.double(), dp)
    diff = high - low
    out, offset = [], 0
    for name, m in layers:
        n = 2 * m.running_mean.numel()
        worst = float(diff[offset : offset + n].max())
        offset += n
        if worst > 0:
            out.append((name, worst))
    return out


def _overrides_configure_model(pl_module: Any) -> bool:
    from lightning.pytorch import LightningModule

    return type(pl_module).configure_model is not LightningModule.configure_model
