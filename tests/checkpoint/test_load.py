"""Checkpoint metadata loads onto the CPU: a tensor rank 0 saved on its GPU does not land on that GPU in
every rank.

No GPU is needed: a storage location tag registered with ``torch.serialization.register_package`` plays
rank 0's device. Loading without a ``map_location`` hands such a storage to the tag's own loader (which here
refuses, as the device it names is not this rank's); with ``map_location="cpu"`` it never gets there.

Also: where a sharded Lightning checkpoint keeps the model's weights (``model_entry``).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lightning.fabric.plugins import TorchCheckpointIO

from lit_parallel.checkpoint.load import load_lightning_meta, model_entry
from lit_parallel.checkpoint.write import LIGHTNING_META
from lit_parallel.reliability.checkpoints import ReliableCheckpointIO

_ON_RANK0_DEVICE: set[int] = set()  # data pointers of the storages "saved on rank 0's GPU"


def _tag(storage):
    return "rank0gpu:0" if storage.data_ptr() in _ON_RANK0_DEVICE else None


def _restore(storage, location):
    if location.startswith("rank0gpu"):
        raise RuntimeError(f"restored onto {location}, the device rank 0 saved from")
    return None


torch.serialization.register_package(5, _tag, _restore)


@pytest.fixture
def saved_on_rank0_device():
    score = torch.tensor(0.25)
    _ON_RANK0_DEVICE.add(score.untyped_storage().data_ptr())
    yield {"callbacks": {"ModelCheckpoint": {"best_model_score": score}}, "epoch": 3}
    _ON_RANK0_DEVICE.clear()


def test_the_tag_stands_for_a_device_a_load_without_map_location_restores_onto(
    tmp_path, saved_on_rank0_device
):
    torch.save(saved_on_rank0_device, tmp_path / "x.pt")
    with pytest.raises(RuntimeError, match="rank0gpu:0"):
        torch.load(tmp_path / "x.pt", weights_only=True)


def test_lightning_meta_of_a_sharded_checkpoint_loads_onto_the_cpu(tmp_path, saved_on_rank0_device):
    torch.save(saved_on_rank0_device, tmp_path / LIGHTNING_META)
    meta = load_lightning_meta(tmp_path)
    score = meta["callbacks"]["ModelCheckpoint"]["best_model_score"]
    assert score.device.type == "cpu" and score.item() == 0.25 and meta["epoch"] == 3


def test_a_single_file_checkpoint_loads_onto_the_cpu_unless_a_map_location_is_given(
    tmp_path, saved_on_rank0_device
):
    # Lightning's TorchCheckpointIO already does (its default map_location is torch's "onto the CPU"
    # idiom, lambda storage, loc: storage); ReliableCheckpointIO passes that on
    path = tmp_path / "last.ckpt"
    torch.save({**saved_on_rank0_device, "state_dict": {"w": torch.ones(2)}}, path)
    io = ReliableCheckpointIO(TorchCheckpointIO(), SimpleNamespace(at=lambda _: None), broadcast=lambda x: x)
    checkpoint = io.load_checkpoint(path)
    assert checkpoint["callbacks"]["ModelCheckpoint"]["best_model_score"].device.type == "cpu"
    # a map_location the caller gives is kept (here: where the tag points, which this rank refuses)
    with pytest.raises(RuntimeError, match="rank0gpu:0"):
        io.load_checkpoint(
            path, map_location=lambda storage, loc: None if loc.startswith("rank0") else storage
        )


# "state_dict": ModelParallelStrategy and lit_parallel; "model": Lightning's FSDPStrategy (FSDP1)
@pytest.mark.parametrize("entry", ["state_dict", "model"])
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_model_entry_finds_where_a_sharded_lightning_checkpoint_keeps_the_weights(tmp_path, entry):
    import torch.distributed.checkpoint as dcp

    state = {entry: {"head.weight": torch.ones(2, 3)}, "optimizer_0": {"param_groups": [{"lr": 0.1}]}}
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    assert model_entry(tmp_path) == entry


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_sharded_checkpoint_without_model_weights_is_refused_naming_its_entries(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"weights": {"w": torch.ones(2)}}, checkpoint_id=tmp_path, no_dist=True)
    with pytest.raises(ValueError, match=r"its entries are \['weights'\].*'state_dict'.*'model'"):
        model_entry(tmp_path)
