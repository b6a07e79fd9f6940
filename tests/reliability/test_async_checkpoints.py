"""Asynchronous checkpoints (``async_checkpoint=True``): the same training and the same guarantees as
synchronous saves, for every strategy.

One launch (torchrun, 2 ranks, ``--max-restarts=5``; tests/scenarios/async_checkpoints.py): per strategy, a
rank killed with SIGKILL during the background write of ``step=4.ckpt``, then the restarted attempt resuming
from ``last.ckpt``; the last attempt runs the uninterrupted references. In-process tests (a one-rank Trainer,
the writer thread, a full disk injected into the write) and unit tests of the writer need no launch.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import lightning as L
import pytest
import torch

import lit_parallel as lp
from lit_parallel.checkpoint.background import BackgroundWriter, HostCopy
from lit_parallel.checkpoint.load import verify_checkpoint
from lit_parallel.checkpoint.write import CheckpointWriteError, atomic_save
from lit_parallel.reliability.async_checkpoints import check_async_checkpoint
from lit_parallel.reliability.stall import WARMUP_STEPS
from tests.harness import launch
from tests.reference import assert_bitwise
from tests.scenarios.async_checkpoints import LAST_ATTEMPT, LINKED, STRATEGIES, checkpoints_top1

SC = "tests.scenarios.async_checkpoints"
REPO = Path(__file__).resolve().parent.parent.parent


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    root = tmp_path_factory.mktemp("async_checkpoints")
    data = root / "data"
    data.mkdir()
    res = launch(
        f"{SC}:async_recover_after_kill",
        2,
        root,
        args={"dir": str(data)},
        timeout=1100,
        max_restarts=LAST_ATTEMPT,
        worker_group=False,
    )
    return res, data


@pytest.mark.multiprocess
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", STRATEGIES)
def test_an_asynchronous_run_trains_and_resumes_bitwise_as_a_synchronous_one(killed, name):
    res, _ = killed
    outs = [r[name]["reference"] for r in res.scenario("async_recover_after_kill")]
    for rank, ref in enumerate(outs):
        # saving in the background changes nothing in training: losses equal, step by step
        assert ref["async"]["losses"] == ref["sync"]["losses"], f"rank {rank}"
        # resumed from the asynchronously written step=4 checkpoint: the rest of the same curve
        assert ref["resumed"]["losses"] == ref["sync"]["losses"][4:], f"rank {rank}"
        assert ref["async"]["pending_after_fit"] == []  # fit returned after every write
        # ddp_tuned's rank 0 writes the file and holds the only copy; a sharded strategy's every rank its shard's
        assert (ref["async"]["host"] is None) == (name == "ddp_tuned" and rank == 1), (
            rank,
            ref["async"]["host"],
        )
    ref = outs[0]
    assert_bitwise(ref["async"]["model"], ref["sync"]["model"], f"{name}: asynchronous run")
    assert_bitwise(ref["resumed"]["model"], ref["sync"]["model"], f"{name}: resumed from step=4")
    # every save committed; top-1 kept the newest; nothing left under a temporary name
    steps = len(ref["sync"]["losses"])  # tp_dp and pp_dp (one data-parallel replica) take twice the steps
    every = [f"step={s}.ckpt" for s in range(2, steps + 1, 2)]
    assert sorted(ref["async"]["every"], key=lambda n: int(n[5:-5])) == every
    folder = ref["async"]["folder"]
    assert folder["names"] == ["last.ckpt", every[-1]] and folder["partials"] == []
    if name in LINKED:
        assert folder["last_link"] == every[-1]
    # in the order of the saves: the top-1 callback (its step, then its last copy), then the keep-all one
    written = ref["async"]["written"]
    last = [] if name in LINKED else ["last.ckpt"]
    assert written == [n for s in every for n in (s, *last, s)], written
    # the copy of the model and optimizer state was allocated once for the whole run (the optimizer state
    # exists from the first save on); later saves allocated only the callbacks' new scalar scores
    host = ref["async"]["host"]
    assert host["nbytes"] > 10_000 and host["allocated_bytes"] - host["nbytes"] <= 64 * len(every), host


@pytest.mark.multiprocess
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", STRATEGIES)
def test_a_rank_killed_during_a_background_write_keeps_the_previous_checkpoint_and_resumes_bitwise(
    killed, name
):
    res, _ = killed
    outs = [r[name] for r in res.scenario("async_recover_after_kill")]
    assert [r["attempt"] for r in res.scenario("async_recover_after_kill")] == [LAST_ATTEMPT] * 2
    index = STRATEGIES.index(name)
    for rank, out in enumerate(outs):
        sync = out["reference"]["sync"]
        (trained,) = out["trained"]  # the attempt after the kill trained this strategy, and only it
        assert trained["attempt"] == index + 1, (rank, trained["attempt"])
        assert trained["resumed_from"].endswith(f"{name}/last.ckpt")
        # what the killed write left: step=2 whole (its deletion waited behind the write), last -> step=2,
        # and step=4 only under its temporary name
        before = trained["folder_before"]
        assert before["names"] == ["last.ckpt", "step=2.ckpt"], before
        # ddp_tuned's killed rank 0 left its written file under the temporary name; under the sharded
        # strategies rank 0 saw its peer die in the write's collective and removed the partial folder
        assert len(before["partials"]) == (1 if name == "ddp_tuned" else 0), before
        if name in LINKED:
            assert before["last_link"] == "step=2.ckpt"
        # resumed from step 2: the rest of the uninterrupted curve
        assert trained["losses"] == sync["losses"][2:], f"rank {rank}: losses differ"
    assert_bitwise(outs[0]["model"], outs[0]["reference"]["sync"]["model"], f"{name} final parameters")


# --- one rank, in process: a full disk during the background write -----------------------------------------


@pytest.fixture(autouse=True)
def _no_process_group_left():
    """The one-rank Trainers below create the default process group (the strategy keeps it for later
    Trainers until the process exits) and set MASTER_PORT and the like in this process's environment: the
    tests after them expect no group, and processes they start must not inherit a port this one holds."""
    environment = dict(os.environ)
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environment)


class _Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 8)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch[0]).pow(2).mean()
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _data():
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=4)


def _trainer(tmp_path, callbacks, **strategy_kwargs):
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=lp.TunedDDPStrategy(**strategy_kwargs),
        max_steps=8,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=tmp_path,
    )


def _top1(folder):
    return checkpoints_top1(folder, "ddp_tuned")  # save_last="link"


@pytest.mark.timeout(120)
def test_a_full_disk_during_a_background_write_fails_the_run_and_keeps_the_previous_checkpoint(
    tmp_path, monkeypatch
):
    import builtins

    folder = tmp_path / "ckpt"
    real_open = builtins.open

    def full_disk_at_step_4(file, mode="r", *args, **kwargs):
        handle = real_open(file, mode, *args, **kwargs)
        # the lowest write call from Python on the writer thread (Lightning's file system layer writes the
        # file under a temporary name of its own, then moves it)
        if (
            "w" in mode
            and threading.current_thread().name == BackgroundWriter().name
            and (folder / "step=2.ckpt").exists()
        ):
            handle.write(b"PK\x03\x04 half")
            handle.close()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(file))
        return handle

    torch.manual_seed(0)
    model = _Tiny()
    trainer = _trainer(tmp_path, [_top1(folder)], async_checkpoint=True)
    monkeypatch.setattr(builtins, "open", full_disk_at_step_4)
    with pytest.raises(CheckpointWriteError, match="the disk is full") as info:
        trainer.fit(model, _data())
    monkeypatch.undo()
    assert any("written in the background" in note for note in getattr(info.value, "__notes__", []))
    # the failed write of step=4 removed its partial; its deletion of step=2 and the link were dropped
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "step=2.ckpt"]
    assert os.readlink(folder / "last.ckpt") == "step=2.ckpt"
    assert verify_checkpoint(folder / "step=2.ckpt") == "file"
    # resuming from it continues the uninterrupted curve bitwise
    torch.manual_seed(0)
    reference = _Tiny()
    _trainer(tmp_path / "ref", []).fit(reference, _data())
    resumed = _Tiny()
    _trainer(tmp_path / "resumed", []).fit(resumed, _data(), ckpt_path=folder / "last.ckpt")
    assert resumed.losses == reference.losses[2:]
    assert_bitwise(resumed.state_dict(), reference.state_dict(), "resumed after a full disk")


@pytest.mark.timeout(120)
def test_auto_turns_background_writes_on_when_a_save_takes_longer_than_a_few_steps(tmp_path, monkeypatch):
    from lit_parallel.reliability import async_checkpoints

    slow = {"s": 0.0}
    real = async_checkpoints.AsyncCheckpoints.after_synchronous_save

    def measured(self, seconds, steps, state):
        return real(self, seconds + slow["s"], steps, state)

    monkeypatch.setattr(async_checkpoints.AsyncCheckpoints, "after_synchronous_save", measured)
    decisions = {}
    for label, extra in (("fast", 0.0), ("slow", 3600.0)):
        slow["s"] = extra
        trainer = _trainer(tmp_path / label, [_top1(tmp_path / label / "ckpt")], async_checkpoint="auto")
        trainer.fit(_Tiny(), _data())
        checkpoints = trainer.strategy.reliability.checkpoints
        decisions[label] = (checkpoints.use_async(), [Path(d).name for d, _ in checkpoints.writer.completed])
    assert decisions["fast"] == (False, [])  # every save synchronous
    # step 2 comes before any timed step (the first WARMUP_STEPS steps are not timed: compilation, wrapping);
    # the save at step 4 is synchronous and timed; the later ones run in the background
    assert WARMUP_STEPS == 2
    assert decisions["slow"][0] is True and decisions["slow"][1] == ["step=6.ckpt", "step=8.ckpt"]


@pytest.mark.timeout(60)
def test_lightnings_asynccheckpointio_is_refused_with_the_strategys_option_as_the_fix(tmp_path):
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=lp.TunedDDPStrategy(),
        plugins=[AsyncCheckpointIO()],
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    with pytest.raises(ValueError, match="AsyncCheckpointIO plugin cannot be used") as info:
        trainer.fit(_Tiny(), _data())
    assert "pass async_checkpoint=True to the strategy" in str(info.value)


# --- units: the host copy and the writer -------------------------------------------------------------------


def test_async_checkpoint_accepts_true_false_and_auto_only():
    assert [check_async_checkpoint(v) for v in (True, False, "auto")] == [True, False, "auto"]
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match=rf"async_checkpoint={bad!r} must be True"):
            check_async_checkpoint(bad)


def test_the_host_copy_is_a_snapshot_reused_while_the_layout_holds():
    weight = torch.randn(4, 4)
    state = {"model": {"w": weight, "step": torch.tensor(3)}, "epoch": 1, "names": ["a"]}
    copy = HostCopy()
    staged = copy.stage(state)
    snapshot = weight.clone()
    weight.add_(1.0)  # training goes on: the copy keeps the saved values
    assert torch.equal(staged["model"]["w"], snapshot) and staged["epoch"] == 1
    assert not copy.unchanged(state)
    state["epoch"] = 2
    state["names"][0] = "b"
    again = copy.stage(state)
    assert again["model"]["w"] is staged["model"]["w"] and torch.equal(again["model"]["w"], weight)
    # other values are copied too: the first save's stay as they were
    assert (again["epoch"], again["names"], staged["epoch"], staged["names"]) == (2, ["b"], 1, ["a"])
    assert copy.allocated_bytes == copy.nbytes == 16 * 4 + 8  # allocated once
    assert copy.unchanged(state) and copy.reuse(state)["model"]["w"] is staged["model"]["w"]
    state["model"]["w"] = torch.randn(2, 2)  # another shape: a buffer of its own, the old one freed
    state["scores"] = [torch.tensor(1.0)]  # a new tensor: a buffer of its own
    copy.stage(state)
    assert copy.nbytes == 4 * 4 + 8 + 4 and copy.allocated_bytes == 16 * 4 + 8 + 4 * 4 + 4


def test_the_writer_runs_writes_in_order_and_drops_what_follows_a_failed_write(tmp_path):
    writer = BackgroundWriter()
    gate = threading.Event()
    order = []
    writer.submit(lambda: (gate.wait(5), order.append("first")), "first")
    assert writer.after_writes(lambda: order.append("after first"), "remove old")
    assert writer.pending_writes() == ["first"]
    gate.set()
    assert writer.wait(5) and order == ["first", "after first"]
    assert not writer.after_writes(lambda: None, "nothing pending")  # the caller runs it itself

    def fail():
        raise OSError(errno.ENOSPC, "No space left on device")

    writer.submit(fail, "second")
    writer.after_writes(lambda: order.append("must not run"), "remove the previous checkpoint")
    assert writer.wait(5)
    assert writer.dropped == ["remove the previous checkpoint"] and "must not run" not in order
    assert writer.failed_write == "second"
    failure = writer.take_failure()
    assert isinstance(failure, OSError) and writer.take_failure() is None
    assert [d for d, _ in writer.completed] == ["first"]


def test_waiting_for_a_write_is_bounded_when_asked():
    writer = BackgroundWriter()
    release = threading.Event()
    writer.submit(lambda: release.wait(10), "slow")
    started = time.monotonic()
    assert writer.wait_for_writes(0.2) is False
    assert time.monotonic() - started < 2
    release.set()
    assert writer.wait_for_writes(5) is True


def test_a_background_single_file_write_commits_only_when_complete(tmp_path):
    target = tmp_path / "step=2.ckpt"
    writer = BackgroundWriter()
    gate = threading.Event()

    def write(tmp):
        torch.save({"v": 1}, tmp)
        gate.wait(5)

    writer.submit(lambda: atomic_save(write, target), str(target))
    time.sleep(0.2)
    assert not target.exists()  # written under a temporary name until complete
    assert [p.name.startswith(".lit_parallel_partial_") for p in tmp_path.iterdir()] == [True]
    gate.set()
    assert writer.wait(5) and verify_checkpoint(target) == "file"
    assert torch.load(target, weights_only=True) == {"v": 1}


# --- SIGTERM while a write is pending ------------------------------------------------------------------------

_SIGNALLED = textwrap.dedent(
    """
    import sys, threading, time, torch
    sys.path.insert(0, {repo!r})
    from lit_parallel.checkpoint.write import atomic_save
    from lit_parallel.reliability.async_checkpoints import AsyncCheckpoints
    from lit_parallel.reliability.signals import SignalExit
    checkpoints = AsyncCheckpoints(True)
    handler = SignalExit(
        0, lambda signum, wait_s: "", before_exit=lambda: checkpoints.wait_on_signal({bound}),
        extra_wait_s={bound},
    )
    assert handler.install()
    def write(tmp):
        torch.save({{"v": 1}}, tmp)
        time.sleep({write_s})  # a write that is still running when the signal comes
    target = {target!r}
    checkpoints.submit(lambda: atomic_save(write, target), target)
    print("ready", flush=True)
    threading.Event().wait(120)  # the main thread blocks, as in a collective
    """
)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("write_s, bound, committed", [(1.5, 10.0, True), (60.0, 1.0, False)])
def test_sigterm_waits_for_a_pending_write_up_to_the_bound_then_says_what_happened(
    tmp_path, write_s, bound, committed
):
    target = tmp_path / "step=4.ckpt"
    code = _SIGNALLED.format(repo=str(REPO), bound=bound, write_s=write_s, target=str(target))
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "ready"
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    took = time.monotonic() - started
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert f"rank 0 (pid {proc.pid}) received SIGTERM: exiting with status 143; " in err
    if committed:
        assert f"for the background write of {target}: committed" in err, err
        assert verify_checkpoint(target) == "file"
    else:
        assert f"the background write of {target} did not finish within {bound:g} s: it is not saved" in err
        assert not target.exists()
        assert took < bound + 20  # bounded: it did not wait for the 60 s write


_EXITING = textwrap.dedent(
    """
    import sys, time, torch
    sys.path.insert(0, {repo!r})
    from lit_parallel.checkpoint.write import atomic_save
    from lit_parallel.reliability.async_checkpoints import AsyncCheckpoints
    checkpoints = AsyncCheckpoints(True)
    def write(tmp):
        time.sleep(1.0)  # still running when the script ends
        torch.save({{"v": 2}}, tmp)
    checkpoints.submit(lambda: atomic_save(write, {target!r}), {target!r})
    print("submitted", flush=True)
    """
)


@pytest.mark.timeout(60)
def test_the_process_exits_normally_only_after_its_pending_write(tmp_path):
    target = tmp_path / "manual.ckpt"  # e.g. trainer.save_checkpoint(...) after fit, at the end of a script
    code = _EXITING.format(repo=str(REPO), target=str(target))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert done.returncode == 0 and done.stdout.strip() == "submitted", done.stderr
    assert torch.load(target, weights_only=True) == {"v": 2}


def test_a_tensor_under_two_names_is_copied_once_as_torch_save_writes_it_once(tmp_path):
    embedding = torch.nn.Embedding(100, 16)
    head = torch.nn.Linear(16, 100, bias=False)
    head.weight = embedding.weight  # tied weights: one tensor, two state-dict names
    state = {
        "state_dict": {
            **{f"embed.{k}": v for k, v in embedding.state_dict().items()},
            "head.weight": head.weight,
        }
    }
    copy = HostCopy()
    staged = copy.stage(state)
    assert staged["state_dict"]["embed.weight"] is staged["state_dict"]["head.weight"]
    assert copy.nbytes == copy.allocated_bytes == 100 * 16 * 4
    torch.save(staged, tmp_path / "copy.pt")
    torch.save(state, tmp_path / "live.pt")
    # the tensor's bytes once in both files (a Parameter pickles a few more bytes than a tensor)
    copied, live = (tmp_path / "copy.pt").stat().st_size, (tmp_path / "live.pt").stat().st_size
    assert copied < 100 * 16 * 4 * 1.5 and abs(copied - live) < 256, (copied, live)
