"""The language-model recipes' optimizer: AdamW (no weight decay on norms and biases), linear warm-up, then a
cosine decay to a tenth of the learning rate, stepped every optimizer step."""

from __future__ import annotations

import math

import lightning as L
import torch


def adamw_warmup_cosine(module: L.LightningModule) -> dict:
    """``configure_optimizers``' return for ``module``, whose hyperparameters hold ``lr``, ``weight_decay`` and
    ``warmup_steps``. Parameters may be sharded (DTensors) by then; grouping by dimension still works."""
    hp = module.hparams
    decay = [p for p in module.parameters() if p.ndim >= 2]
    no_decay = [p for p in module.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=hp.lr,
        betas=(0.9, 0.95),
    )
    total = max(1, module.trainer.estimated_stepping_batches)
    warmup = min(hp.warmup_steps, total // 10 + 1)

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    return {
        "optimizer": optimizer,
        "lr_scheduler": {
            "scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, schedule),
            "interval": "step",
        },
    }
