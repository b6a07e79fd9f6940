"""Argument checks shared by every strategy, run when the strategy is built (before any process exists).

Each error names the value, the rule and the fix. An unknown argument name names the closest valid one.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

START_METHODS = ("popen", "spawn", "fork", "forkserver")

# DistributedDataParallel arguments the strategy sets itself, and why they cannot be passed through.
_DDP_SET_BY_STRATEGY = {
    "module": "the strategy wraps the LightningModule itself",
    "device_ids": "the strategy passes each rank's own device",
    "output_device": "each rank's output stays on its own device (device_ids)",
    "process_group": "the strategy creates the process group when the ranks start; none exists when it is built",
    "device_mesh": "the strategy creates the process group when the ranks start; none exists when it is built",
    "bucket_cap_mb_list": "pass per-bucket sizes as bucket_cap_mb=[first, rest, ...] (MiB)",
}
# DDPStrategy's own arguments that TunedDDPStrategy takes through **kwargs (Lightning consumes them).
_LIGHTNING_DDP_ARGUMENTS = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")
_DDP_BOOL_FLAGS = ("init_sync", "check_reduction", "skip_all_reduce_unused_params", "batched_grad_copy")


def unknown_argument(owner: str, name: str, value: Any, valid: Iterable[str]) -> ValueError:
    """The error for an argument ``name`` that ``owner`` does not take: the closest valid name, or all."""
    valid = sorted(valid)
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f"did you mean {close[0]!r}?" if close else "there is no similar name."
    return ValueError(
        f"{owner}({name}={value!r}): unknown argument {name!r}; {hint} Valid names: {', '.join(valid)}"
    )


def checked_argument_names(init: Callable[..., None]) -> Callable[..., None]:
    """Decorates a strategy's ``__init__`` (one without ``**kwargs``): an argument name it does not take is
    refused with the closest valid name (:func:`unknown_argument`) instead of Python's bare ``TypeError``.
    The signature stays the same for ``inspect`` (LightningCLI reads it)."""
    params = inspect.signature(init).parameters
    valid = [name for name in params if name != "self"]

    @functools.wraps(init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        for name, value in kwargs.items():
            if name not in valid:
                raise unknown_argument(type(self).__name__, name, value, valid)
        init(self, *args, **kwargs)

    return wrapper


def check_bool(name: str, value: Any) -> None:
    """A flag must be ``True`` or ``False`` (a string such as ``"false"`` would count as true)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be True or False (a bool, not {type(value).__name__})")


def check_timeout(value: Any) -> None:
    """The collective timeout: a positive ``datetime.timedelta`` or ``None`` (torch's default)."""
    if value is None:
        return
    if not isinstance(value, timedelta) or value <= timedelta(0):
        raise ValueError(
            f"timeout={value!r} must be a positive datetime.timedelta (e.g. timedelta(minutes=30)) or None"
        )


def check_backend(value: Any) -> None:
    """The process group backend: a name such as ``"nccl"`` or ``"gloo"``, or ``None`` (chosen by device)."""
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(
            f"process_group_backend={value!r} must be a backend name such as 'nccl' or 'gloo', or None"
            " (chosen from the device)"
        )


def check_common(*, process_group_backend: Any, timeout: Any) -> None:
    """The process-group arguments every strategy takes."""
    check_backend(process_group_backend)
    check_timeout(timeout)


def check_optional_path(name: str, value: Any) -> None:
    """A file path (``str`` or ``pathlib.Path``) or ``None``."""
    if value is not None and not isinstance(value, (str, Path)):
        raise ValueError(f"{name}={value!r} must be a path (str or pathlib.Path) or None")


def check_ddp_kwargs(owner: str, kwargs: dict[str, Any], own_names: Iterable[str]) -> None:
    """``**kwargs`` passed through to Lightning's ``DDPStrategy`` and ``DistributedDataParallel``.

    Removes the arguments the strategy sets itself when they are ``None`` (their default, which LightningCLI
    passes: it fills in every argument of DDP's signature, e.g. ``output_device=None``,
    ``bucket_cap_mb_list=None``); refuses names neither takes, and a real value for those the strategy sets
    itself (with the reason). ``own_names``: the owner's
    named arguments, offered as valid names in the error.
    """
    for name in _DDP_SET_BY_STRATEGY:
        if name in kwargs and kwargs[name] is None:  # DDP's own default, which LightningCLI fills in
            del kwargs[name]
    ddp_params = set(inspect.signature(DistributedDataParallel.__init__).parameters) - {"self"}
    lightning_params = set(inspect.signature(DDPStrategy.__init__).parameters) - {"self", "kwargs"}
    for name, value in kwargs.items():
        if name in _DDP_SET_BY_STRATEGY:
            raise ValueError(f"{owner}({name}={value!r}) is not accepted: {_DDP_SET_BY_STRATEGY[name]}")
        if name not in ddp_params and name not in _LIGHTNING_DDP_ARGUMENTS:
            valid = (ddp_params | lightning_params | set(own_names)) - set(_DDP_SET_BY_STRATEGY) - {"kwargs"}
            raise unknown_argument(owner, name, value, valid)
    for name in _DDP_BOOL_FLAGS:
        if name in kwargs:
            check_bool(name, kwargs[name])
    period = kwargs.get("model_averaging_period")
    if period is not None and (not isinstance(period, int) or isinstance(period, bool) or period < 1):
        raise ValueError(
            f"model_averaging_period={period!r} must be a positive integer (optimizer steps) or None"
        )
    for name in ("ddp_comm_hook", "ddp_comm_wrapper"):
        if kwargs.get(name) is not None and not callable(kwargs[name]):
            raise ValueError(
                f"{name}={kwargs[name]!r} must be a function (see torch.distributed.algorithms) or None"
            )
