"""Automatic recovery: ``kill -9`` of a rank under ``torchrun --max-restarts``, for every
strategy, and ``auto_resume=True`` choosing the newest complete checkpoint.

One launch: torchrun, 2 ranks, ``--max-restarts=5``, the strategies creating the process group themselves
(see tests/scenarios/recovery.py). Expected values are computed independently: the same program run
uninterrupted in the last attempt. Unit tests (no process group) cover the checkpoint search.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lit_parallel.checkpoint.load import PARTIAL_PREFIX
from lit_parallel.reliability.resume import checkpoint_candidates, newest_complete_checkpoint
from tests.harness import launch
from tests.scenarios.recovery import KILL_AT_STEP, LAST_ATTEMPT, STRATEGIES

SC = "tests.scenarios.recovery"


def _bitwise_state(got: dict, expected: dict, what: str) -> None:
    assert set(got) == set(expected), f"{what}: keys differ"
    for k, v in expected.items():
        assert torch.equal(got[k], v), f"{what}: {k} is not bitwise equal"


@pytest.fixture(scope="module")
def recovered(tmp_path_factory):
    root = tmp_path_factory.mktemp("recovery")
    data = root / "data"
    data.mkdir()
    res = launch(
        [f"{SC}:recover_after_kill", f"{SC}:auto_resume_skips_a_truncated_checkpoint"],
        2,
        root,
        args={"dir": str(data)},
        timeout=1100,
        max_restarts=LAST_ATTEMPT,
        worker_group=False,
    )
    return res


@pytest.mark.multiprocess
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", STRATEGIES)
def test_rank_killed_mid_epoch_restarts_under_torchrun_and_ends_bitwise_equal(recovered, name):
    outs = [r[name] for r in recovered.scenario("recover_after_kill")]
    # every attempt before the last one was killed: torchrun restarted all ranks each time
    assert [r["attempt"] for r in recovered.scenario("recover_after_kill")] == [LAST_ATTEMPT] * 2
    index = STRATEGIES.index(name)
    for rank, out in enumerate(outs):
        reference = out["reference"]
        # exactly one attempt trained this strategy after the kill: the one after the attempt that killed it
        (trained,) = out["trained"]
        assert trained["attempt"] == index + 1, (rank, trained["attempt"])
        assert trained["resumed_from"].endswith(f"{name}/last.ckpt")
        # the last checkpoint before the kill is at step KILL_AT_STEP - 1: the rest of the run is retrained
        assert len(trained["losses"]) == len(reference["losses"]) - (KILL_AT_STEP - 1)
        assert trained["losses"] == reference["losses"][KILL_AT_STEP - 1 :], f"rank {rank}: losses differ"
    _bitwise_state(outs[0]["model"], outs[0]["reference"]["model"], f"{name} final parameters")


@pytest.mark.multiprocess
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", ["ddp_tuned", "fsdp_blocks"])
def test_auto_resume_skips_a_truncated_newest_checkpoint_and_resumes_bitwise(recovered, name):
    outs = recovered.scenario("auto_resume_skips_a_truncated_checkpoint")
    reference = recovered.scenario("recover_after_kill")
    out = outs[0][name]
    assert out["resumed_from"].endswith("epoch=0-step=2.ckpt"), out["resumed_from"]
    assert out["truncated"].endswith("epoch=0-step=4.ckpt")
    skipped = [m for m in out["log"] if m.startswith("auto_resume: skipping the newer checkpoint")]
    assert len(skipped) == 1 and "epoch=0-step=4.ckpt" in skipped[0]
    assert "truncated" in skipped[0]
    assert any(m.startswith("auto_resume: resuming from") and "step=2" in m for m in out["log"])
    for rank, r in enumerate(outs):
        ref_losses = reference[rank][name]["reference"]["losses"]
        assert r[name]["losses"] == ref_losses[2:], f"rank {rank}: losses after auto_resume differ"
    _bitwise_state(out["model"], reference[0][name]["reference"]["model"], f"{name} after auto_resume")


# --- the checkpoint search (no process group) ------------------------------------------------------------


def _save(path: Path, mtime: int, value: float = 1.0) -> Path:
    torch.save({"state_dict": {"w": torch.tensor([value])}, "global_step": int(value)}, path)
    os.utime(path, ns=(mtime, mtime))
    return path


def test_newest_complete_checkpoint_is_chosen_by_time_and_a_truncated_newer_one_is_skipped(tmp_path):
    old = _save(tmp_path / "epoch=0-step=2.ckpt", 1_000_000_000, 2.0)
    newer = _save(tmp_path / "epoch=0-step=4.ckpt", 2_000_000_000, 4.0)
    newest = _save(tmp_path / "last.ckpt", 3_000_000_000, 6.0)
    assert checkpoint_candidates([tmp_path]) == [newest, newer, old]
    assert newest_complete_checkpoint([tmp_path]) == (newest, [])
    size = newest.stat().st_size
    with open(newest, "r+b") as f:
        f.truncate(size // 2)
    os.utime(newest, ns=(3_000_000_000, 3_000_000_000))
    chosen, skipped = newest_complete_checkpoint([tmp_path])
    assert chosen == newer
    assert [p for p, _ in skipped] == [newest]
    assert "truncated" in skipped[0][1] and str(newest) in skipped[0][1]


def test_random_bytes_partial_saves_other_files_and_missing_folders_are_never_chosen(tmp_path):
    good = _save(tmp_path / "a.ckpt", 1_000_000_000)
    junk = tmp_path / "z.ckpt"
    junk.write_bytes(os.urandom(64))
    os.utime(junk, ns=(5_000_000_000, 5_000_000_000))
    partial = tmp_path / f"{PARTIAL_PREFIX}abc_last.ckpt"
    partial.mkdir()
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    chosen, skipped = newest_complete_checkpoint([tmp_path / "missing", tmp_path, tmp_path])
    assert chosen == good
    assert [p for p, _ in skipped] == [junk, partial] and "is not a checkpoint" in skipped[0][1]
    # an interrupted save is reported by name, never chosen
    assert "interrupted save" in skipped[1][1] and partial.name in skipped[1][1]


def test_an_interrupted_save_older_than_the_chosen_checkpoint_is_not_reported(tmp_path):
    partial = tmp_path / f"{PARTIAL_PREFIX}old.tmp"
    partial.write_bytes(b"PK half")
    os.utime(partial, ns=(1_000_000_000, 1_000_000_000))
    good = _save(tmp_path / "step=2.ckpt", 2_000_000_000)
    assert newest_complete_checkpoint([tmp_path]) == (good, [])


def test_a_sharded_folder_without_its_index_is_skipped(tmp_path):
    good = _save(tmp_path / "step=2.ckpt", 1_000_000_000)
    sharded = tmp_path / "step=4.ckpt"
    sharded.mkdir()
    torch.save({"epoch": 0}, sharded / "meta.pt")
    (sharded / "__0_0.distcp").write_bytes(b"\0" * 16)
    os.utime(sharded, ns=(2_000_000_000, 2_000_000_000))
    chosen, skipped = newest_complete_checkpoint([tmp_path], extensions=(".ckpt",))
    assert chosen == good
    assert skipped[0][0] == sharded and ".metadata" in skipped[0][1]


def test_nothing_to_resume_from(tmp_path):
    assert newest_complete_checkpoint([tmp_path, tmp_path / "missing"]) == (None, [])
