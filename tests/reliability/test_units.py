"""Reliability without launching ranks: configuration errors come before any process group or
subprocess, RNG states survive ``weights_only`` loading, checkpoints are verified and never unpickle code."""

from __future__ import annotations

import os
import pickle
import random
import signal
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

import lit_parallel as lp
from lit_parallel.checkpoint.convert import consolidate_checkpoint
from lit_parallel.checkpoint.load import (
    IncompleteCheckpointError,
    load_sharded,
    read_dcp_metadata,
    verify_checkpoint,
)
from lit_parallel.checkpoint.write import atomic_save, check_replaceable
from lit_parallel.parallel import NoBlocksFoundError
from lit_parallel.reliability import ReliabilityOptions, _reaches_a_parameter
from lit_parallel.rng import capture_rng_state, restore_rng_state
from tests.scenarios import fsdp as sc


@pytest.fixture(autouse=True)
def _restore_environment():
    # Lightning's launcher writes MASTER_PORT, LOCAL_RANK, ... into os.environ; keep other tests clean.
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _child_pids() -> list[int]:
    me = os.getpid()
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == me:
                children.append(int(entry.name))
    return children


def _assert_nothing_started(before: list[int]) -> None:
    assert not dist.is_initialized(), "a process group exists after a configuration error"
    assert _child_pids() == before, "a rank was started before the configuration error"


def _trainer(strategy, devices=2, **kwargs):
    return L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, logger=False, max_steps=1, **kwargs
    )


# --- configuration errors: before any process group or subprocess ---------------------------------------


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: _trainer(lp.TunedDDPStrategy(comm_hook="bf16")), ValueError, "bf16"),
        (
            lambda: _trainer(lp.TunedDDPStrategy(static_graph=True), accumulate_grad_batches=2),
            ValueError,
            "static_graph=True with accumulate_grad_batches=2",
        ),
        (
            lambda: _trainer(lp.TransformerFSDPStrategy(block_types={nn.GRU})),
            NoBlocksFoundError,
            r"block_types=\{GRU\} names no module",
        ),
    ],
    ids=["ddp_tuned-bf16-hook-on-gloo", "ddp_tuned-static-graph-with-accumulation", "fsdp_blocks-no-blocks"],
)
def test_errors_that_need_the_model_or_trainer_come_before_lightnings_launcher_starts_ranks(
    make, error, match
):
    before = _child_pids()
    trainer = make()
    with pytest.raises(error, match=match):
        trainer.fit(sc.LitModel(), sc.loader(sc.lm_dataset()))
    _assert_nothing_started(before)


def test_tensor_parallel_plan_naming_a_missing_module_fails_before_ranks_start():
    from torch.distributed.tensor.parallel import ColwiseParallel

    before = _child_pids()
    trainer = _trainer(lp.TensorParallelStrategy(plan={"model.no_such_layer": ColwiseParallel()}))
    with pytest.raises(Exception, match="no_such_layer"):
        trainer.fit(sc.LitModel(name="llama"), sc.loader(sc.lm_dataset()))
    _assert_nothing_started(before)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: _trainer(lp.HybridShardStrategy(shard_size=3), devices=4), "shard_size=3 does not divide"),
        (
            lambda: _trainer(lp.TensorParallelStrategy(tensor_parallel_size=3), devices=4),
            "tensor_parallel",
        ),
        (
            lambda: _trainer(
                lp.TransformerFSDPStrategy(mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16)),
                precision="bf16-true",
            ),
            "conflicting precision",
        ),
        (lambda: lp.TunedDDPStrategy(debug_level="loud"), "debug_level='loud' must be None"),
        (lambda: lp.TransformerFSDPStrategy(preemption_signal="SIGNOPE"), "is not a signal name"),
        (lambda: lp.HybridShardStrategy(watchdog="yes"), "watchdog='yes' must be True or False"),
    ],
    ids=["hsdp-size", "tp_dp-size", "fsdp_blocks-precision", "debug-level", "preemption-signal", "watchdog"],
)
def test_sizes_precisions_and_options_are_refused_when_the_trainer_is_built(make, match):
    before = _child_pids()
    with pytest.raises(ValueError, match=match):
        make()
    _assert_nothing_started(before)


def test_reliability_options_accept_signal_names_and_numbers():
    assert ReliabilityOptions(preemption_signal="usr2").preemption_signal == signal.SIGUSR2
    assert ReliabilityOptions(preemption_signal=signal.SIGUSR1).preemption_signal == signal.SIGUSR1
    assert lp.TunedDDPStrategy(debug_level="detail").reliability.debug_level == "detail"


# --- RNG states -----------------------------------------------------------------------------------------


def test_rng_states_round_trip_through_a_weights_only_load(tmp_path):
    torch.manual_seed(3), np.random.seed(4), random.seed(5)
    np.random.randn()  # numpy's cached Gaussian is part of its state
    state = capture_rng_state()
    expected = (torch.rand(4), np.random.rand(4), np.random.randn(), [random.random() for _ in range(3)])
    torch.save(state, tmp_path / "rng.pt")
    torch.manual_seed(99), np.random.seed(99), random.seed(99)
    restore_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    got = (torch.rand(4), np.random.rand(4), np.random.randn(), [random.random() for _ in range(3)])
    assert torch.equal(got[0], expected[0]) and np.array_equal(got[1], expected[1])
    assert got[2] == expected[2] and got[3] == expected[3]


def test_numpys_own_state_tuple_is_refused_by_weights_only_loading(tmp_path):
    # why the states are converted: the form Lightning's seed utilities return cannot be loaded safely
    torch.save({"numpy": np.random.get_state()}, tmp_path / "raw.pt")
    with pytest.raises(pickle.UnpicklingError):
        torch.load(tmp_path / "raw.pt", weights_only=True)


# --- a loss that skips the model ------------------------------------------------------------------------


def test_a_loss_not_computed_from_parameters_is_recognised():
    layer = nn.Linear(3, 1)
    assert _reaches_a_parameter(layer(torch.randn(2, 3)).sum() / 1)
    assert _reaches_a_parameter(layer(torch.randn(2, 3)).sum() * 0.0)  # the advised way to drop a batch
    assert not _reaches_a_parameter(torch.zeros((), requires_grad=True) / 1)
    from torch.utils.checkpoint import checkpoint

    x = torch.randn(2, 3, requires_grad=True)  # reentrant checkpointing hides the parameters: not refused
    assert _reaches_a_parameter(checkpoint(layer, x, use_reentrant=True).sum())


# --- integrity and safe loading -------------------------------------------------------------------------


def _sharded_checkpoint(path: Path) -> dict:
    state = {
        "state_dict": {"model.w": torch.arange(12.0).reshape(3, 4), "model.b": torch.ones(3)},
        "optimizer_0": {
            "state": {"model.w": {"step": torch.tensor(2.0), "exp_avg": torch.full((3, 4), 0.5)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["model.w", "model.b"]}],
        },
    }
    dcp.save(state, checkpoint_id=path, no_dist=True)
    torch.save({"epoch": 3, "global_step": 12, "loops": {"fit_loop": {}}}, path / "meta.pt")
    return state


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_verify_checkpoint_names_what_an_incomplete_checkpoint_lacks(tmp_path):
    path = tmp_path / "ckpt"
    _sharded_checkpoint(path)
    assert verify_checkpoint(path) == "sharded"
    shard = next(path.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:10])
    with pytest.raises(
        IncompleteCheckpointError, match=rf"{shard.name} is truncated: 10 of at least \d+ bytes"
    ):
        verify_checkpoint(path)
    shard.unlink()
    (path / "meta.pt").unlink()
    with pytest.raises(IncompleteCheckpointError) as info:
        verify_checkpoint(path)
    assert "meta.pt (Lightning's loop, callback and RNG state)" in str(info.value)
    assert f"{shard.name} (a shard file listed in .metadata)" in str(info.value)
    (path / ".metadata").unlink()
    with pytest.raises(IncompleteCheckpointError, match=r"\.metadata \(the DCP index, written last"):
        verify_checkpoint(path)
    # a single file cut short
    torch.save({"w": torch.randn(100)}, tmp_path / "full.ckpt")
    data = (tmp_path / "full.ckpt").read_bytes()
    (tmp_path / "full.ckpt").write_bytes(data[: len(data) // 2])
    with pytest.raises(IncompleteCheckpointError, match="truncated or not a torch.save archive"):
        verify_checkpoint(tmp_path / "full.ckpt")


def test_a_save_interrupted_before_its_rename_is_never_taken_for_the_checkpoint(tmp_path):
    target = tmp_path / "last.ckpt"
    atomic_save(lambda tmp: torch.save({"v": 1}, tmp), target)

    def crash(tmp):
        tmp.write_bytes(b"PK partial")
        raise KeyboardInterrupt  # the process dies mid-write

    with pytest.raises(KeyboardInterrupt):
        atomic_save(crash, target)
    assert torch.load(target, weights_only=True) == {"v": 1}  # the old checkpoint, whole
    target.unlink()
    (tmp_path / ".lit_parallel_partial_0123.tmp").mkdir()  # what a killed sharded save leaves
    with pytest.raises(FileNotFoundError, match="interrupted save"):
        verify_checkpoint(target)


def test_saving_never_replaces_a_folder_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "notes.txt").write_text("mine")
    with pytest.raises(IsADirectoryError, match="not a checkpoint"):
        check_replaceable(tmp_path / "results")


class _Payload:
    """Unpickling this creates a folder: proof that code ran."""

    def __init__(self, target: Path):
        self.target = target

    def __reduce__(self):
        return (os.mkdir, (str(self.target),))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_dcp_index_carrying_code_is_refused(tmp_path):
    path = tmp_path / "ckpt"
    _sharded_checkpoint(path)
    pwned = tmp_path / "pwned"
    metadata = read_dcp_metadata(path)
    metadata.storage_meta = _Payload(pwned)  # a tampered index
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(pickle.UnpicklingError, match="refusing to load it"):
        load_sharded(path)
    assert not pwned.exists()
    # torch's own reader runs the payload: the reason for the restricted one
    dcp.FileSystemReader(path).read_metadata()
    assert pwned.exists()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_non_tensor_entries_carrying_code_are_refused(tmp_path):
    path = tmp_path / "ckpt"
    pwned = tmp_path / "pwned"
    dcp.save({"state_dict": {"w": torch.ones(2)}, "extra": _Payload(pwned)}, checkpoint_id=path, no_dist=True)
    with pytest.raises(BaseException) as info:  # DCP wraps it in a CheckpointException (a BaseException)
        load_sharded(path)
    assert "'extra' holds an object that torch.load(weights_only=True) refuses" in str(info.value)
    assert not pwned.exists()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_consolidated_lightning_checkpoint_keys_optimizer_state_by_parameter_index(tmp_path):
    state = _sharded_checkpoint(tmp_path / "ckpt")
    consolidate_checkpoint(tmp_path / "ckpt", tmp_path / "full.ckpt")
    full = torch.load(tmp_path / "full.ckpt", weights_only=True)
    assert (full["epoch"], full["global_step"]) == (3, 12)
    for k, v in state["state_dict"].items():
        assert torch.equal(full["state_dict"][k], v)
    opt = full["optimizer_states"][0]
    assert opt["param_groups"] == [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0, 1]}]
    assert torch.equal(opt["state"][0]["exp_avg"], state["optimizer_0"]["state"]["model.w"]["exp_avg"])
    # a plain optimizer over the same parameters accepts it
    w, b = nn.Parameter(torch.zeros(3, 4)), nn.Parameter(torch.zeros(3))
    torch.optim.Adam([w, b], lr=0.1, betas=(0.9, 0.99)).load_state_dict(opt)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_lit_parallel_consolidate_lightning_writes_a_resumable_checkpoint(tmp_path, capsys):
    import argparse

    from lit_parallel.commands import consolidate as consolidate_command

    _sharded_checkpoint(tmp_path / "ckpt")
    parser = argparse.ArgumentParser()
    consolidate_command.add_arguments(parser)
    assert (
        consolidate_command.run(
            parser.parse_args([str(tmp_path / "ckpt"), str(tmp_path / "full.ckpt"), "--lightning"])
        )
        == 0
    )
    assert (
        "a full Lightning checkpoint, 2 tensors, 1 optimizer state(s), epoch 3, step 12"
        in capsys.readouterr().out
    )
    assert verify_checkpoint(tmp_path / "full.ckpt") == "file"
    assert torch.load(tmp_path / "full.ckpt", weights_only=True)["optimizer_states"][0]["param_groups"][0][
        "params"
    ] == [0, 1]


def test_a_rank_whose_launching_process_is_gone_says_so_in_its_failure_report(monkeypatch, capsys):
    """Under Lightning's launcher, a rank's collective with a killed launching process fails with gloo's
    "connection reset by peer"; the report adds who is gone."""
    from lit_parallel.reliability import Reliability, launcher

    parent = os.getppid() + 1  # not this process's parent: the launching process is gone
    monkeypatch.setattr(launcher, "_PARENT", launcher._ParentWatchdog(parent))
    reliability = Reliability(ReliabilityOptions(), timeout=None)
    error = RuntimeError("[pair.cc:537] Read error [127.0.0.1]:19346: Connection reset by peer")
    reliability.on_exception(error, rank=1)
    report = capsys.readouterr().err
    assert f"the launching process (local rank 0, pid {parent}) is gone" in report
    assert "Connection reset by peer" in report and "lit_parallel: rank 1 failed" in report
    # with the launching process alive, nothing is added
    monkeypatch.setattr(launcher, "_PARENT", launcher._ParentWatchdog(os.getppid()))
    Reliability(ReliabilityOptions(), timeout=None).on_exception(RuntimeError("x"), rank=1)
    assert "is gone" not in capsys.readouterr().err


def test_rng_states_are_gathered_on_the_strategys_cuda_device_under_nccl(monkeypatch):
    # NCCL refuses CPU tensors: the byte tensors must go to the strategy's device (stand-in backend names,
    # as no CUDA is here); gloo gathers on the CPU
    from lit_parallel.reliability.checkpoints import collective_device

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    cuda = torch.device("cuda", 3)
    for backend, expected in (("nccl", cuda), ("cpu:gloo,cuda:nccl", cuda), ("gloo", torch.device("cpu"))):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: b)
        assert collective_device(cuda) == expected, backend
