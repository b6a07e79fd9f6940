"""SetEpochCheck scenarios: faulty and correct data sharding under real DDP ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, Sampler

from lit_parallel.callbacks import ParallelTrainingError, ParallelTrainingWarning, SetEpochCheck
from tests.scenarios.callbacks_common import LinearModule, captured_warnings, make_trainer, regression_data

N = 16
BATCH = 4


class PairBatchSampler(Sampler):
    """A custom batch sampler that keeps its index sampler under a name Lightning does not look at."""

    def __init__(self, index_sampler, batch_size):
        self.index_sampler = index_sampler
        self.batch_size = batch_size

    def __iter__(self):
        batch = []
        for i in self.index_sampler:
            batch.append(i)
            if len(batch) == self.batch_size:
                yield batch
                batch = []
        if batch:
            yield batch

    def __len__(self):
        return -(-len(self.index_sampler) // self.batch_size)


class ShardedStream(IterableDataset):
    """Reads its rank's shard in an order shuffled by ``seed + epoch``: correct only if set_epoch is called."""

    def __init__(self, n: int = N, dim: int = 4):
        self.data = regression_data(n, dim)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        rank, world = dist.get_rank(), dist.get_world_size()
        order = torch.randperm(len(self.data), generator=torch.Generator().manual_seed(7 + self.epoch))
        for i in order[rank::world].tolist():
            yield self.data[i]


class StreamModule(LinearModule):
    """Calls the dataset's set_epoch itself (the fix for an IterableDataset)."""

    def on_train_epoch_start(self):
        self.trainer.train_dataloader.dataset.set_epoch(self.current_epoch)


def _fit(ctx, loader, check, module=None, **trainer_kwargs) -> dict:
    module = module or LinearModule()
    trainer = make_trainer(ctx, callbacks=[check], **trainer_kwargs)
    with captured_warnings(ParallelTrainingWarning) as caught:
        trainer.fit(module, loader)
    return {
        "warnings": caught,
        "findings": list(check.findings),
        "fixed": list(check.fixed),
        "module": module,
    }


def _hidden_loader():
    sampler = DistributedSampler(regression_data(), shuffle=True, seed=3)
    return DataLoader(regression_data(), batch_sampler=PairBatchSampler(sampler, BATCH)), sampler


def _epoch_orders(module: LinearModule) -> list[torch.Tensor]:
    """The inputs trained on in each epoch (two batches per epoch here)."""
    seen = module.seen
    per_epoch = len(seen) // 2
    return [torch.cat(seen[e * per_epoch : (e + 1) * per_epoch]) for e in range(2)]


def hidden_distributed_sampler(ctx) -> dict:
    loader, _ = _hidden_loader()
    out = _fit(ctx, loader, SetEpochCheck(), use_distributed_sampler=False)
    orders = _epoch_orders(out.pop("module"))
    out["same_order_both_epochs"] = torch.equal(orders[0], orders[1])
    return out


def hidden_distributed_sampler_raise(ctx) -> dict:
    loader, _ = _hidden_loader()
    trainer = make_trainer(ctx, callbacks=[SetEpochCheck(mode="raise")], use_distributed_sampler=False)
    try:
        trainer.fit(LinearModule(), loader)
    except ParallelTrainingError as err:
        return {"raised": str(err), "epoch": trainer.current_epoch}
    return {"raised": None}


def hidden_distributed_sampler_fixed(ctx) -> dict:
    loader, sampler = _hidden_loader()
    out = _fit(ctx, loader, SetEpochCheck(fix=True), use_distributed_sampler=False)
    orders = _epoch_orders(out.pop("module"))
    out["same_order_both_epochs"] = torch.equal(orders[0], orders[1])
    out["sampler_epoch"] = sampler.epoch
    return out


def every_rank_reads_everything(ctx) -> dict:
    loader = DataLoader(regression_data(), batch_size=BATCH, shuffle=True)
    out = _fit(ctx, loader, SetEpochCheck(), use_distributed_sampler=False, max_epochs=1)
    out.pop("module")
    return out


def wrong_rank_in_sampler(ctx) -> dict:
    # Both ranks build rank 0's shard: half of the data is read twice, the other half never.
    sampler = DistributedSampler(regression_data(), num_replicas=2, rank=0, shuffle=True)
    loader = DataLoader(regression_data(), batch_size=BATCH, sampler=sampler)
    out = _fit(ctx, loader, SetEpochCheck(), use_distributed_sampler=False, max_epochs=1)
    out.pop("module")
    return out


def iterable_set_epoch_never_called(ctx) -> dict:
    out = _fit(ctx, DataLoader(ShardedStream(), batch_size=BATCH), SetEpochCheck())
    out.pop("module")
    return out


def iterable_every_rank_same_stream(ctx) -> dict:
    # No sharding by rank: every rank streams the whole dataset.
    data = regression_data()

    class Unsharded(IterableDataset):
        def __iter__(self):
            yield from (data[i] for i in range(len(data)))

    loader = DataLoader(Unsharded(), batch_size=BATCH)
    out = _fit(ctx, loader, SetEpochCheck(), max_epochs=1)
    out.pop("module")
    return out


def correct_setups(ctx) -> dict:
    """Lightning's own DistributedSampler, a custom batch sampler Lightning reaches, a well-fed stream."""
    results = {}
    check = SetEpochCheck(mode="raise")
    out = _fit(ctx, DataLoader(regression_data(), batch_size=BATCH, shuffle=True), check)
    results["lightning_sampler"] = out["warnings"] + out["findings"]

    # 11 samples: 6 per rank after padding; drop_last leaves out 2 per rank
    check = SetEpochCheck(mode="raise")
    out = _fit(ctx, DataLoader(regression_data(n=11), batch_size=BATCH, shuffle=True, drop_last=True), check)
    results["drop_last"] = out["warnings"] + out["findings"]

    # 11 samples on 2 ranks: one padding repeat, uneven last batches
    check = SetEpochCheck(mode="raise")
    out = _fit(ctx, DataLoader(regression_data(n=11), batch_size=BATCH, shuffle=True), check)
    results["padded"] = out["warnings"] + out["findings"]

    check = SetEpochCheck(mode="raise")
    out = _fit(ctx, DataLoader(ShardedStream(), batch_size=BATCH), check, module=StreamModule())
    results["stream_with_set_epoch"] = out["warnings"] + out["findings"]
    return results


class TensorParallelLinear(LinearModule):
    def configure_model(self):
        pass  # nothing to split; ModelParallelStrategy only requires the hook


def tensor_parallel_set_epoch(ctx) -> dict:
    """Under a (data_parallel x tensor_parallel) mesh the peers of a TP group read the same shard: that is
    correct, and only ranks that read the whole dataset are flagged."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    def strategy():
        return ModelParallelStrategy(data_parallel_size=ctx.world_size // 2, tensor_parallel_size=2)

    correct = _fit(
        ctx,
        DataLoader(regression_data(), batch_size=BATCH, shuffle=True),
        SetEpochCheck(mode="raise"),
        module=TensorParallelLinear(),
        strategy=strategy(),
    )
    everything = _fit(
        ctx,
        DataLoader(regression_data(), batch_size=BATCH, shuffle=True),
        SetEpochCheck(),
        module=TensorParallelLinear(),
        strategy=strategy(),
        use_distributed_sampler=False,
        max_epochs=1,
    )
    return {
        "correct": correct["warnings"] + correct["findings"],
        "everything": everything["findings"],
        "everything_warnings": everything["warnings"],
    }
