"""Count the points where the host waits for a tensor's value (``.item()``, ``float(t)``, ``bool(t)``, ``int(t)``).

Each of them is ``aten._local_scalar_dense``: on an accelerator a device->host copy that waits for every
kernel queued before it, so the device runs dry while Python catches up. :class:`HostSyncCounter` is a
``TorchDispatchMode`` counting those calls, which it sees on CPU tensors too: a CPU run shows where a CUDA run
would synchronise. It does not see device->host copies that are not a scalar read (``.cpu()``,
``.to("cpu")``, ``.tolist()``, ``.numpy()``); on CUDA ``torch.cuda.set_sync_debug_mode("warn")`` reports
those.
"""

from __future__ import annotations

import traceback
from typing import Any

from lit_parallel._compat import TorchDispatchMode

# how many frames of the caller's stack each sync keeps (``where``), innermost last
_FRAMES = 12


class HostSyncCounter(TorchDispatchMode):
    """Counts the host syncs issued on this thread while active (use as a context manager).

    ``count`` is the number of scalar reads so far (``reset()`` starts again: e.g. once per optimizer step);
    with ``where=True`` each one's Python stack is kept in ``stacks`` (to find them).
    A DTensor's ``.item()`` counts once (its local tensor's read).
    """

    def __init__(self, where: bool = False) -> None:
        super().__init__()
        self.where = where
        self.count = 0
        self.stacks: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            # DTensor reads its local tensor, which comes back here: count that one only
            return NotImplemented
        if func.name() == "aten::_local_scalar_dense":
            self.count += 1
            if self.where:
                self.stacks.append("".join(traceback.format_stack(limit=_FRAMES)[:-1]))
        return func(*args, **(kwargs or {}))

    def reset(self) -> None:
        self.count = 0
        self.stacks.clear()
