"""Pieces of the callbacks that need no process group: sampler chains, taps, padding, fingerprints."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, SequentialSampler, TensorDataset

from lit_parallel.callbacks import data_parallel_group, gather_by_index
from lit_parallel.callbacks.fingerprints import batch_fingerprints
from lit_parallel.callbacks.metrics import _EvalTap, _padding_plan
from lit_parallel.callbacks.samplers import (
    add_tap,
    index_sampler,
    reached_by_lightning,
    remove_tap,
    sampler_chain,
)
from lit_parallel.nn import SyncBatchNorm


class HoldingBatchSampler:
    """A custom batch sampler keeping its samplers under other names, one of them in a list."""

    def __init__(self, inner, extra):
        self.index_sampler = inner
        self.others = [extra]

    def __iter__(self):
        yield from ([i] for i in self.index_sampler)

    def __len__(self):
        return len(self.index_sampler)


def _data(n=10):
    return TensorDataset(torch.arange(n, dtype=torch.float32).unsqueeze(1))


def test_sampler_chain_finds_samplers_under_any_attribute():
    data = _data()
    hidden = DistributedSampler(data, num_replicas=2, rank=0)
    extra = DistributedSampler(data, num_replicas=2, rank=1)
    loader = DataLoader(data, batch_sampler=HoldingBatchSampler(hidden, extra))
    paths = {link.path: link for link in sampler_chain(loader, "train_dataloader")}
    assert paths["train_dataloader.batch_sampler.index_sampler"].obj is hidden
    assert paths["train_dataloader.batch_sampler.others[0]"].obj is extra
    assert paths["train_dataloader.batch_sampler.index_sampler"].has_set_epoch
    # Lightning reaches dataloader.sampler (a SequentialSampler here) but neither DistributedSampler
    reached = reached_by_lightning(loader)
    assert id(hidden) not in reached and id(extra) not in reached and id(loader.sampler) in reached


def test_tap_sees_indices_and_keeps_identity_type_and_pickling():
    sampler = BatchSampler(SequentialSampler(range(5)), batch_size=2, drop_last=False)
    loader = DataLoader(list(range(5)), batch_sampler=sampler, collate_fn=list)
    seen = []

    def tap(s, it):
        for item in it:
            seen.append(item)
            yield item

    assert add_tap(loader, tap)
    # the user's sampler is left as it was; the loader's reference to it iterates it through the tap
    assert isinstance(sampler, BatchSampler) and type(sampler).__name__ == "BatchSampler"
    assert index_sampler(loader) is sampler and loader.batch_sampler.sampler is sampler.sampler
    assert list(loader) == [[0, 1], [2, 3], [4]] and seen == [[0, 1], [2, 3], [4]]
    assert len(loader) == 3 and loader.batch_sampler.batch_size == 2
    clone = pickle.loads(pickle.dumps(loader.batch_sampler))
    assert type(clone) is BatchSampler and list(clone) == [[0, 1], [2, 3], [4]]
    assert type(copy.deepcopy(loader.batch_sampler)) is BatchSampler
    remove_tap(loader, tap)
    assert type(sampler) is BatchSampler and loader.batch_sampler is sampler


@pytest.mark.parametrize(
    ("n", "world", "batch"), [(7, 2, 2), (7, 2, 3), (10, 3, 3), (10, 3, 2), (2, 3, 1), (11, 4, 5)]
)
def test_eval_tap_removes_exactly_the_distributed_sampler_repeats(n, world, batch):
    data = _data(n)
    counted: list[int] = []
    batches_per_rank = []
    for rank in range(world):
        ds = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=5)
        sampler = BatchSampler(ds, batch_size=batch, drop_last=False)
        padding, problem = _padding_plan(sampler, ds)
        assert problem is None
        tap = _EvalTap(padding, counts_samples=True)
        loader = DataLoader(data, batch_sampler=sampler)
        add_tap(loader, tap)
        batches = list(loader.batch_sampler)
        batches_per_rank.append(len(batches))
        assert len(batches) == len(tap.batches) == -(-ds.num_samples // batch)  # no batch lost
        for samples in tap.batches:
            counted += list(samples.indices[: samples.counted]) if samples.counted else []
            assert samples.counted in (0, len(samples.indices))
    assert len(set(batches_per_rank)) == 1
    assert sorted(counted) == list(range(n))  # every sample counted exactly once


def test_padding_plan_refuses_custom_batching():
    data = _data(7)
    ds = DistributedSampler(data, num_replicas=2, rank=1)
    padding, problem = _padding_plan(HoldingBatchSampler(ds, None), ds)
    assert padding is None and "cannot be located" in problem and "plain BatchSampler" in problem


def test_fingerprints_equal_for_equal_samples_only():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 3, 4, generator=g), torch.arange(6)
    fp = batch_fingerprints((x, y))
    # the same samples in another batch composition and order give the same numbers
    again = batch_fingerprints((x[[4, 1]], y[[4, 1]]))
    assert again.tolist() == [fp[4].item(), fp[1].item()]
    assert len(set(fp.tolist())) == 6
    assert (
        batch_fingerprints({"x": x.double(), "y": y})[0]
        != batch_fingerprints({"x": x.double(), "y": y + 1})[0]
    )


def test_gather_by_index_without_process_group_sorts_and_drops_repeats():
    out = gather_by_index(torch.tensor([3, 1, 3, 0]), {"p": torch.tensor([30.0, 10.0, 31.0, 0.0])})
    assert out["index"].tolist() == [0, 1, 3] and out["p"].tolist() == [0.0, 10.0, 30.0]
    with pytest.raises(ValueError, match=r"outputs\['p'\] has 2 rows but there are 4 indices"):
        gather_by_index(torch.tensor([3, 1, 3, 0]), {"p": torch.zeros(2)})


def test_data_parallel_group_without_process_group():
    dp = data_parallel_group(None)
    assert (dp.rank, dp.size, dp.counts_samples, dp.distributed) == (0, 1, True, False)


def test_sync_batchnorm_without_process_group_is_batchnorm():
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(2, 3, 1), torch.nn.BatchNorm2d(3), torch.nn.Sequential(torch.nn.BatchNorm1d(4))
    )
    reference = copy.deepcopy(net[1])
    converted = SyncBatchNorm.convert_sync_batchnorm(net)
    assert converted is net and isinstance(net[1], SyncBatchNorm) and isinstance(net[2][0], SyncBatchNorm)
    x = torch.randn(5, 3, 4, 4)
    torch.testing.assert_close(net[1](x), reference(x))
    torch.testing.assert_close(net[1].running_var, reference.running_var)
    with pytest.raises(ValueError, match=r"input of shape \(N, C, \*\)"):
        net[1](torch.randn(3))
    with pytest.raises(ValueError, match="lazy BatchNorm"):
        SyncBatchNorm.convert_sync_batchnorm(torch.nn.LazyBatchNorm1d())
