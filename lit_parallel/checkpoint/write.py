"""Writing checkpoints without ever destroying what this package did not write.

A save writes under a temporary name next to its destination (``.lit_parallel_partial_*``) and renames it
into place when complete (:func:`commit`). Replacing what is at the destination is allowed only when it is a
checkpoint of the same kind, recognised by its exact structure (no marker file, so checkpoints written
before this rule, and Lightning's own, are recognised too):

- a single-file checkpoint replaces a ``torch.save`` archive (a zip file holding ``*/data.pkl``), an empty
  file or a symbolic link (the link is replaced, never what it points to);
- a sharded checkpoint replaces a folder holding DCP's ``.metadata``, Lightning's ``meta.pt`` and nothing
  but DCP shard files (``*.distcp``), or an empty folder.

Anything else at the destination raises :class:`ForeignDestinationError` naming the path, what is there and
the fix; nothing is deleted. ``overwrite=True`` (``lit-parallel consolidate --overwrite``) also lets a file
replace any file, never a folder.

A failed write raises :class:`CheckpointWriteError` naming the path and the cause in words (the disk is
full, read-only file system, permission denied), with torch's own error as ``__cause__``; the partial write
is removed and the destination is left as it was.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
import zipfile
from collections.abc import Callable
from pathlib import Path

DCP_METADATA = ".metadata"
# Lightning's file inside a sharded checkpoint: loops, callbacks, hyper-parameters, RNG states
LIGHTNING_META = "meta.pt"
PARTIAL_PREFIX = ".lit_parallel_partial_"

_CAUSES = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
}
_FIXES = {
    errno.ENOSPC: "free space on that file system or save elsewhere",
    errno.EDQUOT: "free space within your quota or save elsewhere",
    errno.EROFS: "save to a writable location",
    errno.EACCES: "save to a folder you may write to",
    errno.EPERM: "save to a folder you may write to",
}
# torch's zip writer reports a failed write without errno
_TORCH_WRITE_MARKERS = ("inline_container", "unexpected pos", "file write failed", "PytorchStreamWriter")
# below this much free space after a failed write, the file system is taken to be full
_FULL_BELOW = 64 * 2**20


class ForeignDestinationError(FileExistsError):
    """The destination holds something this package may not replace; nothing was deleted."""


class ForeignFolderError(ForeignDestinationError, IsADirectoryError):
    """The destination is a folder that is not a checkpoint of the kind being saved."""


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed; the message names the path and the cause, ``errno`` is set when known."""


def new_partial_path(destination: str | Path, token: str | None = None) -> Path:
    """Where a save to ``destination`` writes before it is complete: a hidden sibling whose name contains
    neither the destination's name nor its digits (Lightning numbers ``hpc_ckpt_N`` by listing the folder)."""
    token = token or uuid.uuid4().hex[:12]
    # the suffix gives torch.save's zip writer an archive name (it is the file name without its extension)
    return Path(destination).parent / f"{PARTIAL_PREFIX}{token}.tmp"


# --- what is at the destination ---------------------------------------------------------------------------


def _is_torch_archive(path: Path) -> bool:
    try:
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith("/data.pkl") for name in archive.namelist())
    except (zipfile.BadZipFile, OSError):
        return False


def _is_sharded_checkpoint_folder(path: Path) -> bool:
    names = {p.name: p for p in path.iterdir()}
    if DCP_METADATA not in names or LIGHTNING_META not in names:
        return False
    return all(
        p.is_file() and not p.is_symlink() and (n in (DCP_METADATA, LIGHTNING_META) or n.endswith(".distcp"))
        for n, p in names.items()
    )


def _describe(path: Path) -> str:
    if path.is_dir():
        entries = sorted(p.name for p in path.iterdir())
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        return f"a folder of {len(entries)} entries ({shown})"
    return f"a file of {path.stat().st_size} bytes"


def check_replaceable(destination: str | Path, kind: str = "file", *, overwrite: bool = False) -> None:
    """Raise :class:`ForeignDestinationError` unless a ``kind`` (``"file"`` or ``"sharded"``) checkpoint
    may be saved at ``destination``: nothing is there, or what is there may be replaced (module docstring)."""
    destination = Path(destination)
    if destination.is_symlink() or not destination.exists():
        return
    if destination.is_dir():
        if not any(destination.iterdir()) or (
            kind == "sharded" and _is_sharded_checkpoint_folder(destination)
        ):
            return
        what = "a sharded checkpoint" if _is_sharded_checkpoint_folder(destination) else "not a checkpoint"
        raise ForeignFolderError(
            f"cannot save a {_KIND_WORDS[kind]} to {str(destination)!r}: it is {_describe(destination)},"
            f" {what} of that kind; saving would replace it, so nothing was written or deleted. Choose a"
            " new path, or move that folder away yourself"
        )
    if kind == "file" and (overwrite or destination.stat().st_size == 0 or _is_torch_archive(destination)):
        return
    what = (
        "a checkpoint file"
        if _is_torch_archive(destination)
        else "not a checkpoint (not a torch.save archive)"
    )
    fix = (
        "pass overwrite=True (--overwrite) to replace it, or choose a new path"
        if kind == "file"
        else "choose a new path, or move that file away yourself"
    )
    raise ForeignDestinationError(
        f"cannot save a {_KIND_WORDS[kind]} to {str(destination)!r}: it is {_describe(destination)}, {what};"
        f" saving would replace it, so nothing was written or deleted. {fix[0].upper()}{fix[1:]}"
    )


_KIND_WORDS = {"file": "single-file checkpoint", "sharded": "sharded checkpoint (a folder)"}


# --- write errors in words --------------------------------------------------------------------------------


def _os_error_in(err: BaseException) -> OSError | None:
    seen: set[int] = set()
    todo: list[BaseException] = [err]
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e
        todo += [x for x in (e.__cause__, e.__context__) if x is not None]
        failures = getattr(e, "failures", None)  # DCP's CheckpointException: rank -> (exception, trace)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
            todo = [x for x in todo if isinstance(x, BaseException)]
    return None


def is_write_failure(err: BaseException) -> bool:
    """Whether ``err`` is a failed write (an ``OSError`` somewhere in it, or torch's zip writer failing)."""
    if isinstance(err, CheckpointWriteError):
        return False
    return _os_error_in(err) is not None or any(m in str(err) for m in _TORCH_WRITE_MARKERS)


def _probe(folder: Path) -> tuple[int | None, str]:
    """The likely cause of a write failure that carries no errno, from the file system's state."""
    try:
        stat = os.statvfs(folder)
    except OSError:
        return None, "the write failed"
    if stat.f_flag & os.ST_RDONLY:
        return errno.EROFS, _CAUSES[errno.EROFS]
    free = (stat.f_bfree if os.geteuid() == 0 else stat.f_bavail) * stat.f_frsize
    if free < _FULL_BELOW:
        return errno.ENOSPC, f"{_CAUSES[errno.ENOSPC]} ({free:,} bytes left on its file system)"
    if not os.access(folder, os.W_OK):
        return errno.EACCES, _CAUSES[errno.EACCES]
    return None, "the write failed"


def write_error(err: BaseException, destination: str | Path) -> CheckpointWriteError:
    """``err`` (a failed write of a checkpoint to ``destination``) as a :class:`CheckpointWriteError`.
    Call it before removing the partial write: a full disk is recognised by its free space."""
    destination = Path(destination)
    found = _os_error_in(err)
    if found is not None:
        code: int | None = found.errno
        cause = _CAUSES.get(code) or os.strerror(code)
        # a move (fsspec writes to a temporary file, then moves it) names the file it could not write second
        failed_at = getattr(found, "filename2", None) or getattr(found, "filename", None)
        where = f" (writing {failed_at})" if failed_at else ""
    else:
        code, cause = _probe(destination.parent if destination.parent.exists() else Path("."))
        where = ""
    fix = _FIXES.get(code, "see the error above") if code is not None else "see the error above"
    detail = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
    out = CheckpointWriteError(
        f"cannot write the checkpoint {str(destination)!r}: {cause}{where}. The partial write was removed"
        f" and what was at {str(destination)!r} before is untouched; {fix}. (torch said: {detail})"
    )
    out.errno = code
    return out


# --- writing ----------------------------------------------------------------------------------------------


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _replace(partial: Path, destination: Path) -> None:
    if destination.is_symlink() or (destination.is_file() and partial.is_file()):
        if destination.is_symlink() and partial.is_dir():
            destination.unlink()
        os.replace(partial, destination)
        return
    if not destination.exists():
        os.replace(partial, destination)
        return
    if destination.is_dir() and not any(destination.iterdir()):
        destination.rmdir()
        os.replace(partial, destination)
        return
    # a folder cannot atomically replace a folder: the old one is renamed aside first, so at every moment
    # the destination is the old complete checkpoint, absent, or the new complete one
    old = new_partial_path(destination)
    os.replace(destination, old)
    try:
        os.replace(partial, destination)
    except BaseException:
        os.replace(old, destination)
        raise
    _remove(old)


def commit(partial: str | Path, destination: str | Path, *, overwrite: bool = False) -> None:
    """Move a completely written ``partial`` (file or folder) to ``destination``, replacing only what
    :func:`check_replaceable` allows. On refusal or failure the partial is removed and the destination is
    left as it was."""
    partial, destination = Path(partial), Path(destination)
    try:
        check_replaceable(destination, "sharded" if partial.is_dir() else "file", overwrite=overwrite)
        _replace(partial, destination)
    except OSError as err:
        translated = None if isinstance(err, ForeignDestinationError) else write_error(err, destination)
        _remove(partial)
        if translated is None:
            raise
        raise translated from err
    except BaseException:
        _remove(partial)
        raise


def atomic_save(write: Callable[[Path], None], destination: str | Path, *, overwrite: bool = False) -> None:
    """Call ``write(tmp_path)`` (a single file) then rename the result to ``destination`` (:func:`commit`).
    A failed write raises :class:`CheckpointWriteError`; the destination is left as it was."""
    destination = Path(destination)
    check_replaceable(destination, "file", overwrite=overwrite)
    try:
        destination.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise write_error(err, destination) from err
    partial = new_partial_path(destination)
    try:
        write(partial)
    except BaseException as err:
        translated = write_error(err, destination) if is_write_failure(err) else None
        _remove(partial)
        if translated is None:
            raise
        raise translated from err
    commit(partial, destination, overwrite=overwrite)
