"""Measured peak memory of a training step on any device, CPU included, by live-storage accounting.

torch keeps allocator statistics for CUDA only (``torch.cuda.max_memory_allocated``); on CPU there are
none. :class:`LiveMemory` is a ``TorchDispatchMode`` that sees every tensor an op returns, counts each
new storage once (by identity, so views are free) and subtracts it when the storage is freed (a
``weakref.finalize`` on the storage). The peak is split by what the bytes are:

* ``params``, ``optimizer``: storages of the module's parameters / the optimizer's state;
* ``grads``: storages that became a parameter's ``.grad`` (a post-accumulate-grad hook records them);
* ``activations``: storages autograd saved for backward (a saved-tensors hook records them);
* ``temporaries``: everything else (outputs, gradients flowing through backward, optimizer scratch).

Storages allocated outside Python's dispatcher view (e.g. by a C++ component before the mode was
entered) are invisible unless they already belong to one of the groups above; parameters and optimizer
state that exist when tracking starts are counted from the start.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lit_parallel._compat import TorchDispatchMode, storage_key, tree_flatten

CATEGORIES = ("params", "grads", "optimizer", "activations", "temporaries")


@dataclass
class MemoryPeak:
    """The highest number of live bytes seen, split by category (:data:`CATEGORIES`)."""

    total: int = 0
    by_category: dict[str, int] = field(default_factory=dict)


class LiveMemory(TorchDispatchMode):
    """Track live tensor bytes while active; :attr:`peak` is the largest total seen.

    Args:
        module: whose parameters (and their gradients) are counted as such.
        optimizer: whose state is counted as optimizer state.
    """

    def __init__(self, module: nn.Module | None = None, optimizer: Any = None) -> None:
        super().__init__()
        self.module, self.optimizer = module, optimizer
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = MemoryPeak()
        self._peak_keys: dict[int, int] = {}
        self.saved: set[int] = set()
        self.grads: set[int] = set()
        self._handles: list[Any] = []
        self._saved_hooks: Any = None

    # --- what is live -------------------------------------------------------------------------------

    def _add(self, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor):
            return
        storage = t.untyped_storage()
        key = storage_key(t)
        if key in self.live:
            return
        self.live[key] = nbytes = storage.nbytes()
        self.current += nbytes
        try:
            weakref.finalize(storage, self._free, key)
        except TypeError:  # a storage that cannot be weakly referenced is counted until the end
            pass
        if self.current > self.peak.total:
            self.peak.total = self.current
            self._peak_keys = dict(self.live)

    def _free(self, key: int) -> None:
        nbytes = self.live.pop(key, 0)
        self.current -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t)
        return out

    # --- categories ---------------------------------------------------------------------------------

    def _params(self) -> Iterable[torch.Tensor]:
        return self.module.parameters() if self.module is not None else ()

    def _state(self) -> Iterable[torch.Tensor]:
        if self.optimizer is None:
            return ()
        return (v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))

    def _record_grad(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            self.grads.add(storage_key(p.grad))

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.saved.add(storage_key(t))
        return t

    def __enter__(self) -> LiveMemory:
        for t in (*self._params(), *self._state()):
            self._add(t)
        for p in self._params():
            if p.grad is not None:
                self._add(p.grad)
                self._record_grad(p)
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._record_grad))
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._saved_hooks.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._saved_hooks.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.peak.by_category = self._split(self._peak_keys)

    def _split(self, keys: dict[int, int]) -> dict[str, int]:
        params = {storage_key(p) for p in self._params()}
        state = {storage_key(t) for t in self._state()}
        out = dict.fromkeys(CATEGORIES, 0)
        for key, nbytes in keys.items():
            if key in params:
                out["params"] += nbytes
            elif key in state:
                out["optimizer"] += nbytes
            elif key in self.grads:
                out["grads"] += nbytes
            elif key in self.saved:
                out["activations"] += nbytes
            else:
                out["temporaries"] += nbytes
        return out
