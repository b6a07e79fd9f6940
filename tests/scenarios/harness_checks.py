"""Scenarios that check the harness itself."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


def allreduce_rank(ctx) -> dict:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return {"sum": t.item(), "rank": dist.get_rank(), "world": dist.get_world_size()}


def rank1_raises(ctx) -> dict:
    dist.barrier()
    if dist.get_rank() == 1:
        time.sleep(0.2)
        raise ValueError("scenario failure injected on rank 1")
    # The other ranks wait in a collective that rank 1 never joins; only the launcher can end them.
    dist.all_reduce(torch.ones(1))
    return {}


def lightning_devices(ctx) -> dict:
    """One tiny Trainer(devices=N) run under Lightning's own launcher."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=ctx.nprocs,
        strategy=ctx.args.get("strategy", "ddp"),
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Tiny()
    trainer.fit(model, DataLoader(data, batch_size=4))
    if ctx.args.get("fail_rank") == trainer.global_rank:
        raise RuntimeError(f"injected failure after fit on rank {trainer.global_rank}")
    if ctx.args.get("fail_rank") is not None:
        # Stay in a collective the failed rank never joins.
        trainer.strategy.barrier()
    return {
        "rank": trainer.global_rank,
        "world": trainer.world_size,
        "weight": model.layer.weight.detach().clone(),
    }
