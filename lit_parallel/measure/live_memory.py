"""Measured peak memory of a training step on any device, CPU included, by live-storage accounting.

torch keeps allocator statistics for CUDA only (``torch.cuda.max_memory_allocated``); on CPU there are
none. :class:`LiveMemory` is a ``TorchDispatchMode`` that sees every tensor an op returns, counts each
new storage once (by identity, so views are free) and subtracts it when the storage is freed (a
``weakref.finalize`` on the storage). The peak is split by what the bytes are:

* ``params``: storages of parameters: the module's, and every parameter a module holds when it runs (a
  global forward hook records them): FSDP2's gathered (unsharded) parameters are counted here, not as the
  activations or temporaries they would otherwise be when autograd saves them or an op reads them;
* ``optimizer``: storages of the optimizer's state;
* ``grads``: storages that became a parameter's ``.grad`` (a post-accumulate-grad hook records them), also
  of a gathered parameter (FSDP2's unsharded gradients before their reduce-scatter) and the reduce-scatter
  outputs FSDP2 makes the sharded gradients of (it calls the same hooks);
* ``activations``: storages autograd saved for backward (a saved-tensors hook records them) that are not
  parameters;
* ``temporaries``: everything else (outputs, gradients flowing through backward, optimizer scratch, FSDP2's
  flat all-gather outputs and reduce-scatter inputs).

Meta tensors hold no memory: a real run's (shape computations, such as ``pp_dp``'s stand-ins for modules
other stages own) are not counted; a simulation on the meta device counts them (``meta=True``).

Storages allocated outside Python's dispatcher view (e.g. by a C++ component before the mode was
entered) are invisible unless they already belong to one of the groups above; parameters and optimizer
state that exist when tracking starts are counted from the start.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from lit_parallel._compat import TorchDispatchMode, storage_key, tree_flatten

CATEGORIES = ("params", "grads", "optimizer", "activations", "temporaries")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank stores); any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


@dataclass(frozen=True)
class Moment:
    """The storages live at one moment (allocation number -> bytes then); see :meth:`LiveMemory.moment`."""

    sizes: dict[int, int]


@dataclass
class MemoryPeak:
    """The highest number of live bytes seen, split by category (:data:`CATEGORIES`)."""

    total: int = 0
    by_category: dict[str, int] = field(default_factory=dict)


class LiveMemory(TorchDispatchMode):
    """Track live tensor bytes while active; :attr:`peak` is the largest total seen.

    Args:
        module: whose parameters (and their gradients) are counted as such; or the parameters themselves.
        optimizer: whose state is counted as optimizer state.
        exact: re-read a storage's size whenever an op reads or writes it, and every live storage's size
            whenever a new peak is about to be recorded. FSDP2 frees and re-gathers parameters by resizing
            their storage in place, which no op or finalizer reports (the gather's copy into the resized
            storage is an op); with ``exact`` those bytes are right. Costs time per allocation: off for
            meta-device simulations, whose storages never resize.
        meta: count meta tensors, by the bytes they would take (a simulation on the meta device).
    """

    _active: ClassVar[list[LiveMemory]] = []  # trackers entered and not yet exited, innermost last

    def __init__(
        self,
        module: nn.Module | Iterable[torch.Tensor] | None = None,
        optimizer: Any = None,
        exact: bool = True,
        meta: bool = False,
    ) -> None:
        super().__init__()
        self.exact, self.meta = exact, meta
        self.refs: dict[int, Any] = {}
        self.params = list(
            dict.fromkeys(module.parameters() if isinstance(module, nn.Module) else module or ())
        )
        self.optimizer = optimizer
        # storage identity -> allocation number: a freed storage's address may be reused by a new one,
        # so everything else is keyed by allocation, which is never reused
        self.live: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.kinds: dict[int, str] = {}
        self.current = 0
        self.peak = MemoryPeak()
        self._at_peak = Moment({})  # what was live at the peak, sizes as they were then
        self._count = 0
        self._handles: list[Any] = []
        self._hooked: set[int] = set()  # parameters whose gradients are recorded
        self._saved_hooks: Any = None

    # --- what is live -------------------------------------------------------------------------------

    def _add(self, t: torch.Tensor) -> int | None:
        t = local_tensor(t)
        if t.device.type == "meta" and not self.meta:
            return None
        storage = t.untyped_storage()
        key = storage_key(t)
        if key in self.live:
            alloc = self.live[key]
            # resized in place since (FSDP2's gather)
            if self.exact and storage.nbytes() != self.sizes[alloc]:
                self.current += storage.nbytes() - self.sizes[alloc]
                self.sizes[alloc] = storage.nbytes()
                self._check_peak()
            return alloc
        self._count += 1
        alloc = self.live[key] = self._count
        self.sizes[alloc] = nbytes = storage.nbytes()
        self.current += nbytes
        try:
            weakref.finalize(storage, self._free, key, alloc)
            if self.exact:
                self.refs[alloc] = weakref.ref(storage)
        except TypeError:  # a storage that cannot be weakly referenced is counted until the end
            pass
        self._check_peak()
        return alloc

    def _refresh(self) -> None:
        """Re-read the sizes of storages resized in place since they were counted (FSDP2's free and
        re-gather); only with ``exact``."""
        if not self.exact:
            return
        for alloc in self.live.values():
            storage = self.refs.get(alloc, lambda: None)()
            if storage is not None and storage.nbytes() != self.sizes[alloc]:
                self.current += storage.nbytes() - self.sizes[alloc]
                self.sizes[alloc] = storage.nbytes()

    def _check_peak(self) -> None:
        if self.current <= self.peak.total:
            return
        self._refresh()
        if self.current > self.peak.total:
            self.peak.total = self.current
            # sizes as they are at the peak (a storage resized later must not change this peak's split)
            self._at_peak = Moment({a: self.sizes[a] for a in self.live.values()})

    def _free(self, key: int, alloc: int) -> None:
        if self.live.get(key) == alloc:
            del self.live[key]
            self.current -= self.sizes[alloc]
            self.refs.pop(alloc, None)

    @classmethod
    def innermost(cls) -> LiveMemory | None:
        """The tracker entered last and not yet exited (``None`` outside every tracker): what a hook that
        runs inside a tracked step reads the step's memory from."""
        return cls._active[-1] if cls._active else None

    def held_beyond_state(self) -> int:
        """Bytes live now that are not (as far as known now) parameters, gradients or optimizer state."""
        state = ("params", "grads", "optimizer")
        return sum(self.sizes[a] for a in self.live.values() if self.kinds.get(a) not in state)

    def snapshot(self) -> MemoryPeak:
        """What is live now, split by category as far as the storages' roles are known now."""
        self._refresh()
        return MemoryPeak(self.current, self._split(list(self.live.values()), self.sizes))

    def moment(self) -> Moment:
        """What is live now, to be split by :meth:`split` later, when every storage's role is known (a
        storage saved for backward only after this moment is an activation at it too, as in the peak)."""
        self._refresh()
        return Moment({a: self.sizes[a] for a in self.live.values()})

    def split(self, moment: Moment) -> MemoryPeak:
        """A :meth:`moment`'s bytes by category, with the roles known now."""
        return MemoryPeak(sum(moment.sizes.values()), self._split(moment.sizes, moment.sizes))

    def count(self, tensors: Iterable[Any]) -> None:
        """Count ``tensors`` (others in the iterable are skipped), made before tracking, as live from now:
        buffers a step holds all along but first uses later (torch's pipeline receive buffers)."""
        for t in tensors:
            if isinstance(t, torch.Tensor) and not t.is_sparse:
                self._add(t)

    def kind_of(self, t: torch.Tensor) -> str | None:
        """The category ``t``'s storage is counted in now; ``None`` when it is not counted."""
        alloc = self.live.get(storage_key(local_tensor(t)))
        return None if alloc is None else self.kinds.get(alloc, "temporaries")

    def reset_peak(self) -> None:
        """Start a new peak from what is live now (to find the peak of one phase)."""
        self.peak = MemoryPeak(self.current)
        self._at_peak = Moment({a: self.sizes[a] for a in self.live.values()})

    def peak_so_far(self) -> MemoryPeak:
        """The peak since the start (or :meth:`reset_peak`), split by category."""
        return MemoryPeak(self.peak.total, self._split(self._at_peak.sizes, self._at_peak.sizes))

    def peak_moment(self) -> Moment:
        """The peak since the start (or :meth:`reset_peak`), to be split later (:meth:`split`)."""
        return self._at_peak

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # what an op reads is live too: a storage made before tracking started (a buffer kept between steps)
        # is counted from its first use
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and not t.is_sparse:
                self._add(t)
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_sparse:
                self._add(t)
        return out

    # --- categories ---------------------------------------------------------------------------------

    def _params(self) -> Iterable[torch.Tensor]:
        return self.params

    def _state(self) -> Iterable[torch.Tensor]:
        if self.optimizer is None:
            return ()
        return (v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))

    def _mark(self, t: torch.Tensor, kind: str) -> None:
        alloc = self._add(t)  # a storage allocated outside the mode (DDP's buckets) is counted from here
        if alloc is None:
            return
        if kind in ("params", "optimizer") or alloc not in self.kinds:
            self.kinds[alloc] = kind

    def _label(self, t: torch.Tensor, kind: str) -> None:
        alloc = self.live.get(storage_key(local_tensor(t)))
        if alloc is not None and (kind != "grads" or alloc not in self.kinds):
            self.kinds[alloc] = kind

    def _record_grad(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            self._mark(p.grad, "grads")

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        # a parameter saved for backward is a parameter (FSDP2's gathered copies are nn.Parameters too)
        self._mark(t, "params" if isinstance(t, nn.Parameter) else "activations")
        return t

    def _see_module(self, module: nn.Module, *_: Any) -> None:
        # the parameters a module holds when it runs: FSDP2 swaps its gathered parameters in before the
        # block's forward (so a layer inside it sees them) and out after the block's own forward hooks (so
        # this hook, which runs before those, sees them at the block's end too); their storages are kept and
        # resized between gathers, so one label holds for the whole step
        for p in module.parameters(recurse=False):
            self._mark(p, "params")
            if p.requires_grad and id(p) not in self._hooked:  # its gradient, before any reduce-scatter
                self._hooked.add(id(p))
                self._handles.append(p.register_post_accumulate_grad_hook(self._record_grad))

    def _mark_state(self) -> None:
        for p in self._params():
            self._mark(p, "params")
        for t in self._state():
            self._mark(t, "optimizer")

    def __enter__(self) -> LiveMemory:
        self._mark_state()
        for p in self._params():
            if p.grad is not None:
                self._record_grad(p)
            if p.requires_grad:
                self._hooked.add(id(p))
                self._handles.append(p.register_post_accumulate_grad_hook(self._record_grad))
        self._handles.append(register_module_forward_pre_hook(self._see_module))
        self._handles.append(register_module_forward_hook(self._see_module))
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._saved_hooks.__enter__()
        LiveMemory._active.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        LiveMemory._active.remove(self)
        super().__exit__(*exc)
        self._saved_hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._hooked.clear()
        self.peak = self.peak_so_far()

    def _split(self, allocs: Iterable[int], sizes: dict[int, int]) -> dict[str, int]:
        # labels known only now: optimizer state created while tracking (the first step), gradients that
        # were assigned rather than accumulated (FSDP2's sharded gradients)
        for p in self._params():
            self._label(p, "params")
            if p.grad is not None:
                self._label(p.grad, "grads")
        for t in self._state():
            self._label(t, "optimizer")
        out = dict.fromkeys(CATEGORIES, 0)
        for alloc in allocs:
            out[self.kinds.get(alloc, "temporaries")] += sizes[alloc]
        return out
