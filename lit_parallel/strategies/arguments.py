"""The arguments every strategy takes (:class:`CommonArguments`) and the argument checks the strategies
share, run when a strategy is built (before any process exists).

Each error names the value, the rule and the fix. An unknown argument name names the closest valid one.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

from lit_parallel import _compat
from lit_parallel.reliability import DebugLevel, PreemptionSignal, ReliabilityOptions
from lit_parallel.reliability.async_checkpoints import AsyncCheckpoint
from lit_parallel.reliability.options import check_stall_timeout_fits
from lit_parallel.reliability.stall import StallTimeout

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
# DistributedDataParallel arguments younger than the oldest supported torch -> their _compat feature
NEWER_DDP_ARGUMENTS = {"batched_grad_copy": "ddp_batched_grad_copy"}


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


@dataclasses.dataclass(frozen=True)
class CommonArguments:
    """The arguments every lit_parallel strategy takes, each with one name, default and meaning: the process
    group's backend and collective timeout, the reliability options
    (:class:`~lit_parallel.reliability.ReliabilityOptions`, ``async_checkpoint`` among them) and ``auto_resume``.

    Every strategy's ``__init__`` still lists them, because LightningCLI and the docs read the signature
    (``tests/strategies/test_arguments.py`` holds each signature to these fields' defaults and annotations).
    A strategy gathers them into one object with :meth:`from_arguments`, which checks every value (a
    ``ValueError`` that names the value, the rule and the fix); a strategy built on another passes them on
    with :meth:`pick`, ``AutoStrategy`` to the strategy it chooses with :meth:`as_kwargs`.
    """

    process_group_backend: str | None = None
    timeout: timedelta | None = default_pg_timeout
    debug_level: DebugLevel | None = None
    watchdog: bool = True
    preemption_signal: PreemptionSignal = "auto"
    stall_timeout: StallTimeout = "auto"
    auto_resume: bool = False
    async_checkpoint: AsyncCheckpoint = False

    def __post_init__(self) -> None:
        check_backend(self.process_group_backend)
        check_timeout(self.timeout)
        check_bool("auto_resume", self.auto_resume)
        options = (
            self.reliability_options()
        )  # checks debug_level, watchdog, preemption_signal and stall_timeout
        # a stall must be reported before a waiting collective times out (NCCL's watchdog reports nothing)
        check_stall_timeout_fits(options.stall_timeout, self.timeout)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The arguments' names, in the order every signature lists them (others may stand between)."""
        return tuple(field.name for field in dataclasses.fields(cls))

    @classmethod
    def pick(cls, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """The common arguments among a constructor's ``arguments`` (its ``locals()``), by name, unchecked."""
        return {name: arguments[name] for name in cls.names()}

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any]) -> CommonArguments:
        """The common arguments among a constructor's ``arguments`` (its ``locals()``), checked."""
        return cls(**cls.pick(arguments))

    def as_kwargs(self) -> dict[str, Any]:
        """By name, as every strategy's constructor takes them."""
        return {name: getattr(self, name) for name in self.names()}

    def process_group_kwargs(self) -> dict[str, Any]:
        """The ones Lightning's ``DDPStrategy`` and ``ModelParallelStrategy`` take themselves."""
        return {"process_group_backend": self.process_group_backend, "timeout": self.timeout}

    def reliability_options(self) -> ReliabilityOptions:
        """The reliability options among them (checked when built)."""
        return ReliabilityOptions(
            debug_level=self.debug_level,
            watchdog=self.watchdog,
            preemption_signal=self.preemption_signal,
            stall_timeout=self.stall_timeout,
            async_checkpoint=self.async_checkpoint,
        )


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
    for name, feature in NEWER_DDP_ARGUMENTS.items():
        if name in kwargs and not _compat.has_feature(feature):  # an older torch: drop it, say what is lost
            check_bool(name, kwargs[name])
            if kwargs.pop(name):
                _compat.log_degraded(feature)
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


def check_expert_arguments(expert_parallel_size: Any, expert_capacity_factor: Any) -> None:
    """``expert_parallel_size``: a positive integer; ``expert_capacity_factor``: ``None`` or a positive number."""
    if (
        not isinstance(expert_parallel_size, int)
        or isinstance(expert_parallel_size, bool)
        or expert_parallel_size < 1
    ):
        raise ValueError(
            f"expert_parallel_size={expert_parallel_size!r} must be a positive integer: the ranks an MoE layer's"
            " experts are split over (1 = off)"
        )
    if expert_capacity_factor is not None and (
        isinstance(expert_capacity_factor, bool)
        or not isinstance(expert_capacity_factor, (int, float))
        or expert_capacity_factor <= 0
    ):
        raise ValueError(
            f"expert_capacity_factor={expert_capacity_factor!r} must be None (no token dropped: exact) or a"
            " positive number (each expert takes at most ceil(factor * pairs / experts) of a rank's pairs)"
        )
