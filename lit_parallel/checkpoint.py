"""Checkpoints that are safe to write, verify and load; sharded <-> full conversion.

``fsdp_blocks`` / ``hsdp`` / ``tp_dp`` save sharded checkpoints (``torch.distributed.checkpoint``: a folder
with one file per rank plus ``.metadata`` and Lightning's ``meta.pt``). They load on any number of ranks as
they are (resharding happens on load). :func:`consolidate` turns one into a single full ``state_dict`` file
that plain PyTorch loads without Lightning or a process group::

    lit-parallel consolidate checkpoints/epoch=3 model.pt --strip-prefix model.

    state = torch.load("model.pt", weights_only=True)
    my_model.load_state_dict(state)

:func:`consolidate_checkpoint` writes a full *Lightning* checkpoint instead (weights, optimizer state keyed by
parameter index, loops, RNG states): ``Trainer(strategy="ddp_tuned").fit(..., ckpt_path=that_file)`` resumes
a run that was saved by ``fsdp_blocks``.

Integrity: every lit_parallel strategy writes a checkpoint under a temporary name next to its destination
(``.lit_parallel_partial_*``) and renames it into place only when it is complete; inside a sharded
checkpoint DCP's ``.metadata`` is the last file written. :func:`verify_checkpoint` names what an incomplete
checkpoint lacks. Loading never unpickles code: files load with ``torch.load(weights_only=True)``, DCP's
``.metadata`` with an unpickler that accepts only DCP's own metadata classes.
"""

from __future__ import annotations

import argparse
import io
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from lit_parallel import _compat
from lit_parallel.checkpoint_writes import (  # noqa: F401  (re-exported: the writing half of this module)
    _METADATA,
    LIGHTNING_META,
    PARTIAL_PREFIX,
    CheckpointWriteError,
    ForeignDestinationError,
    atomic_save,
    check_replaceable,
    commit,
    new_partial_path,
)


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
    path = Path(checkpoint_dir) / _METADATA
    with open(path, "rb") as f:
        return _MetadataUnpickler(f, str(path)).load()


def _weights_only_load(value: io.BytesIO, what: str) -> Any:
    try:
        return torch.load(value, weights_only=True)
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
    if not (path / _METADATA).is_file():
        missing.append(f"{_METADATA} (the DCP index, written last: the save did not finish)")
    else:
        try:
            metadata = read_dcp_metadata(path)
        except UnsafeCheckpointError:
            raise
        except (EOFError, pickle.UnpicklingError, AttributeError, ValueError) as err:
            raise IncompleteCheckpointError(
                f"sharded checkpoint {str(path)!r}: its {_METADATA} cannot be read ({err})"
            ) from None
        needed: dict[str, int] = {}
        for info in (metadata.storage_data or {}).values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
        for name, length in sorted(needed.items()):
            f = path / name
            if not f.is_file():
                missing.append(f"{name} (a shard file listed in {_METADATA})")
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
            f"{str(path)!r} is not a sharded checkpoint (a folder with a {_METADATA} file written by"
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


def consolidate(
    checkpoint_dir: str | Path,
    output: str | Path,
    *,
    key: str = "state_dict",
    strip_prefix: str | None = None,
    overwrite: bool = False,
) -> dict[str, torch.Tensor]:
    """Convert a sharded checkpoint into one full ``state_dict`` file (``torch.save``, plain tensors).

    Args:
        checkpoint_dir: the sharded checkpoint folder.
        output: file to write; loads with ``torch.load(output, weights_only=True)``.
        key: the entry holding the model weights (Lightning: ``"state_dict"``); ``""`` takes every tensor.
        strip_prefix: keep only keys starting with it, without it (``"model."`` turns LightningModule keys
            into those of the ``nn.Module`` stored as ``self.model``).
        overwrite: replace an existing file at ``output`` (never a folder); without it an existing
            ``output`` is refused. ``output`` may never be ``checkpoint_dir`` or inside it.

    Returns the state dict written.
    """
    check_output(checkpoint_dir, output, overwrite=overwrite)
    raw = load_sharded(checkpoint_dir, keys={key} if key else None)
    if key:
        if key not in raw:
            raise ValueError(f"the checkpoint has no {key!r} entry; pass key= one of {sorted(raw)} or ''")
        raw = raw[key]
    state = {k: v for k, v in _flatten(raw).items() if isinstance(v, torch.Tensor)}
    if strip_prefix:
        kept = {k[len(strip_prefix) :]: v for k, v in state.items() if k.startswith(strip_prefix)}
        if not kept:
            sample = ", ".join(sorted(state)[:5])
            raise ValueError(f"no key starts with strip_prefix={strip_prefix!r}; keys look like: {sample}")
        state = kept
    state = {k: v.detach().contiguous().clone() for k, v in state.items()}
    atomic_save(lambda tmp: torch.save(state, tmp), output, overwrite=overwrite)
    return state


def check_output(checkpoint_dir: str | Path, output: str | Path, *, overwrite: bool = False) -> None:
    """Refuse a conversion's ``output`` that is ``checkpoint_dir`` or inside it, a folder, or an existing
    file without ``overwrite``: converting never destroys its source or anything it did not write."""
    source, out = Path(checkpoint_dir), Path(output)
    if source.exists() and (out.resolve() == source.resolve() or source.resolve() in out.resolve().parents):
        raise ValueError(
            f"the output {str(out)!r} is the checkpoint {str(source)!r} itself or inside it: writing there would"
            " destroy the checkpoint being converted; choose a path outside it"
        )
    if out.is_dir() and not out.is_symlink():
        raise ForeignDestinationError(
            f"the output {str(out)!r} is an existing folder: a conversion writes one file and never replaces a"
            f" folder (even with --overwrite); choose a file path, e.g. {str(out / 'model.pt')!r}"
        )
    if (out.exists() or out.is_symlink()) and not overwrite:
        raise ForeignDestinationError(
            f"the output {str(out)!r} already exists ({out.stat().st_size if out.exists() else 0} bytes);"
            " pass --overwrite (overwrite=True) to replace it, or choose another path"
        )


def consolidate_checkpoint(
    checkpoint_dir: str | Path, output: str | Path, *, overwrite: bool = False
) -> dict[str, Any]:
    """Convert a sharded *Lightning* checkpoint into one full Lightning checkpoint file.

    The file holds the full weights (``state_dict``), every optimizer's state keyed by parameter index as
    ``torch.optim.Optimizer.state_dict()`` writes it (``optimizer_states``), and everything else the sharded
    checkpoint's ``meta.pt`` holds (loops, callbacks, learning-rate schedulers, RNG states). Resume from it
    with any strategy that loads full checkpoints, e.g. ``Trainer(strategy="ddp_tuned").fit(...,
    ckpt_path=output)``: a run saved by ``fsdp_blocks`` continues under DDP with the same model and optimizer
    state. The optimizer's parameter order must be the LightningModule's (``configure_optimizers`` built
    from ``self.parameters()``), as for any optimizer state dict.

    ``output`` rules as :func:`consolidate` (``overwrite``). Returns the checkpoint written.
    """
    check_output(checkpoint_dir, output, overwrite=overwrite)
    checkpoint = full_checkpoint(checkpoint_dir)
    atomic_save(lambda tmp: torch.save(checkpoint, tmp), output, overwrite=overwrite)
    return checkpoint


def full_checkpoint(checkpoint_dir: str | Path) -> dict[str, Any]:
    """A sharded *Lightning* checkpoint read into one process as the full Lightning checkpoint
    :func:`consolidate_checkpoint` writes (no process group needed). Strategies that hold whole models
    (``ddp_tuned``) load sharded checkpoints through it."""
    checkpoint_dir = Path(checkpoint_dir)
    verify_checkpoint(checkpoint_dir)
    raw = load_sharded(checkpoint_dir)
    checkpoint: dict[str, Any] = torch.load(
        checkpoint_dir / LIGHTNING_META, map_location="cpu", weights_only=True
    )
    checkpoint["state_dict"] = {k: v.detach().contiguous().clone() for k, v in raw.pop("state_dict").items()}
    optimizers = sorted((k for k in raw if k.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
    checkpoint["optimizer_states"] = [_optimizer_state_by_index(raw[k]) for k in optimizers]
    return checkpoint


def _optimizer_state_by_index(state: dict) -> dict:
    """DCP's optimizer state (keyed by parameter name) keyed by parameter index, in ``param_groups`` order."""
    names = [name for group in state["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(names)}
    return {
        "state": {index[name]: dict(values) for name, values in state.get("state", {}).items()},
        "param_groups": [
            {**group, "params": [index[name] for name in group["params"]]} for group in state["param_groups"]
        ],
    }


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, name + "."))
        else:
            out[name] = v
    return out


# --- `lit-parallel consolidate` ---------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="sharded checkpoint folder (saved by fsdp_blocks / hsdp)")
    parser.add_argument("output", help="full state_dict file to write (torch.save)")
    parser.add_argument("--key", default="state_dict", help="entry holding the weights (default: state_dict)")
    parser.add_argument(
        "--strip-prefix",
        default=None,
        help="keep only keys with this prefix and remove it, e.g. 'model.' for the module stored as self.model",
    )
    parser.add_argument(
        "--lightning",
        action="store_true",
        help="write a full Lightning checkpoint (weights, optimizer state, loops, RNG states) to resume from with"
        " ckpt_path= under ddp_tuned or on one device",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing output file (never a folder; the output may not be inside the checkpoint)",
    )


def run(args: argparse.Namespace) -> int:
    if getattr(args, "lightning", False):
        checkpoint = consolidate_checkpoint(
            args.checkpoint, args.output, overwrite=getattr(args, "overwrite", False)
        )
        state = checkpoint["state_dict"]
        print(
            f"wrote {args.output}: a full Lightning checkpoint, {len(state)} tensors,"
            f" {len(checkpoint['optimizer_states'])} optimizer state(s), epoch {checkpoint.get('epoch')},"
            f" step {checkpoint.get('global_step')}"
        )
        return 0
    state = consolidate(
        args.checkpoint,
        args.output,
        key=args.key,
        strip_prefix=args.strip_prefix,
        overwrite=getattr(args, "overwrite", False),
    )
    numel = sum(v.numel() for v in state.values())
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    print(f"wrote {args.output}: {len(state)} tensors, {numel:,} elements, {nbytes / 2**20:.2f} MiB")
    return 0
