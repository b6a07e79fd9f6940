"""torch's own memory tracker (``torch.distributed._tools.mem_tracker.MemTracker``): a second count of a step's
live tensor memory, beside :class:`~lit_parallel.measure.live_memory.LiveMemory`.

LiveMemory is the package's counter: ``advise --verify`` measures with it and the planner's simulation counts
with it on the meta device, so a fault in it would sit on both sides of that comparison. torch's tracker is
another implementation counting the same step (its own module, gradient and optimizer hooks, ``resize_`` of
storages patched, its own bookkeeping of live storages per device), so ``advise --verify`` reports its peak
too.

Its categories (:data:`CATEGORIES`) are its own: ``PARAM`` (parameters of the modules it tracks), ``BUFFER``
(their buffers), ``GRAD`` (gradients of parameters), ``ACT`` (made in forward), ``TEMP`` (made in backward),
``OPT`` (the optimizer's state and everything made inside ``optimizer.step``) and ``OTH`` (other tensors it
was given as existing: the batch). Lightning runs the forward and the backward inside ``optimizer.step`` (its
closure), so there everything a step makes is ``OPT``: the total, the parameters and the gradients are the
figures that count what LiveMemory's do (:data:`SAME_AS_LIVE_MEMORY`).

A private torch module, reached through :mod:`lit_parallel._compat` only; on a torch without it
:func:`start_mem_tracker` returns ``None`` after one log line (``_compat.FEATURES["mem_tracker"]``).
Pure PyTorch.
"""

from __future__ import annotations

from typing import Any

import torch

from lit_parallel import _compat

# torch's names of its categories (the members of its _MemRefType), in its order
CATEGORIES = ("PARAM", "BUFFER", "GRAD", "ACT", "TEMP", "OPT", "OTH")
# LiveMemory's figure -> torch's that counts the same bytes in a step run by Lightning
SAME_AS_LIVE_MEMORY = {"total": "total", "params": "PARAM", "grads": "GRAD"}


def start_mem_tracker(*existing: Any) -> Any | None:
    """A ``MemTracker`` entered now, with ``existing`` (modules, optimizers, tensors made before) counted as
    live from the start; ``None`` where torch has none (said once per process). Enter it inside any other
    ``TorchDispatchMode`` that must see the same ops, and stop it (:func:`stop_mem_tracker`) before that one."""
    if not _compat.has_feature("mem_tracker"):
        _compat.log_degraded("mem_tracker")
        return None
    tracker = _compat.MemTracker()
    tracker.track_external(*existing)
    tracker.__enter__()
    return tracker


def stop_mem_tracker(tracker: Any, device: torch.device | str = "cpu") -> dict[str, int]:
    """Exit ``tracker`` (from :func:`start_mem_tracker`) and return its peak on ``device``: ``total`` and the
    bytes of each of :data:`CATEGORIES` at that moment."""
    tracker.__exit__(None, None, None)
    return mem_tracker_peak(tracker, device)


def mem_tracker_peak(tracker: Any, device: torch.device | str = "cpu") -> dict[str, int]:
    """The peak ``tracker`` saw on ``device`` (``{"total": 0, ...}`` when nothing was live there)."""
    snapshot = tracker.get_tracker_snapshot("peak").get(torch.device(device), {})
    by_name = {getattr(k, "name", k): v for k, v in snapshot.items()}  # torch's keys: its enum and "Total"
    return {"total": by_name.get("Total", 0), **{c: by_name.get(c, 0) for c in CATEGORIES}}
