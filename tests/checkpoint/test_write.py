"""Writing checkpoints never destroys what the package did not write; write errors name the path and cause."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lit_parallel.checkpoint.convert import consolidate
from lit_parallel.checkpoint.load import IncompleteCheckpointError, NotACheckpointError, verify_checkpoint
from lit_parallel.checkpoint.write import (
    CheckpointWriteError,
    ForeignDestinationError,
    atomic_save,
    commit,
    new_partial_path,
)
from lit_parallel.commands import cli

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

WEIGHTS = {"model.w": torch.arange(12.0).reshape(3, 4), "model.b": torch.ones(3)}


def _sharded(path: Path) -> None:
    dcp.save({"state_dict": {k: v.clone() for k, v in WEIGHTS.items()}}, checkpoint_id=path, no_dist=True)
    torch.save({"epoch": 1, "global_step": 4}, path / "meta.pt")


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _no_partials(folder: Path) -> bool:
    return not any(p.name.startswith(".lit_parallel_partial_") for p in folder.iterdir())


def _consolidate_cli(*args: str) -> int:
    return cli.main(["consolidate", *args])


# --- consolidate ------------------------------------------------------------------------------------------


def test_consolidate_into_a_folder_with_other_files_is_refused_and_nothing_deleted(tmp_path, capsys):
    _sharded(tmp_path / "ckpt")
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "notes.txt").write_text("mine")
    (runs / "sub").mkdir()
    (runs / "sub" / "data.bin").write_bytes(b"\x00" * 10)
    before = _tree(runs)
    for extra in ([], ["--overwrite"], ["--lightning"], ["--lightning", "--overwrite"]):
        assert _consolidate_cli(str(tmp_path / "ckpt"), str(runs), *extra) == 2
        err = capsys.readouterr().err
        assert f"{str(runs)!r} is an existing folder" in err and "never replaces a folder" in err
    assert _tree(runs) == before and _no_partials(tmp_path)


def test_consolidate_into_its_own_source_or_a_subfolder_is_refused(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    _sharded(ckpt)
    before = _tree(ckpt)
    for out in (ckpt, ckpt / "model.pt", ckpt / "sub" / "model.pt"):
        for extra in ([], ["--overwrite"], ["--lightning"]):
            assert _consolidate_cli(str(ckpt), str(out), *extra) == 2
            assert "is the checkpoint" in capsys.readouterr().err
    assert _tree(ckpt) == before
    assert verify_checkpoint(ckpt) == "sharded"


def test_an_existing_output_needs_overwrite_and_then_is_replaced(tmp_path, capsys):
    _sharded(tmp_path / "ckpt")
    out = tmp_path / "model.pt"
    out.write_text("an earlier export, not a checkpoint")
    assert _consolidate_cli(str(tmp_path / "ckpt"), str(out)) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and "--overwrite" in err
    assert out.read_text() == "an earlier export, not a checkpoint"
    assert _consolidate_cli(str(tmp_path / "ckpt"), str(out), "--overwrite") == 0
    state = torch.load(out, weights_only=True)
    assert set(state) == set(WEIGHTS) and all(torch.equal(state[k], WEIGHTS[k]) for k in WEIGHTS)
    with pytest.raises(ForeignDestinationError, match="already exists"):
        consolidate(tmp_path / "ckpt", out)
    assert _no_partials(tmp_path)


# --- commit / atomic_save ----------------------------------------------------------------------------------


def _partial_file(destination: Path, value: int) -> Path:
    partial = new_partial_path(destination)
    torch.save({"v": value}, partial)
    return partial


def test_commit_over_a_foreign_file_or_folder_is_refused(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    partial = _partial_file(notes, 1)
    with pytest.raises(
        ForeignDestinationError, match=r"notes\.txt.*not a checkpoint.*nothing was written or del"
    ):
        commit(partial, notes)
    assert notes.read_text() == "mine" and not partial.exists()

    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "a.csv").write_text("1,2")
    for make in ("file", "folder"):
        partial = _partial_file(folder, 2) if make == "file" else new_partial_path(folder)
        if make == "folder":
            _sharded(partial)
        with pytest.raises(IsADirectoryError, match=r"results.*a folder of 1 entries \(a\.csv\)"):
            commit(partial, folder)
        assert _tree(folder) == {"a.csv": b"1,2"} and not partial.exists()

    # a sharded checkpoint folder is not replaced by a single file, nor a file by a folder
    ckpt = tmp_path / "sharded.ckpt"
    _sharded(ckpt)
    with pytest.raises(ForeignDestinationError, match="a sharded checkpoint of that kind|not a checkpoint"):
        commit(_partial_file(ckpt, 3), ckpt)
    assert verify_checkpoint(ckpt) == "sharded"
    single = tmp_path / "single.ckpt"
    torch.save({"v": 0}, single)
    partial = new_partial_path(single)
    _sharded(partial)
    with pytest.raises(ForeignDestinationError, match="single.ckpt"):
        commit(partial, single)
    assert torch.load(single, weights_only=True) == {"v": 0} and _no_partials(tmp_path)


def test_commit_replaces_a_checkpoint_of_the_same_kind(tmp_path):
    single = tmp_path / "last.ckpt"
    atomic_save(lambda tmp: torch.save({"v": 1}, tmp), single)
    atomic_save(lambda tmp: torch.save({"v": 2}, tmp), single)
    assert torch.load(single, weights_only=True) == {"v": 2}

    ckpt = tmp_path / "epoch=1.ckpt"
    _sharded(ckpt)
    partial = new_partial_path(ckpt)
    dcp.save({"state_dict": {"model.w": torch.zeros(2)}}, checkpoint_id=partial, no_dist=True)
    torch.save({"epoch": 2}, partial / "meta.pt")
    commit(partial, ckpt)
    assert torch.load(ckpt / "meta.pt", weights_only=True) == {"epoch": 2}
    assert verify_checkpoint(ckpt) == "sharded" and _no_partials(tmp_path)


# --- write errors ----------------------------------------------------------------------------------------


def test_a_full_disk_names_the_path_and_the_cause_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    target = tmp_path / "last.ckpt"
    atomic_save(lambda tmp: torch.save({"v": 1}, tmp), target)
    before = target.read_bytes()

    real_open = open

    def full_disk_open(file, mode="r", *args, **kwargs):  # the lowest write call torch.save makes from Python
        handle = real_open(file, mode, *args, **kwargs)
        if "w" in mode and Path(file).name.startswith(".lit_parallel_partial_"):
            handle.write(b"PK\x03\x04 half")  # some bytes land before the disk fills
            handle.close()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(file))
        return handle

    def save(tmp):
        with open(tmp, "wb") as f:
            torch.save({"v": 2}, f)

    monkeypatch.setattr("builtins.open", full_disk_open)
    with pytest.raises(CheckpointWriteError) as info:
        atomic_save(save, target)
    monkeypatch.undo()
    message = str(info.value)
    assert f"cannot write the checkpoint {str(target)!r}: the disk is full" in message
    assert info.value.errno == errno.ENOSPC and isinstance(info.value.__cause__, OSError)
    assert target.read_bytes() == before and _no_partials(tmp_path)


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (errno.EROFS, "read-only file system"),
        (errno.EACCES, "permission denied"),
        (errno.EIO, os.strerror(errno.EIO)),
    ],
)
def test_write_errors_are_named_in_words(tmp_path, code, words):
    target = tmp_path / "model.pt"

    def fail(tmp):
        raise OSError(code, os.strerror(code))

    with pytest.raises(CheckpointWriteError, match=rf"{target.name}'?: {words}"):
        atomic_save(fail, target)
    assert not target.exists() and _no_partials(tmp_path)


def test_a_failed_move_names_the_file_on_the_full_disk_not_the_temporary_source(tmp_path):
    """fsspec saves through a temporary file and moves it; the error must name where the move wrote to."""
    target = tmp_path / "model.pt"

    def fail(tmp):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/tmp/tmpabc", None, str(tmp))

    with pytest.raises(CheckpointWriteError) as info:
        atomic_save(fail, target)
    message = str(info.value)
    assert "the disk is full (writing " in message and str(tmp_path) in message.split("writing ")[1]
    assert "/tmp/tmpabc" not in message.split(". The partial")[0]


def test_torch_zip_writer_errors_are_translated(tmp_path, monkeypatch):
    """torch's zip writer fails without errno ('unexpected pos', inline_container.cc): the cause is read from
    the file system (here: statvfs says no space is left)."""
    target = tmp_path / "model.pt"
    torch.save({"v": 1}, target)
    monkeypatch.setattr(
        torch.serialization,
        "_open_zipfile_writer",
        lambda *a, **k: (_ for _ in ()).throw(
            RuntimeError("[enforce fail at inline_container.cc:747] . unexpected pos 281728 vs 281616")
        ),
    )
    real = os.statvfs

    class _Full:
        def __init__(self, s):
            self.f_flag, self.f_frsize, self.f_bfree, self.f_bavail = s.f_flag, s.f_frsize, 0, 0

    monkeypatch.setattr(os, "statvfs", lambda p: _Full(real(p)))
    with pytest.raises(CheckpointWriteError, match="the disk is full") as info:
        consolidate_target = tmp_path / "other.pt"
        atomic_save(lambda tmp: torch.save({"v": 2}, tmp), consolidate_target)
    assert "inline_container" in str(info.value.__cause__) and not consolidate_target.exists()
    assert torch.load(target, weights_only=True) == {"v": 1} and _no_partials(tmp_path)


def test_a_file_that_is_not_a_checkpoint_is_called_that(tmp_path):
    noise = tmp_path / "noise.ckpt"
    noise.write_bytes(bytes(range(256)) * 4)
    text = tmp_path / "notes.ckpt"
    text.write_text("hello, this is a text file\n")
    for path in (noise, text):
        with pytest.raises(NotACheckpointError, match="is not a checkpoint \\(not a torch.save zip file"):
            verify_checkpoint(path)
    torch.save({"w": torch.randn(100)}, tmp_path / "cut.ckpt")
    data = (tmp_path / "cut.ckpt").read_bytes()
    (tmp_path / "cut.ckpt").write_bytes(data[: len(data) // 2])
    with pytest.raises(IncompleteCheckpointError, match="did not finish"):
        verify_checkpoint(tmp_path / "cut.ckpt")
