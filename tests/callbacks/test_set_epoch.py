"""SetEpochCheck on 2 real DDP ranks: faulty sharding is named with its fix; correct setups stay silent (the
callbacks' 2-rank launch, tests/callbacks/conftest.py)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.multiprocess

HIDDEN = "train_dataloader.batch_sampler.index_sampler"


@pytest.mark.timeout(300)
def test_flags_distributed_sampler_hidden_in_custom_batch_sampler(callbacks_two_ranks):
    rank0, rank1 = callbacks_two_ranks.scenario("hidden_distributed_sampler")
    # the fault is real: without set_epoch both epochs trained on the same order
    assert rank0["same_order_both_epochs"] and rank1["same_order_both_epochs"]
    assert len(rank0["warnings"]) == 1, rank0["warnings"]
    assert rank1["warnings"] == []  # warnings come from rank 0 only
    message = rank0["warnings"][0]
    assert f"{HIDDEN} (DistributedSampler) has set_epoch() but never receives it" in message
    assert "epoch 1 drew its samples in the same order as epoch 0" in message
    assert f"Fix: call {HIDDEN}.set_epoch(self.current_epoch)" in message
    assert rank1["findings"] == rank0["findings"]


@pytest.mark.timeout(300)
def test_raise_mode_stops_every_rank_with_the_same_message(callbacks_two_ranks):
    rank0, rank1 = callbacks_two_ranks.scenario("hidden_distributed_sampler_raise")
    assert rank0["raised"] is not None and rank0["raised"] == rank1["raised"]
    assert HIDDEN in rank0["raised"] and rank0["epoch"] == rank1["epoch"] == 1


@pytest.mark.timeout(300)
def test_fix_calls_the_missed_set_epoch_and_says_so(callbacks_two_ranks):
    for out in callbacks_two_ranks.scenario("hidden_distributed_sampler_fixed"):
        assert out["warnings"] == [] and out["findings"] == []
        assert out["fixed"] == [HIDDEN]
        assert out["sampler_epoch"] == 1
        assert not out["same_order_both_epochs"]


@pytest.mark.timeout(300)
def test_flags_ranks_reading_the_whole_dataset(callbacks_two_ranks):
    rank0, _ = callbacks_two_ranks.scenario("every_rank_reads_everything")
    (message,) = rank0["warnings"]
    assert (
        "16 of the 32 samples drawn by the 2 data-parallel ranks had also been drawn by another rank"
        in message
    )
    assert "train_dataloader.sampler is RandomSampler, not a distributed sampler" in message
    assert "use_distributed_sampler=True" in message


@pytest.mark.timeout(300)
def test_flags_overlap_and_missing_samples_of_a_misconfigured_sampler(callbacks_two_ranks):
    rank0, _ = callbacks_two_ranks.scenario("wrong_rank_in_sampler")
    overlap, coverage = rank0["warnings"]
    assert "(num_replicas, rank) = [(2, 0), (2, 0)]" in overlap
    assert "together read 8 of the 16 samples" in coverage and "8 were never read" in coverage


@pytest.mark.timeout(300)
def test_flags_iterable_dataset_whose_set_epoch_is_never_called(callbacks_two_ranks):
    rank0, _ = callbacks_two_ranks.scenario("iterable_set_epoch_never_called")
    (message,) = rank0["warnings"]
    assert "train_dataloader.dataset (ShardedStream) has set_epoch() but never receives it" in message
    assert "the epoch of train_dataloader.dataset is not 1" in message


@pytest.mark.timeout(300)
def test_flags_iterable_dataset_not_sharded_by_rank(callbacks_two_ranks):
    rank0, _ = callbacks_two_ranks.scenario("iterable_every_rank_same_stream")
    (message,) = rank0["warnings"]
    assert (
        "the data-parallel ranks read the same data: 100% of the sampled per-sample fingerprints" in message
    )


@pytest.mark.timeout(300)
def test_correct_setups_stay_silent(callbacks_two_ranks):
    for out in callbacks_two_ranks.scenario("correct_setups"):
        assert out == {"lightning_sampler": [], "drop_last": [], "padded": [], "stream_with_set_epoch": []}
