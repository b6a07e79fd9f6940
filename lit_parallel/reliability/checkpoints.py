"""Checkpoints with every rank's RNG states, written under a temporary name and committed when complete,
verified before loading and loaded without unpickling code.

Single-file checkpoints go through :class:`ReliableCheckpointIO`, which wraps the strategy's
``CheckpointIO``. The sharded (``torch.distributed.checkpoint``) save and load of strategies built on
Lightning's ``ModelParallelStrategy`` do not go through a ``CheckpointIO``: their ``save_checkpoint`` and
``load_checkpoint`` call :func:`save_sharded_checkpoint` and :func:`load_sharded_checkpoint`.
"""

from __future__ import annotations

import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO
from typing_extensions import override

from lit_parallel import _compat, _logging
from lit_parallel.checkpoint.convert import full_checkpoint
from lit_parallel.checkpoint.load import (
    LIGHTNING_META,
    dcp_load,
    load_lightning_meta,
    model_entry,
    verify_checkpoint,
)
from lit_parallel.checkpoint.write import (
    atomic_save,
    check_replaceable,
    commit,
    is_write_failure,
    new_partial_path,
    write_error,
)
from lit_parallel.reliability.async_checkpoints import remove_after_writes, write_sharded
from lit_parallel.reliability.options import RNG_KEY
from lit_parallel.rng import capture_rng_state, state_from_bytes, state_to_bytes

if TYPE_CHECKING:
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lit_parallel.reliability.reports import _Progress


# tp_dp records the layout of its optimizer state when fused layers reorder its rows
TP_LAYOUT_KEY = "tp_dp_layout"


def _is_remote(path: Any) -> bool:
    return "://" in str(path)


def check_tensor_parallel_layout(meta: Any, path: Any, tensor_parallel_size: int) -> None:
    """Refuse a checkpoint whose optimizer state is in another tensor-parallel size's row order.

    ``tp_dp`` saves weights in their original layout, but the optimizer state of fused layers (one Linear
    holding q, k and v) keeps the row order of the tensor-parallel size it ran with; under any other size
    (``1``: ``ddp_tuned``, ``fsdp_blocks``, ``hsdp``) that state would be applied to the wrong rows.
    """
    layout = meta.get(TP_LAYOUT_KEY) if isinstance(meta, dict) else None
    if not layout or layout["tensor_parallel_size"] == tensor_parallel_size:
        return
    under = f"tensor_parallel_size={tensor_parallel_size}" + (
        ""
        if tensor_parallel_size > 1
        else " (ddp_tuned, fsdp_blocks and hsdp run without tensor parallelism)"
    )
    raise ValueError(
        f"checkpoint {str(path)!r} was saved with tensor_parallel_size={layout['tensor_parallel_size']} (tp_dp);"
        f" the optimizer state of its fused layers ({', '.join(layout['fused'])}) is stored in that size's row"
        f" order, so it cannot be resumed with {under}. Resume with"
        f" TensorParallelStrategy(tensor_parallel_size={layout['tensor_parallel_size']}), or start from its"
        " weights only: `lit-parallel consolidate CHECKPOINT weights.pt` and pass the file as init_from=..."
        " (fsdp_blocks / hsdp / tp_dp) or load it in configure_model"
    )


def refuse_returning_before_written(checkpoint_io: Any) -> None:
    """Lightning's ``AsyncCheckpointIO`` returns from a save before its thread wrote the file, so the file cannot
    be committed (renamed into place) only when complete: refused, with the strategy's own option as the fix."""
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    if isinstance(checkpoint_io, AsyncCheckpointIO):
        raise ValueError(
            "Lightning's AsyncCheckpointIO plugin cannot be used with a lit_parallel strategy: it returns before"
            " its thread has written the file, so the checkpoint could not be renamed into place only once"
            " complete (a crash could leave a half-written checkpoint that looks whole). Remove the plugin and"
            " pass async_checkpoint=True to the strategy: training then waits only for a copy in host memory"
            " and the write runs in the background with the same guarantees as a synchronous save"
        )


class ReliableCheckpointIO(CheckpointIO):
    """Wraps a ``CheckpointIO``: local saves are written under a temporary name and renamed into place
    (never over a folder that is not a checkpoint); loads are verified first and use ``weights_only=True``
    unless asked otherwise. Loading runs on every rank: the path is rank 0's."""

    def __init__(
        self,
        inner: CheckpointIO,
        progress: _Progress,
        broadcast: Callable[[Any], Any],
        reliability: Any = None,  # the strategy's Reliability: its async checkpoints and step clock
    ) -> None:
        self.inner = inner
        self._progress = progress
        self._broadcast = broadcast
        self._reliability = reliability

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if _is_remote(path):
            return self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)
        checkpoints = self._reliability.checkpoints if self._reliability is not None else None
        if checkpoints is not None:
            checkpoints.raise_failure()  # an earlier background write's failure, before this save is named
        self._progress.saving(path)

        def write(state: dict[str, Any]) -> None:
            atomic_save(
                lambda tmp: self.inner.save_checkpoint(state, tmp, storage_options=storage_options), path
            )

        if checkpoints is not None and checkpoints.use_async():
            check_replaceable(path, "file")  # refused at once, as a synchronous save would be
            staged = checkpoints.stage(checkpoint)
            checkpoints.submit(lambda: write(staged), path)
            return None
        started = time.monotonic()
        write(checkpoint)
        if checkpoints is not None:
            checkpoints.after_synchronous_save(
                time.monotonic() - started, list(self._reliability.clock.durations), checkpoint
            )
        return None

    @override
    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict:
        self._progress.at(f"restoring the checkpoint {str(path)!r}")
        if not _is_remote(path):
            path = Path(self._broadcast(str(path)))
            if verify_checkpoint(path) == "sharded":
                # saved by fsdp_blocks / hsdp / tp_dp / ModelParallelStrategy on any number of ranks: every
                # rank reads the whole model (this strategy holds it whole), as `lit-parallel consolidate
                # --lightning` would write it
                checkpoint = full_checkpoint(path)
                check_tensor_parallel_layout(checkpoint, path, tensor_parallel_size=1)
                return checkpoint
        kwargs: dict[str, Any] = {} if map_location is None else {"map_location": map_location}
        # never unpickle code from a checkpoint unless asked to
        checkpoint = self.inner.load_checkpoint(path, weights_only=weights_only is not False, **kwargs)
        check_tensor_parallel_layout(checkpoint, path, tensor_parallel_size=1)
        return checkpoint

    @override
    def remove_checkpoint(self, path: Any) -> None:
        # ModelCheckpoint's deletion of an older checkpoint waits for the newer one's background write
        checkpoints = self._reliability.checkpoints if self._reliability is not None else None
        remove_after_writes(checkpoints, lambda: self.inner.remove_checkpoint(path), path)

    @override
    def teardown(self) -> None:
        self.inner.teardown()


def gather_rng_states(device: torch.device | None = None) -> list[dict] | None:
    """Every rank's RNG states, on rank 0 (``None`` elsewhere). A collective: call it on every rank.

    Each rank's states travel as one ``uint8`` tensor (:func:`~lit_parallel.rng.state_to_bytes`) on
    ``device``, the process group's device (NCCL refuses CPU tensors; default: CPU): an all-gather of the
    lengths, then a gather of the padded bytes to rank 0. Nothing is pickled, so no rank but the one that
    writes the checkpoint calls ``torch.save``, and the only device-to-host copies are the lengths (every rank)
    and the gathered bytes (rank 0)."""
    state = capture_rng_state()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [state]
    device = torch.device("cpu") if device is None else device
    world, rank = dist.get_world_size(), dist.get_rank()
    payload = state_to_bytes(state).to(device)
    length = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(world)]
    dist.all_gather(lengths, length)
    longest = int(max(torch.cat(lengths).tolist()))
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    gathered = [torch.empty_like(padded) for _ in range(world)] if rank == 0 else None
    dist.gather(padded, gathered, dst=0)
    if gathered is None:
        return None
    on_host = torch.stack(gathered).cpu()
    return [state_from_bytes(row) for row in on_host]


def collective_device(strategy_root_device: torch.device) -> torch.device:
    """The device of tensors handed to the default process group's collectives: the strategy's (CUDA) device
    when the group runs NCCL, which refuses CPU tensors; else the CPU (gloo)."""
    backend = str(dist.get_backend()) if dist.is_available() and dist.is_initialized() else ""
    return strategy_root_device if "nccl" in backend else torch.device("cpu")


def rng_states_to_restore(checkpoint: dict[str, Any], world_size: int, rank: int) -> dict | None:
    """This rank's RNG states from a checkpoint saved on as many ranks, else ``None`` (and why, on rank 0)."""
    entry = checkpoint.get(RNG_KEY)
    if entry is None:
        return None
    if entry["world_size"] != world_size:
        _logging.info(
            f"the checkpoint holds the RNG states of {entry['world_size']} ranks and this run has"
            f" {world_size}: RNG states are not restored, so dropout masks and random augmentations"
            " differ from an uninterrupted run"
        )
        return None
    return entry["ranks"][rank]


def save_sharded_checkpoint(
    strategy: ModelParallelStrategy,
    checkpoint: dict[str, Any],
    filepath: Any,
    storage_options: Any | None,
    lightning_save: Callable[..., None],
) -> None:
    """``ModelParallelStrategy.save_checkpoint`` written under a temporary name: Lightning's ``meta.pt``
    first, then the shards, then DCP's ``.metadata`` (last, by DCP), then the rename into place.
    ``lightning_save`` (Lightning's own) writes remote paths."""
    if _is_remote(filepath):
        return lightning_save(checkpoint, filepath, storage_options)
    if storage_options is not None:
        raise TypeError(
            f"`{type(strategy).__name__}.save_checkpoint(..., storage_options=...)` is not supported because"
            f" `{type(strategy).__name__}` does not use the `CheckpointIO`."
        )
    path = Path(strategy.broadcast(str(filepath)))
    if strategy.reliability.checkpoints is not None:
        strategy.reliability.checkpoints.raise_failure()  # an earlier background write's, before naming this one
    strategy.reliability.progress.saving(path)
    sharded = _compat.saves_distributed_checkpoint(strategy)
    check_replaceable(path, "sharded" if sharded else "file")
    if not sharded:
        if strategy.is_global_zero:
            strategy.checkpoint_io.save_checkpoint(checkpoint, path)
        return None
    token = strategy.broadcast(uuid.uuid4().hex[:12] if strategy.is_global_zero else None)
    partial = new_partial_path(path, token)
    converted = {"state_dict": checkpoint.pop("state_dict")}
    converted.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
    checkpoints = strategy.reliability.checkpoints
    # every rank saves in the same way
    if checkpoints is not None and checkpoints.use_async_on_every_rank(strategy.broadcast):
        group = checkpoints.process_group()
        staged = checkpoints.stage({"dcp": converted, "meta": checkpoint})
        meta = staged["meta"] if strategy.is_global_zero else None
        checkpoints.submit(lambda: write_sharded(staged["dcp"], meta, partial, path, group), path)
        return None
    started = time.monotonic()
    if strategy.is_global_zero:
        partial.mkdir(parents=True)
    strategy.barrier()
    try:
        if strategy.is_global_zero:
            torch.save(checkpoint, partial / LIGHTNING_META)
        _compat.distributed_checkpoint_save(converted, partial)
        strategy.barrier()
    except BaseException as err:
        translated = write_error(err, path) if is_write_failure(err) else None
        if strategy.is_global_zero:
            shutil.rmtree(partial, ignore_errors=True)
        if translated is None:
            raise
        raise translated from err
    if strategy.is_global_zero:
        commit(partial, path)
    strategy.barrier()
    if checkpoints is not None:
        checkpoints.after_synchronous_save(
            time.monotonic() - started, list(strategy.reliability.clock.durations), converted
        )
    return None


def load_sharded_checkpoint(
    strategy: ModelParallelStrategy,
    checkpoint_path: Any,
    weights_only: bool | None,
    lightning_load: Callable[..., dict[str, Any]],
) -> dict[str, Any]:
    """Verify, then load: a sharded checkpoint with DCP's index and non-tensor entries read without
    unpickling code; anything else through ``lightning_load`` (Lightning's own) with ``weights_only=True``
    unless asked otherwise."""
    strategy.reliability.progress.at(f"restoring the checkpoint {str(checkpoint_path)!r}")
    path = checkpoint_path
    kind = "remote"
    if not _is_remote(path):
        path = Path(strategy.broadcast(str(path)))
        kind = verify_checkpoint(path)
    tensor_parallel_size = _tensor_parallel_size(strategy)
    if kind == "sharded":
        meta = load_lightning_meta(path)  # on the CPU, not on the device rank 0 saved from
        check_tensor_parallel_layout(meta, path, tensor_parallel_size)  # before any state is loaded
        _load_sharded(strategy, Path(path))
        return meta
    meta = lightning_load(path, weights_only=weights_only is not False)
    check_tensor_parallel_layout(meta, path, tensor_parallel_size)
    return meta


def _tensor_parallel_size(strategy: Any) -> int:
    try:
        return int(strategy.parallel_dims.tensor_parallel)
    except (AttributeError, RuntimeError):  # Lightning's ModelParallelStrategy; not configured yet
        return 1


def _load_sharded(strategy: ModelParallelStrategy, path: Path) -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    module = strategy.model
    assert module is not None and strategy.lightning_module is not None
    # "model" in a checkpoint of Lightning's FSDPStrategy (FSDP1): its optimizer states are keyed by parameter
    # name as FSDP2's are, so both load here on any number of ranks
    entry = model_entry(path)
    module_state = {entry: get_model_state_dict(module)}
    dcp_load(module_state, path)
    module.load_state_dict(module_state[entry], strict=strategy.lightning_module.strict_loading)
    for i, optimizer in enumerate(strategy.optimizers):
        key = f"optimizer_{i}"
        optim_state = {key: get_optimizer_state_dict(module, optimizer)}
        # each rank's parameter names per group as they are here: DCP stores the groups once (from one rank),
        # and ranks may hold different parameters (module-list experts under expert parallelism)
        names = [list(g["params"]) for g in optim_state[key].get("param_groups", [])]
        dcp_load(optim_state, path)
        for group, own in zip(optim_state[key].get("param_groups", []), names):
            group["params"] = own
        set_optimizer_state_dict(
            module,
            optimizer,
            optim_state_dict=optim_state[key],
            options=StateDictOptions(cpu_offload=True),
        )
