"""Giving every rank the same full weights before they are split: materialise from the meta device, or copy
rank 0's.

:func:`materialize_blocks` walks a module in pre-order (as Lightning's materialisation does, so the same
``reset_parameters`` calls draw the same random numbers as initialising the whole model in one process) and
yields each transformer block as soon as its weights are ready, so that the caller can shard it before the
next one is materialised: no rank ever holds more than the parameters outside blocks plus one whole block.

:func:`broadcast_from_rank0` copies rank 0's tensors to every rank with at most ``SYNC_CHUNK_BYTES`` of extra
memory: tensors on a device the process group can communicate on are broadcast in place; small ones are
packed into buffers of at most the cap; others (CPU tensors under NCCL) are streamed through one such buffer
on the process group's device. Nothing the size of the model is ever allocated, on the host or the device.

Every tensor made from the meta device must be written by an initialiser (the module's ``reset_parameters``,
torch's ``_reset_parameters``, or the ``_init_weights`` of the Hugging Face model that holds the module):
what was written is tracked while the initialiser runs (a dispatch mode that records every in-place write),
never guessed from the memory's content, and a tensor nobody wrote is an error naming the module, the tensor
and the fixes (CPU pages usually come back zeroed, CUDA's caching allocator hands back old data).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lit_parallel._compat import TorchDispatchMode, storage_key, tree_flatten
from lit_parallel.parallel.simulated import is_simulated

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# The most extra memory (bytes) a rank-0 sync allocates at once (docs/reference/strategies/fsdp_blocks.md).
SYNC_CHUNK_BYTES = 64 * 2**20


def has_meta(module: nn.Module, recurse: bool = True) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device."""
    return any(t.is_meta for t in itertools.chain(module.parameters(recurse), module.buffers(recurse)))


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device this rank computes on for ``mesh``."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    handle = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, handle.current_device())


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _comm_device(device: torch.device) -> torch.device:
    """Where a tensor on ``device`` can be broadcast: itself, unless the backend cannot send it (NCCL: CPU)."""
    backend = str(dist.get_backend())
    if device.type != "cpu":
        return device
    if ":" in backend:  # "cpu:gloo,cuda:nccl": one backend per device type
        if any(part.split(":")[0] == "cpu" for part in backend.split(",")):
            return device
    elif backend != "nccl":
        return device
    return torch.device("cuda", torch.cuda.current_device())


def broadcast_from_rank0(tensors: Sequence[torch.Tensor], chunk_bytes: int | None = None) -> None:
    """Make every rank's copy of ``tensors`` equal rank 0's, with at most ``chunk_bytes`` (default
    :data:`SYNC_CHUNK_BYTES`) of extra memory at any moment (a non-contiguous tensor larger than that is
    copied whole once; parameters and buffers are contiguous)."""
    if not _distributed() or is_simulated():  # a simulated world holds no data to copy
        return
    cap = int(chunk_bytes or SYNC_CHUNK_BYTES)
    if cap <= 0:
        raise ValueError(f"chunk_bytes={chunk_bytes!r} must be a positive number of bytes")
    rank0 = dist.get_rank() == 0
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            groups.setdefault((t.dtype, t.device), []).append(t.detach())
    # the same order on every rank: every rank passes the same tensors
    for (dtype, device), ts in sorted(groups.items(), key=lambda kv: str(kv[0])):
        comm = _comm_device(device)
        per_chunk = max(1, cap // ts[0].element_size())
        bucket: list[torch.Tensor] = []
        filled = 0
        for t in ts:
            if t.numel() > per_chunk:
                _broadcast_large(t, comm, per_chunk, rank0)
                continue
            if filled + t.numel() > per_chunk:
                _broadcast_packed(bucket, filled, dtype, comm, rank0)
                bucket, filled = [], 0
            bucket.append(t)
            filled += t.numel()
        if bucket:
            _broadcast_packed(bucket, filled, dtype, comm, rank0)


@torch.no_grad()
def _broadcast_packed(
    ts: list[torch.Tensor], numel: int, dtype: torch.dtype, comm: torch.device, rank0: bool
):
    """Small tensors in one collective, through one buffer of ``numel`` elements (at most the cap)."""
    flat = torch.empty(numel, dtype=dtype, device=comm)
    pieces = torch.split(flat, [t.numel() for t in ts])
    if rank0:
        for t, piece in zip(ts, pieces):
            piece.copy_(t.reshape(-1))
    dist.broadcast(flat, src=0)
    if not rank0:
        for t, piece in zip(ts, pieces):
            t.copy_(piece.view_as(t))


@torch.no_grad()
def _broadcast_large(t: torch.Tensor, comm: torch.device, per_chunk: int, rank0: bool) -> None:
    """A tensor above the cap: in place when the backend can send it where it is, else in slices of the cap."""
    target = t if t.is_contiguous() else t.contiguous()
    if target.device == comm:
        dist.broadcast(target, src=0)
    else:
        flat = target.view(-1)
        buffer = torch.empty(min(per_chunk, flat.numel()), dtype=t.dtype, device=comm)
        for start in range(0, flat.numel(), per_chunk):
            piece = flat[start : start + per_chunk]
            staged = buffer[: piece.numel()]
            if rank0:
                staged.copy_(piece)
            dist.broadcast(staged, src=0)
            if not rank0:
                piece.copy_(staged)
    if target is not t:
        t.copy_(target)


def local_states(module: nn.Module, recurse: bool) -> list[torch.Tensor]:
    """Parameters and buffers of ``module`` that are plain (not DTensor) tensors with storage."""
    from torch.distributed.tensor import DTensor

    return [
        t
        for t in itertools.chain(module.parameters(recurse), module.buffers(recurse))
        if not isinstance(t, DTensor) and not t.is_meta
    ]


@contextmanager
def rank0_rng(device: torch.device) -> Iterator[None]:
    """Every rank draws the random numbers rank 0 draws, so initialisation is identical across ranks."""
    if not _distributed():
        yield
        return
    states: list[Any] = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    dist.broadcast_object_list(states, src=0)
    torch.set_rng_state(states[0].cpu())
    if device.type == "cuda":
        torch.cuda.set_rng_state(states[1].cpu(), device)
    yield


# --- initialising what was on the meta device -------------------------------------------------------------


class UninitializedStateError(RuntimeError):
    """Tensors materialised from the meta device that no initialiser wrote."""


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


class _WriteRecorder(TorchDispatchMode):
    """The storages written in place (``uniform_``, ``copy_``, ``out=``...) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.written: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i]
            for t in tree_flatten(value)[0]:
                if isinstance(t, torch.Tensor):
                    self.written.add(storage_key(_local(t)))
        return func(*args, **kwargs)


def _hf_model_of(module: nn.Module, ancestors: Sequence[nn.Module]) -> Any:
    """The nearest enclosing Hugging Face model (it initialises its modules with ``_init_weights``)."""
    for owner in reversed((*ancestors, module)):
        if callable(getattr(owner, "_init_weights", None)) and hasattr(owner, "config"):
            return owner
    return None


def initializer(module: nn.Module, ancestors: Sequence[nn.Module] = ()) -> Callable[[], Any] | None:
    """What initialises ``module``'s own states: its ``reset_parameters()``, torch's private
    ``_reset_parameters()`` (``nn.MultiheadAttention``), else the enclosing Hugging Face model's
    ``_init_weights(module)`` (norms, rotary tables); ``None`` when nothing does."""
    for name in ("reset_parameters", "_reset_parameters"):
        fn = getattr(module, name, None)
        if callable(fn):
            return fn
    owner = _hf_model_of(module, ancestors)
    if owner is not None:
        return lambda: owner._init_weights(module)
    return None


def _own_states(module: nn.Module) -> list[tuple[str, str, torch.Tensor]]:
    """(kind, name, tensor) of ``module``'s own parameters and buffers."""
    out = [("parameter", n, p) for n, p in module._parameters.items() if p is not None]
    out += [("buffer", n, b) for n, b in module._buffers.items() if b is not None]
    return out


def _filled_by_state_dict(module: nn.Module, kind: str, name: str) -> bool:
    return kind == "parameter" or name not in module._non_persistent_buffers_set


def _to_empty_meta(module: nn.Module, device: torch.device) -> list[tuple[str, str]]:
    """Replace ``module``'s own meta tensors by uninitialised ones on ``device``; returns the (kind, name) of
    those. Tensors not on the meta device keep their values (and objects: FSDP2 moves them to the device)."""
    made = []
    for kind, name, t in _own_states(module):
        if not t.is_meta:
            continue
        _assign(module, kind, name, t, torch.empty_like(t, device=device))
        made.append((kind, name))
    return made


@torch.no_grad()
def _assign(module: nn.Module, kind: str, name: str, old: torch.Tensor, data: torch.Tensor) -> None:
    if kind == "parameter":
        module._parameters[name] = nn.Parameter(data, requires_grad=old.requires_grad)
    else:
        module._buffers[name] = data


def _fixes(filled_later: bool) -> str:
    return (
        "Fix one of: give the module a reset_parameters() that fills every tensor it owns (a buffer computed in"
        " __init__, such as a rotary table or a mask, must be recomputed there); build the buffer in __init__ on"
        " a real device (`torch.arange(..., device='cpu')` inside the meta context: tensors not on the meta"
        " device are kept); or pass init_from=FILE with a full state dict that holds it (parameters"
        " and persistent buffers only: a buffer registered with persistent=False is never in a state dict)"
        + ("." if not filled_later else "; init_from is given, so only non-persistent buffers are listed.")
    )


def _describe(missing: list[tuple[str, str, str, str]]) -> str:
    return "; ".join(
        f"{kind} {name!r} of module {path or '<root>'!r} ({cls})" for path, cls, kind, name in missing[:20]
    ) + (f"; and {len(missing) - 20} more" if len(missing) > 20 else "")


def check_initializable(module: nn.Module, filled_by_state_dict: bool = False) -> None:
    """Before any work: every meta tensor of ``module`` has an initialiser (or comes from the state dict
    when ``filled_by_state_dict``); raises :class:`UninitializedStateError` naming the others and the fixes."""
    missing = []
    for path, sub, ancestors in _walk(module):
        if initializer(sub, ancestors) is not None:
            continue
        for kind, name, t in _own_states(sub):
            if t.is_meta and not (filled_by_state_dict and _filled_by_state_dict(sub, kind, name)):
                missing.append((path, type(sub).__name__, kind, name))
    if missing:
        raise UninitializedStateError(
            "materialising the model from the meta device would leave these tensors uninitialised, because no"
            " reset_parameters() (or other initialiser) writes them: " + _describe(missing) + ". On CUDA they"
            " would hold whatever the caching allocator hands back. " + _fixes(filled_by_state_dict)
        )


def _walk(
    module: nn.Module, prefix: str = "", ancestors: tuple = ()
) -> Iterator[tuple[str, nn.Module, tuple]]:
    """Pre-order (path, module, its ancestors), each module once."""
    seen: set[int] = set()

    def visit(m: nn.Module, path: str, up: tuple) -> Iterator[tuple[str, nn.Module, tuple]]:
        if id(m) in seen:
            return
        seen.add(id(m))
        yield path, m, up
        for name, child in m._modules.items():
            if child is not None:
                yield from visit(child, f"{path}.{name}" if path else name, (*up, m))

    yield from visit(module, prefix, ancestors)


class _Initialiser:
    """Materialises modules one at a time and records which meta tensors no initialiser wrote."""

    def __init__(self, device: torch.device, filled_by_state_dict: bool) -> None:
        self.device = device
        self.filled_by_state_dict = filled_by_state_dict
        self.missing: list[tuple[str, str, str, str]] = []

    def empty(self, module: nn.Module) -> list[tuple[str, str]]:
        return _to_empty_meta(module, self.device)

    def init(self, path: str, module: nn.Module, ancestors: Sequence[nn.Module], made: list) -> None:
        """Run ``module``'s initialiser and check that it wrote (or replaced) every tensor in ``made``."""
        if not made:
            return
        before = {(k, n): t for k, n, t in _own_states(module)}
        fn = initializer(module, ancestors)
        recorder = _WriteRecorder()
        if fn is not None:
            with recorder:
                fn()
        after = {(k, n): t for k, n, t in _own_states(module)}
        for kind, name in made:
            t = after.get((kind, name))
            if t is None or t is not before.get((kind, name)) or t.numel() == 0:
                continue  # removed, or replaced by a new tensor: the initialiser made it
            if storage_key(_local(t)) in recorder.written:
                continue
            if self.filled_by_state_dict and _filled_by_state_dict(module, kind, name):
                continue
            self.missing.append((path, type(module).__name__, kind, name))

    def raise_missing(self) -> None:
        if self.missing:
            raise UninitializedStateError(
                "materialising the model from the meta device left these tensors uninitialised: their module's"
                " initialiser ran but did not write them: " + _describe(self.missing) + ". On CUDA they would"
                " hold whatever the caching allocator hands back. " + _fixes(self.filled_by_state_dict)
            )


def materialize_blocks(
    module: nn.Module,
    blocks: Sequence[nn.Module],
    device: torch.device,
    *,
    sync_from_rank0: bool = True,
    filled_by_state_dict: bool = False,
    chunk_bytes: int | None = None,
) -> Iterator[nn.Module]:
    """Yield each of ``blocks`` (in module order) once its full weights are ready on every rank.

    A module (partly) on the meta device is materialised on ``device``: the parameters outside blocks first,
    then each block as the walk reaches it; each module's initialiser (see :func:`initializer`) fills its own
    states, with rank 0's random generator state on every rank. A meta tensor that no initialiser writes is
    an error (:class:`UninitializedStateError`), raised before any work when the module has no initialiser at
    all; ``filled_by_state_dict``: parameters and persistent buffers will be loaded from a full state dict
    afterwards (``init_from``), so only non-persistent buffers must be initialised.
    A module that is not on the meta device gets rank 0's parameters and buffers when ``sync_from_rank0``
    (as DDP does), so ranks cannot start from different initialisations, with at most ``chunk_bytes`` of
    extra memory (see :func:`broadcast_from_rank0`).
    """
    if is_simulated():
        # a dry run (lit_parallel.parallel.simulated): the model stays on the meta device, nothing is copied
        yield from blocks
        return
    block_ids = {id(b) for b in blocks}
    inside = {id(m) for b in blocks for m in b.modules()}
    meta = has_meta(module)
    if meta:
        check_initializable(module, filled_by_state_dict)
    walk = list(_walk(module))
    outside = [(p, m, up) for p, m, up in walk if id(m) not in inside]
    init = _Initialiser(device, filled_by_state_dict)
    made: dict[int, list] = {}
    with rank0_rng(device) if meta else nullcontext():
        if meta:
            # Parameters outside blocks are needed whole for a moment anyway (the root group shards them last).
            for _, m, _ in outside:
                made[id(m)] = init.empty(m)
        elif sync_from_rank0:
            broadcast_from_rank0(
                [t for _, m, _ in outside for t in local_states(m, recurse=False)], chunk_bytes
            )
        skip: set[int] = set()
        for path, m, up in walk:
            if id(m) in skip:
                continue
            if id(m) in block_ids:
                skip.update(id(sub) for sub in m.modules())
                if has_meta(m):
                    subtree = [(p, s, u) for p, s, u in _walk(m, path, up)]
                    pending = [(p, s, u, init.empty(s)) for p, s, u in subtree]
                    for p, s, u, made_here in pending:
                        init.init(p, s, u, made_here)
                elif sync_from_rank0:
                    broadcast_from_rank0(local_states(m, recurse=True), chunk_bytes)
                yield m
            elif id(m) in made:
                init.init(path, m, up, made.pop(id(m)))
    init.raise_missing()


def materialize_owned(
    module: nn.Module,
    pieces: Iterable[str],
    all_pieces: Iterable[str],
    device: torch.device,
    *,
    filled_by_state_dict: bool = False,
) -> None:
    """Materialise the parts of a meta-device ``module`` that this rank keeps (``pieces``: module paths, a
    pipeline rank's stages) and draw exactly the random numbers initialising the whole model would.

    The walk is :func:`materialize_blocks`'s (pre-order, rank 0's generator state): a module of another
    rank's piece (one of ``all_pieces`` not in ``pieces``) is materialised and initialised too, so that the
    random numbers drawn after it are those of a whole-model initialisation, then returned to the meta
    device at once: besides its own pieces a rank holds at most one other module at a time.
    """
    if is_simulated():
        return  # a dry run: every piece stays on the meta device (lit_parallel.parallel.simulated)
    kept, every = set(pieces), set(all_pieces)

    def owner(path: str) -> str | None:
        parts = path.split(".")
        for i in range(len(parts), 0, -1):
            candidate = ".".join(parts[:i])
            if candidate in every:
                return candidate
        return None

    check_initializable(module, filled_by_state_dict)
    init = _Initialiser(device, filled_by_state_dict)
    with rank0_rng(device):
        for path, m, up in list(_walk(module)):
            if not has_meta(m, recurse=False):
                continue
            made = init.empty(m)
            init.init(path, m, up, made)
            piece = owner(path)
            if piece is not None and piece not in kept:
                for kind, name, t in _own_states(m):
                    _assign(m, kind, name, t, torch.empty_like(t, device="meta"))
    init.raise_missing()
