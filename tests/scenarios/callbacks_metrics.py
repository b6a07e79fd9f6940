"""CrossRankMetrics scenarios: metrics of a fixed classifier on datasets that do not divide the world size."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanMetric, SumMetric
from torchmetrics.classification import MulticlassAccuracy

from lit_parallel.callbacks import CrossRankMetrics, current_sample_indices, gather_by_index
from tests.scenarios.callbacks_common import make_trainer

CLASSES = 3


def classification_data(n: int, seed: int = 0) -> TensorDataset:
    """Logits ``x`` (the model outputs them unchanged) and labels ``y``; about 60% of argmaxes are right."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, CLASSES, generator=g)
    y = torch.where(
        torch.rand(n, generator=g) < 0.6, x.argmax(1), torch.randint(0, CLASSES, (n,), generator=g)
    )
    return TensorDataset(x, y)


class FixedClassifier(L.LightningModule):
    """Returns its input as logits (times a weight of 1 that SGD with lr=0 never changes)."""

    def __init__(self, gather: bool = False):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(1))  # 1-D: FSDP2 cannot shard a scalar
        self.acc = MulticlassAccuracy(num_classes=CLASSES, average="micro")
        self.count = SumMetric()
        self.mean_loss = MeanMetric()
        self.gather = gather
        self.outputs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.gathered: dict[str, torch.Tensor] = {}

    def forward(self, x):
        return x * self.scale

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def _eval_step(self, batch, prefix):
        x, y = batch
        logits = self(x)
        losses = F.cross_entropy(logits, y, reduction="none")
        self.acc(logits, y)  # forward: batch value + accumulated state
        self.count.update(torch.ones_like(losses))
        self.mean_loss.update(losses)
        self.log(f"{prefix}_acc", self.acc)
        self.log(f"{prefix}_count_metric", self.count)
        self.log(f"{prefix}_mean_loss_metric", self.mean_loss)
        self.log(f"{prefix}_loss", losses.mean(), sync_dist=True)
        self.log(f"{prefix}_count", float(len(y)), reduce_fx="sum", sync_dist=True)
        self.log(f"{prefix}_max_loss", losses.max(), reduce_fx="max", sync_dist=True)
        if self.gather:
            self.outputs.append((current_sample_indices(self.trainer), logits.argmax(1)))

    def validation_step(self, batch, batch_idx):
        self._eval_step(batch, "val")

    def test_step(self, batch, batch_idx):
        self._eval_step(batch, "test")

    def _gather(self):
        if self.gather:
            idx = torch.cat([i for i, _ in self.outputs])
            preds = torch.cat([p for _, p in self.outputs])
            self.gathered = gather_by_index(idx, {"preds": preds})
            self.outputs.clear()

    def on_validation_epoch_end(self):
        self._gather()

    def on_test_epoch_end(self):
        self._gather()


def _metrics(trainer, prefix) -> dict:
    return {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(prefix)}


class TensorParallelClassifier(FixedClassifier):
    """The same classifier under a (data_parallel x tensor_parallel) mesh: TP peers see the same samples."""

    def configure_model(self):
        pass  # nothing to split; ModelParallelStrategy only requires the hook


def exact_metrics(ctx) -> dict:
    """For each batch size: fit (validation every epoch), validate and test, with and without the callback."""
    return {batch: _exact_metrics(ctx, ctx.args["n"], batch) for batch in ctx.args["batches"]}


class IdentityBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(CLASSES, CLASSES)
        with torch.no_grad():  # x @ I + 0 is x exactly: predictions stay those of the data
            self.linear.weight.copy_(torch.eye(CLASSES))
            self.linear.bias.zero_()

    def forward(self, x):
        return self.linear(x)


class BlockClassifier(FixedClassifier):
    """The fixed classifier with two identity blocks, for strategies that shard blocks (tp_dp)."""

    def __init__(self, gather: bool = False):
        super().__init__(gather)
        self.blocks = torch.nn.ModuleList([IdentityBlock(), IdentityBlock()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x * self.scale


def tensor_parallel_metrics(ctx) -> dict:
    """As exact_metrics, with tensor_parallel_size=2: Lightning's ModelParallelStrategy and our tp_dp."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lit_parallel.strategies import TensorParallelStrategy

    dp = ctx.world_size // 2
    setups = {
        "model_parallel": (
            lambda: ModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=2),
            TensorParallelClassifier,
        ),
        # the plan function leaves the tiny blocks unsplit: the mesh and the data layout are what matter
        "tp_dp": (
            lambda: TensorParallelStrategy(
                data_parallel_size=dp, tensor_parallel_size=2, plan=lambda module, mesh: None
            ),
            BlockClassifier,
        ),
    }
    return {
        name: {
            batch: _exact_metrics(ctx, ctx.args["n"], batch, strategy, module)
            for batch in ctx.args["batches"]
        }
        for name, (strategy, module) in setups.items()
        if name in ctx.args.get("strategies", setups)
    }


def _exact_metrics(ctx, n: int, batch: int, strategy=lambda: "ddp", module=FixedClassifier) -> dict:
    data = classification_data(n)
    out = {}

    model = module(gather=True)
    trainer = make_trainer(
        ctx, strategy=strategy(), callbacks=[CrossRankMetrics()], max_epochs=2, num_sanity_val_steps=2
    )
    loader = DataLoader(data, batch_size=batch)
    trainer.fit(model, loader, loader)
    out["fit"] = _metrics(trainer, "val")
    out["fit_gathered"] = dict(model.gathered)

    trainer = make_trainer(ctx, strategy=strategy(), callbacks=[CrossRankMetrics()])
    trainer.validate(model, loader, verbose=False)
    out["validate"] = _metrics(trainer, "val")
    out["validate_gathered"] = dict(model.gathered)

    trainer = make_trainer(ctx, strategy=strategy(), callbacks=[CrossRankMetrics()])
    trainer.test(model, loader, verbose=False)
    out["test"] = _metrics(trainer, "test")
    out["test_gathered"] = dict(model.gathered)

    # The same validation without the callback counts the padding repeats (the test checks it does).
    trainer = make_trainer(ctx, strategy=strategy())
    trainer.validate(module(), loader, verbose=False)
    out["validate_without_callback"] = _metrics(trainer, "val")
    return out
