"""The quiet Trainer every scenario builds: CPU, this launch's ranks, no logger, checkpoints or progress bar."""

from __future__ import annotations

import lightning as L


def quiet_trainer(ctx, strategy, **kwargs) -> L.Trainer:
    options = dict(
        accelerator="cpu",
        devices=ctx.nprocs,
        num_nodes=ctx.world_size // ctx.nprocs,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    options.update(kwargs)
    return L.Trainer(**options)
