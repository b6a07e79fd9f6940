"""Reading checkpoints safely: verify that one is complete before loading it, and load it without
unpickling code.

Every lit_parallel strategy writes a checkpoint under a temporary name next to its destination
(``.lit_parallel_partial_*``, :mod:`~lit_parallel.checkpoint.write`) and renames it into place only when it
is complete; inside a sharded checkpoint DCP's ``.metadata`` is the last file written.
:func:`verify_checkpoint` names what an incomplete checkpoint lacks. Loading never unpickles code: files
load with ``torch.load(weights_only=True)``, DCP's ``.metadata`` with an unpickler that accepts only DCP's
own metadata classes. Sharded checkpoints (``fsdp_blocks`` / ``hsdp`` / ``tp_dp`` / ``pp_dp``: a folder with
one file per rank plus ``.metadata`` and Lightning's ``meta.pt``) load on any number of ranks as they are
(resharding happens on load).
"""

from __future__ import annotations

import io
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from lit_parallel import _compat
from lit_parallel.checkpoint.write import DCP_METADATA, LIGHTNING_META, PARTIAL_PREFIX


class IncompleteCheckpointError(ValueError):
    """A checkpoint lacks a file or holds a truncated one (an interrupted save); the message names what."""


class NotACheckpointError(ValueError):
    """A path holds something that is not a checkpoint at all (random bytes, a text file)."""


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint's index refers to code; it is not loaded."""


# --- loading without executing pickled code -------------------------------------------------------------


def _allowed_metadata_globals() -> set[Any]:
    from torch.distributed.checkpoint import metadata

    return {
        metadata.Metadata,
        metadata.MetadataIndex,
        metadata.TensorStorageMetadata,
        metadata.BytesStorageMetadata,
        metadata.ChunkStorageMetadata,
        metadata.TensorProperties,
        metadata.StorageMeta,
        _compat.MEM_FORMAT_ENCODING,
        _compat.StorageInfo,
        torch.Size,
        _compat.get_layout,
        Path,
        type(Path()),
        # containers and scalars pickled by reference
        dict,
        list,
        tuple,
        set,
        frozenset,
        __import__("collections").OrderedDict,
    }


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata``: only DCP's metadata dataclasses, sizes, dtypes and paths."""

    def __init__(self, file, source: str):
        super().__init__(file)
        self._source = source
        self._allowed = _allowed_metadata_globals()

    def find_class(self, module: str, name: str) -> Any:
        obj = super().find_class(module, name)
        if obj in self._allowed or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
            return obj
        raise UnsafeCheckpointError(
            f"{self._source} refers to {module}.{name}, which is not part of a torch.distributed.checkpoint"
            " index; refusing to load it (loading a checkpoint never executes pickled code)"
        )


def read_dcp_metadata(checkpoint_dir: str | Path):
    """DCP's ``.metadata`` of a sharded checkpoint, read without executing pickled code."""
    path = Path(checkpoint_dir) / DCP_METADATA
    with open(path, "rb") as f:
        return _MetadataUnpickler(f, str(path)).load()


# Where a sharded Lightning checkpoint keeps the model's weights: "state_dict" (ModelParallelStrategy and every
# lit_parallel strategy) or "model" (Lightning's FSDPStrategy, FSDP1, with state_dict_type="sharded"). The
# optimizer states are "optimizer_<i>" in both, keyed by parameter name.
MODEL_ENTRIES = ("state_dict", "model")


def model_entry(checkpoint_dir: str | Path) -> str:
    """The top-level entry of a sharded Lightning checkpoint that holds the model's weights (one of
    :data:`MODEL_ENTRIES`), read from DCP's index."""
    names = read_dcp_metadata(checkpoint_dir).state_dict_metadata
    entries = {name.split(".", 1)[0] for name in names}
    for entry in MODEL_ENTRIES:
        if entry in entries:
            return entry
    raise ValueError(
        f"sharded checkpoint {str(checkpoint_dir)!r} holds no model weights: its entries are"
        f" {sorted(entries)}, where a Lightning checkpoint has 'state_dict' (ModelParallelStrategy, lit_parallel)"
        " or 'model' (Lightning's FSDPStrategy); read it with lit_parallel.checkpoint.load_sharded"
    )


def load_lightning_meta(checkpoint_dir: str | Path) -> dict[str, Any]:
    """Lightning's ``meta.pt`` of a sharded checkpoint (loops, callbacks, RNG states), onto the CPU.

    Rank 0 writes it with tensors where they were (a callback's score on ``cuda:0``); loading them where
    they were would put every rank's copy on rank 0's device. On the CPU they cost no device memory, and
    Lightning and the callbacks move what they use."""
    return torch.load(Path(checkpoint_dir) / LIGHTNING_META, map_location="cpu", weights_only=True)


def _weights_only_load(value: io.BytesIO, what: str) -> Any:
    try:
        # a non-tensor entry may still hold tensors, saved on the device they were on (see load_lightning_meta)
        return torch.load(value, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise pickle.UnpicklingError(
            f"checkpoint entry {what!r} holds an object that torch.load(weights_only=True) refuses: {err}"
        ) from None


def _safe_reader(path: Path):
    from torch.distributed.checkpoint import FileSystemReader

    class _SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            from torch.distributed.checkpoint.metadata import StorageMeta

            if kwargs.get("rank") is not None:
                raise ValueError("per-rank DCP metadata files are not supported")
            metadata = read_dcp_metadata(self.path)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return _SafeFileSystemReader(path)


def _weights_only_planner(base: type) -> type:
    """``base`` (a DCP load planner) whose non-tensor entries load with ``weights_only=True`` (DCP's own
    planners unpickle them with ``weights_only=False``)."""

    class _Planner(base):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            obj = _weights_only_load(value, fqn)
            if self.flatten_state_dict:
                _compat.set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    _Planner.__name__ = f"WeightsOnly{base.__name__}"
    return _Planner


def dcp_load(state: dict, checkpoint_dir: str | Path) -> None:
    """``torch.distributed.checkpoint.load`` of ``state`` (in place) that never executes pickled code."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner

    path = Path(checkpoint_dir)
    dcp.load(state, storage_reader=_safe_reader(path), planner=_weights_only_planner(DefaultLoadPlanner)())


# --- integrity ------------------------------------------------------------------------------------------


def partial_saves_near(path: str | Path) -> list[Path]:
    """Temporary folders/files of interrupted saves in ``path``'s folder."""
    parent = Path(path).parent
    if not parent.is_dir():
        return []
    return sorted(p for p in parent.iterdir() if p.name.startswith(PARTIAL_PREFIX))


_ZIP_MAGIC = b"PK\x03\x04"


def _raise_for_bad_file(path: Path, size: int) -> None:
    """A file without a zip index: a torch.save archive cut short, or not a checkpoint at all."""
    with open(path, "rb") as f:
        head = f.read(8)
    if size == 0 or head.startswith(_ZIP_MAGIC):
        raise IncompleteCheckpointError(
            f"checkpoint file {str(path)!r} ({size} bytes) is truncated or not a torch.save archive"
            " (its zip index is missing: the save that wrote it did not finish)"
        )
    raise NotACheckpointError(
        f"{str(path)!r} ({size} bytes) is not a checkpoint (not a torch.save zip file: it starts with"
        f" {head!r}, where a torch.save archive starts with {_ZIP_MAGIC!r}); pass the path of a checkpoint"
        " file or of a sharded checkpoint folder"
    )


def verify_checkpoint(path: str | Path, *, lightning: bool = True) -> str:
    """Check that ``path`` is a complete checkpoint; return ``"sharded"`` or ``"file"``.

    Raises :class:`IncompleteCheckpointError` naming every missing or truncated file (a sharded folder needs
    DCP's ``.metadata`` and every shard file the index lists, each at least as long as the data it must
    hold, plus Lightning's ``meta.pt`` when ``lightning``; a single file must be a complete ``torch.save``
    archive), :class:`NotACheckpointError` for a file that is no ``torch.save`` archive at all (random
    bytes, a text file) and ``FileNotFoundError`` when nothing is at ``path``.
    """
    path = Path(path)
    if not path.exists():
        partial = partial_saves_near(path)
        hint = (
            f"; {len(partial)} interrupted save(s) left temporary data next to it ({partial[0].name}, ...),"
            " which is never used as a checkpoint"
            if partial
            else ""
        )
        raise FileNotFoundError(f"no checkpoint at {str(path)!r}{hint}")
    if path.is_file():
        size = path.stat().st_size
        if not zipfile.is_zipfile(path):
            _raise_for_bad_file(path, size)
        return "file"
    missing: list[str] = []
    if lightning and not (path / LIGHTNING_META).is_file():
        missing.append(f"{LIGHTNING_META} (Lightning's loop, callback and RNG state)")
    if not (path / DCP_METADATA).is_file():
        missing.append(f"{DCP_METADATA} (the DCP index, written last: the save did not finish)")
    else:
        try:
            metadata = read_dcp_metadata(path)
        except UnsafeCheckpointError:
            raise
        except (EOFError, pickle.UnpicklingError, AttributeError, ValueError) as err:
            raise IncompleteCheckpointError(
                f"sharded checkpoint {str(path)!r}: its {DCP_METADATA} cannot be read ({err})"
            ) from None
        needed: dict[str, int] = {}
        for info in (metadata.storage_data or {}).values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
        for name, length in sorted(needed.items()):
            f = path / name
            if not f.is_file():
                missing.append(f"{name} (a shard file listed in {DCP_METADATA})")
            elif f.stat().st_size < length:
                missing.append(f"{name} is truncated: {f.stat().st_size} of at least {length} bytes")
    if missing:
        raise IncompleteCheckpointError(
            f"sharded checkpoint {str(path)!r} is incomplete: missing " + "; ".join(missing)
        )
    return "sharded"


def load_sharded(checkpoint_dir: str | Path, keys: set[str] | None = None) -> dict:
    """Read a sharded checkpoint into one process, unsharded (no process group needed).

    Args:
        keys: top-level entries to read (e.g. ``{"state_dict"}``); ``None`` reads everything.
    """
    path = Path(checkpoint_dir)
    if path.is_file() or (path.is_dir() and not any(path.iterdir())):
        raise ValueError(
            f"{str(path)!r} is not a sharded checkpoint (a folder with a {DCP_METADATA} file written by"
            " torch.distributed.checkpoint, as saved by fsdp_blocks / hsdp / ModelParallelStrategy)"
        )
    verify_checkpoint(path, lightning=False)  # names what an interrupted save left out
    state: dict = {}
    _compat.load_state_dict(
        state,
        storage_reader=_safe_reader(path),
        # the planner of torch's own dcp_to_torch_save: it builds the state dict from the metadata, so
        # nothing has to be allocated beforehand
        planner=_weights_only_planner(_compat.EmptyStateDictLoadPlanner)(keys=keys),
        no_dist=True,
    )
    return state
