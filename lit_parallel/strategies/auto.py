"""AutoStrategy ("auto_parallel"): measure the model and the devices, then become the strategy that fits.

The choice is made by the advisor's ordered rules (:data:`lit_parallel.parallel.advisor.RULES`, the same
table ``lit-parallel advise`` prints and the documentation shows) as soon as the model is known: under
Lightning's launcher before it starts the other ranks, otherwise when the Trainer attaches the model
(``connect``). That is before any process group exists, on every rank, from numbers every rank computes
alike (parameter counts, world size, device memory). From then on the object *is* the chosen strategy
(its class is replaced, and its state is that of a freshly built one plus what Lightning configured), so
it behaves exactly as the chosen one: ``isinstance(trainer.strategy, TransformerFSDPStrategy)`` holds
once ``fit`` has started.
"""

from __future__ import annotations

import copy
import inspect
import logging
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.strategies import DDPStrategy, Strategy
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from typing_extensions import override

from lit_parallel.parallel.advisor import GB, PRECISIONS, RULES, Advice, advise, device_memory_bytes
from lit_parallel.reliability import DebugLevel, PreemptionSignal, ReliabilityMixin
from lit_parallel.strategies.ddp import TunedDDPStrategy
from lit_parallel.strategies.fsdp import TransformerFSDPStrategy
from lit_parallel.strategies.hsdp import HybridShardStrategy
from lit_parallel.strategies.tensor_parallel import TensorParallelStrategy

log = logging.getLogger(__name__)

CANDIDATES: dict[str, type[Strategy]] = {
    "ddp_tuned": TunedDDPStrategy,
    "tp_dp": TensorParallelStrategy,
    "hsdp": HybridShardStrategy,
    "fsdp_blocks": TransformerFSDPStrategy,
}
assert set(CANDIDATES) == {rule.strategy for rule in RULES}

# Arguments every candidate takes; AutoStrategy passes its own to the chosen one.
_COMMON = ("process_group_backend", "timeout", "debug_level", "watchdog", "preemption_signal")

# What Lightning's accelerator connector sets on the strategy before the model is known; the chosen
# strategy takes these over. The launcher object is kept: in the launching process it holds the child
# processes, which Lightning kills through it when training fails (and it refers to this very object,
# which becomes the chosen strategy).
_INHERITED = (
    "_accelerator",
    "_checkpoint_io",
    "_precision_plugin",
    "_launcher",
    "_lightning_module",
    "cluster_environment",
    "_parallel_devices",
    "_layer_sync",
)


class AutoStrategy(ReliabilityMixin, DDPStrategy):
    """Chooses ``ddp_tuned``, ``tp_dp``, ``hsdp`` or ``fsdp_blocks`` for the model and devices at hand.

    As soon as the model is known, the strategy counts its parameters, finds its transformer blocks,
    estimates activations when the model has an ``example_input_array`` (or takes tokens), reads the memory
    of one device, and applies the advisor's rules in order:

    1. the whole model state fits one device: ``ddp_tuned``;
    2. one transformer block (parameters and gradients in compute precision, plus activations) does not
       fit one device even when everything else is sharded: ``tp_dp`` (tensor parallel inside a node);
    3. several nodes, and the state sharded inside one node fits: ``hsdp``;
    4. otherwise: ``fsdp_blocks``.

    The decision, the evidence for each rule and the per-rank memory table of every strategy are logged
    on rank 0 (logger ``lit_parallel``) and kept as ``trainer.strategy.advice``
    (:class:`~lit_parallel.parallel.advisor.Advice`). From then on the strategy object is the chosen one.
    Until the model is known it is a ``DDPStrategy`` (every candidate uses the same launcher). Its bases
    mirror the candidates' (``ReliabilityMixin`` first), which lets the object change class.

    Args:
        memory_gb: memory of one device in GB (1e9 bytes). Default: the CUDA device's total memory; on CPU
            the machine's RAM divided by the processes per node. Pass less than the total to keep headroom.
        strategy_kwargs: arguments for the chosen strategy, by registry name, e.g.
            ``{"fsdp_blocks": {"activation_checkpointing": True}, "ddp_tuned": {"comm_hook": "fp16"}}``.
            Checked against each strategy's signature when this strategy is built.
        process_group_backend, timeout, debug_level, watchdog, preemption_signal: as in every candidate
            strategy (process group backend and timeout, collective checks, ending every rank when one
            fails, the preemption signal), passed to the chosen one.

    The memory accounting follows the Trainer's ``precision`` (mixed precision: 2 + 2 + 12 bytes per
    parameter; ``"32-true"``: 4 + 4 + 8; ``"bf16-true"`` / ``"16-true"``: 2 + 2 + 4).
    """

    strategy_name = "auto_parallel"

    def __init__(
        self,
        memory_gb: float | None = None,
        strategy_kwargs: dict[str, dict[str, Any]] | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        debug_level: DebugLevel | None = None,
        watchdog: bool = True,
        preemption_signal: PreemptionSignal = "auto",
    ) -> None:
        if memory_gb is not None and (
            isinstance(memory_gb, bool) or not isinstance(memory_gb, (int, float)) or not memory_gb > 0
        ):
            raise ValueError(f"memory_gb={memory_gb!r} must be a positive number of GB (1e9 bytes) or None")
        strategy_kwargs = dict(strategy_kwargs or {})
        for name, kwargs in strategy_kwargs.items():
            if name not in CANDIDATES:
                raise ValueError(
                    f"strategy_kwargs has key {name!r}; the strategies auto_parallel chooses from are"
                    f" {', '.join(map(repr, CANDIDATES))}"
                )
            if not isinstance(kwargs, dict):
                raise ValueError(f"strategy_kwargs[{name!r}]={kwargs!r} must be a dict of arguments")
            for reserved in _COMMON:
                if reserved in kwargs:
                    raise ValueError(
                        f"strategy_kwargs[{name!r}] sets {reserved!r}; pass it to AutoStrategy({reserved}=...)"
                        " so every candidate gets it"
                    )
            try:
                inspect.signature(CANDIDATES[name]).bind(**kwargs)
            except TypeError as err:
                params = [p for p in inspect.signature(CANDIDATES[name]).parameters if p != "kwargs"]
                raise ValueError(
                    f"strategy_kwargs[{name!r}]={kwargs!r} does not fit {CANDIDATES[name].__name__}: {err};"
                    f" its arguments are {', '.join(params)}"
                ) from None
        super().__init__(process_group_backend=process_group_backend, timeout=timeout)
        self._init_reliability(
            debug_level=debug_level, watchdog=watchdog, preemption_signal=preemption_signal, timeout=timeout
        )
        self._memory_gb = memory_gb
        self._strategy_kwargs = strategy_kwargs
        self._common_kwargs = {
            "process_group_backend": process_group_backend,
            "timeout": timeout,
            "debug_level": debug_level,
            "watchdog": watchdog,
            "preemption_signal": preemption_signal,
        }
        self.advice: Advice | None = None

    @override
    def _validate_before_launch(self, trainer: Any, model: Any) -> None:
        # Under Lightning's launcher the model is known before the other ranks start: decide now, and let
        # the chosen strategy check its configuration before any rank is started.
        if model is not None:
            self._become_chosen(model)
            self._validate_before_launch(trainer, model)

    @override
    def connect(self, model: Any) -> None:
        self._become_chosen(model)
        self.connect(model)

    def _become_chosen(self, model: Any) -> None:
        advice = self.decide(model)
        chosen_cls = CANDIDATES[advice.recommendation]
        chosen = chosen_cls(**self._kwargs_for(advice.recommendation))
        inherited = {name: self.__dict__[name] for name in _INHERITED if name in self.__dict__}
        num_nodes = self.num_nodes
        # Become the chosen strategy: its class and a freshly built one's state, plus what Lightning
        # configured on this object (accelerator, precision, devices, cluster environment, launcher).
        self.__dict__.clear()
        self.__dict__.update(chosen.__dict__)
        self.__dict__.update(inherited)
        self.__class__ = chosen_cls
        self.num_nodes = num_nodes
        self.set_world_ranks()
        self.advice = advice

    def _kwargs_for(self, name: str) -> dict[str, Any]:
        cls = CANDIDATES[name]
        accepted = inspect.signature(cls).parameters
        kwargs = {k: v for k, v in self._common_kwargs.items() if k in accepted}
        dropped = {k: v for k, v in self._common_kwargs.items() if k not in accepted}
        defaults = inspect.signature(AutoStrategy).parameters
        changed = {k: v for k, v in dropped.items() if v is not defaults[k].default}
        if changed:
            raise ValueError(
                f"auto_parallel chose {name!r}, but {cls.__name__} does not take"
                f" {', '.join(f'{k}={v!r}' for k, v in changed.items())}; leave it at its default or choose"
                " the strategy yourself"
            )
        return {**kwargs, **self._strategy_kwargs.get(name, {})}

    def decide(self, model: Any) -> Advice:
        """Measure ``model`` and the devices and apply the rules (no process group needed)."""
        precision = str(getattr(self.precision_plugin, "precision", "32-true"))
        if precision not in PRECISIONS:
            raise ValueError(
                f"auto_parallel: Trainer(precision={precision!r}) is not one the memory accounting knows;"
                f" use one of {', '.join(PRECISIONS)}"
            )
        if self._memory_gb is not None:
            memory_gb, source = self._memory_gb, "memory_gb"
        else:
            memory_bytes, source = device_memory_bytes(self.root_device, self.num_processes)
            memory_gb = memory_bytes / GB
        block_types = self._block_types()
        measured = _measurable(model)
        advice = advise(
            model=measured,
            devices=self.num_processes,
            nodes=self.num_nodes,
            memory_gb=memory_gb,
            precision=precision,
            block_types=block_types,
        )
        advice.memory_source = source
        if rank_zero_only.rank == 0:
            log.info(advice.describe())
            for note in advice.model.notes if advice.model is not None else ():
                log.info(f"auto_parallel: {note}")
        return advice

    def _block_types(self) -> Any:
        for name in ("fsdp_blocks", "hsdp", "tp_dp"):
            block_types = self._strategy_kwargs.get(name, {}).get("block_types")
            if block_types is not None:
                return block_types
        return "auto"

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="Measures model and devices, then becomes ddp_tuned, tp_dp, hsdp or fsdp_blocks",
        )


def _measurable(model: torch.nn.Module) -> torch.nn.Module:
    """The model itself, or, when its layers are only created in ``configure_model``, a copy with them
    created on the meta device (the real model is left untouched)."""
    if any(True for _ in model.parameters()) or not is_overridden("configure_model", model):
        return model
    trainer = model.__dict__.get("_trainer")
    model._trainer = None  # a copy must not copy the Trainer
    try:
        probe = copy.deepcopy(model)
    finally:
        model._trainer = trainer
    with torch.device("meta"):
        probe.configure_model()
    return probe
