"""Small models, datasets and a Trainer factory shared by the callback scenarios."""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import lightning as L
import torch
from torch.utils.data import TensorDataset

from tests.scenarios.common import quiet_trainer


def make_trainer(ctx, **kwargs) -> L.Trainer:
    return quiet_trainer(ctx, kwargs.pop("strategy", "ddp"), **{"max_epochs": 2, **kwargs})


class LinearModule(L.LightningModule):
    """A linear regression on (x, y) batches; records the inputs it trained on."""

    def __init__(self, dim: int = 4, lr: float = 0.05):
        super().__init__()
        self.layer = torch.nn.Linear(dim, 1)
        self.lr = lr
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.append(x.detach().clone())
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def regression_data(n: int = 16, dim: int = 4, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, dim, generator=g), torch.randn(n, 1, generator=g))


@contextmanager
def captured_warnings(category: type[Warning] | None = None):
    """Warnings raised inside the block, as strings (of ``category`` when given)."""
    out: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield out
    out.extend(str(w.message) for w in caught if category is None or issubclass(w.category, category))
