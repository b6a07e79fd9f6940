"""AutoStrategy ("auto_parallel"): measure the model and the devices, then hand over to the strategy that fits.

The choice is made by the advisor's ordered rules (:data:`lit_parallel.planner.rules.RULES`, the same
table ``lit-parallel advise`` prints and the documentation shows) as soon as the model is known: under
Lightning's launcher before it starts the other ranks, otherwise when the Trainer attaches the model
(``connect``). That is before any process group exists, on every rank, from numbers every rank computes
alike (parameter counts, world size, device memory). A model with no parameters then (layers built in
``setup()``) is decided at Lightning's barrier right after the ``setup()`` hooks: until then this strategy
runs as a ``DDPStrategy`` (its process group serves ``prepare_data`` and ``setup()``), and the chosen one
takes the process group over.

How the hand-over works, and why this way: Lightning fixes the Trainer's strategy when the Trainer is
built, before the model is known, and offers no public way to replace it later. A proxy delegating every
call to the chosen strategy would not pass for it: Lightning's callbacks and users' code check the
strategy's class (``isinstance(trainer.strategy, ...)``). So, once the model is known, this
strategy builds the chosen one, gives it what Lightning configured here (accelerator, precision,
checkpoint IO, devices, cluster environment, number of nodes through their public setters; the launcher,
which in the launching process holds the other ranks, and the layer sync and model, which have none),
points the Trainer at it (``trainer.strategy`` reads the accelerator connector's strategy on every access:
the one private Lightning attribute this needs) and continues with the chosen strategy's own step. From
then on ``trainer.strategy`` *is* the chosen strategy (``isinstance(trainer.strategy,
TransformerFSDPStrategy)`` holds once ``fit`` has started); this object stays a ``DDPStrategy`` that keeps
``advice`` and ``chosen`` for whoever holds a reference to it.
"""

from __future__ import annotations

import copy
import inspect
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import DDPStrategy, ParallelStrategy
from lightning.pytorch.utilities.model_helpers import is_overridden
from typing_extensions import override

from lit_parallel._compat import hand_over_lightning_state, set_trainer_strategy
from lit_parallel._logging import info
from lit_parallel.planner.rules import (
    DEFAULT_MEMORY_HEADROOM,
    GB,
    PRECISIONS,
    RULES,
    Advice,
    advise,
    device_memory_bytes,
    pipeline_plan_for,
)
from lit_parallel.reliability import DebugLevel, PreemptionSignal
from lit_parallel.reliability.async_checkpoints import AsyncCheckpoint
from lit_parallel.reliability.stall import StallTimeout
from lit_parallel.rng import capture_rng_state, restore_rng_state
from lit_parallel.strategies.arguments import CommonArguments, checked_argument_names, unknown_argument
from lit_parallel.strategies.ddp import TunedDDPStrategy
from lit_parallel.strategies.fsdp import TransformerFSDPStrategy
from lit_parallel.strategies.hsdp import HybridShardStrategy
from lit_parallel.strategies.pipeline import PipelineParallelStrategy
from lit_parallel.strategies.reliable import ReliableStrategyMixin
from lit_parallel.strategies.tensor_parallel import TensorParallelStrategy

CANDIDATES: dict[str, type[ParallelStrategy]] = {
    "ddp_tuned": TunedDDPStrategy,
    "tp_dp": TensorParallelStrategy,
    "hsdp": HybridShardStrategy,
    "pp_dp": PipelineParallelStrategy,
    "fsdp_blocks": TransformerFSDPStrategy,
}
assert set(CANDIDATES) == {rule.strategy for rule in RULES}


class AutoStrategy(ReliableStrategyMixin, DDPStrategy):
    """Chooses ``ddp_tuned``, ``tp_dp``, ``hsdp``, ``pp_dp`` or ``fsdp_blocks`` for the model and devices.

    As soon as the model is known, the strategy counts its parameters, finds its transformer blocks,
    estimates activations when the model has an ``example_input_array`` (or takes tokens), reads the memory
    of one device, and applies the advisor's rules in order:

    1. the whole model state fits one device: ``ddp_tuned``;
    2. one transformer block (parameters and gradients in compute precision, plus activations) does not
       fit one device even when everything else is sharded: ``tp_dp`` (tensor parallel inside a node);
    3. several nodes, and the state sharded inside one node fits: ``hsdp``;
    4. several nodes, the state sharded inside one node does not fit, but cut into pipeline stages (one
       per group of nodes) it does: ``pp_dp`` with ``microbatches = 4 x stages`` (the bubble, (P - 1) /
       (M + P - 1), is in the evidence); a module without ``pipeline_loss`` gets ``fsdp_blocks``, logged;
    5. the model's experts (MoE layers) hold at least half of its parameters and an expert-parallel size
       above 1 divides both every MoE layer's experts and the devices of a node: ``fsdp_blocks`` with
       ``expert_parallel_size`` the largest such size (each rank holds and gathers 1/e of the experts;
       tokens travel to them by all-to-all);
    6. the state and activations sharded over every rank do not fit, but with tensor parallelism inside a
       node (which also splits the activations inside blocks) they do: ``tp_dp``;
    7. otherwise: ``fsdp_blocks``.

    The decision, the evidence for each rule and the per-rank memory table of every strategy are logged
    on rank 0 (logger ``lit_parallel``) and kept as ``trainer.strategy.advice``
    (:class:`~lit_parallel.planner.rules.Advice`). From then on ``trainer.strategy`` is the chosen
    strategy; this object, a ``DDPStrategy`` until then (every candidate uses the same launcher), keeps
    ``advice`` and ``chosen``.

    Args:
        memory_gb: memory of one device in GB (1e9 bytes). Default: the CUDA device's total memory; on CPU
            the machine's RAM divided by the processes per node.
        memory_headroom: the share of ``memory_gb`` a strategy must leave free to fit (default 0.10: the
            caching allocator's fragmentation, temporaries the accounting does not count); on a GPU a further
            1 GB per process is kept for the CUDA context and NCCL's buffers
            (:func:`~lit_parallel.planner.rules.usable_memory`).
        strategy_kwargs: arguments for the chosen strategy, by registry name, e.g.
            ``{"fsdp_blocks": {"activation_checkpointing": True}, "ddp_tuned": {"comm_hook": "fp16"}}``.
            Checked when this strategy is built, by building each named strategy once (no process group).
        process_group_backend, timeout, debug_level, watchdog, preemption_signal, stall_timeout,
            auto_resume, async_checkpoint: as in every candidate strategy (process group backend and timeout,
            collective checks, ending every rank when one fails, the preemption signal, stall reports, resuming
            from the newest complete checkpoint, checkpoints written in the background), passed to the chosen
            one.

    The memory accounting follows the Trainer's ``precision`` (mixed precision: 2 + 2 + 12 bytes per
    parameter; ``"32-true"``: 4 + 4 + 8; ``"bf16-true"`` / ``"16-true"``: 2 + 2 + 4).
    """

    strategy_name = "auto_parallel"

    @checked_argument_names
    def __init__(
        self,
        memory_gb: float | None = None,
        strategy_kwargs: dict[str, dict[str, Any]] | None = None,
        memory_headroom: float = DEFAULT_MEMORY_HEADROOM,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        debug_level: DebugLevel | None = None,
        watchdog: bool = True,
        preemption_signal: PreemptionSignal = "auto",
        stall_timeout: StallTimeout = "auto",
        auto_resume: bool = False,
        async_checkpoint: AsyncCheckpoint = False,
    ) -> None:
        if memory_gb is not None and (
            isinstance(memory_gb, bool) or not isinstance(memory_gb, (int, float)) or not memory_gb > 0
        ):
            raise ValueError(f"memory_gb={memory_gb!r} must be a positive number of GB (1e9 bytes) or None")
        if (
            isinstance(memory_headroom, bool)
            or not isinstance(memory_headroom, (int, float))
            or not 0 <= memory_headroom < 1
        ):
            raise ValueError(
                f"memory_headroom={memory_headroom!r} must be a fraction of device memory kept free, at least 0"
                f" and below 1 (default {DEFAULT_MEMORY_HEADROOM})"
            )
        strategy_kwargs = dict(strategy_kwargs or {})
        for name, kwargs in strategy_kwargs.items():
            if name not in CANDIDATES:
                raise ValueError(
                    f"strategy_kwargs has key {name!r}; the strategies auto_parallel chooses from are"
                    f" {', '.join(map(repr, CANDIDATES))}"
                )
            if not isinstance(kwargs, dict):
                raise ValueError(f"strategy_kwargs[{name!r}]={kwargs!r} must be a dict of arguments")
            for reserved in CommonArguments.names():  # every candidate gets AutoStrategy's own
                if reserved in kwargs:
                    raise ValueError(
                        f"strategy_kwargs[{name!r}] sets {reserved!r}; pass it to AutoStrategy({reserved}=...)"
                        " so every candidate gets it"
                    )
            _check_candidate_kwargs(name, kwargs)
        common = CommonArguments.from_arguments(locals())
        super().__init__(**common.process_group_kwargs())
        self._init_common(common)
        self._memory_gb = memory_gb
        self._memory_headroom = float(memory_headroom)
        self._strategy_kwargs = strategy_kwargs
        self.advice: Advice | None = None
        self.chosen: ParallelStrategy | None = None
        self._deferred = False

    def _validate_before_launch(self, trainer: Any, model: Any) -> None:
        # Under Lightning's launcher the model is known before the other ranks start: decide now, and let
        # the chosen strategy check its configuration before any rank is started. A model without
        # parameters yet (built in ``setup()``) is decided on every rank after ``setup()`` instead.
        if model is not None and _has_parameters(model):
            self._chosen_for(trainer, model)._validate_before_launch(trainer, model)

    @override
    def connect(self, model: Any) -> None:
        # Without Lightning's launcher (torchrun, SLURM) the model is first known here; the Trainer has
        # attached it (``fit`` does before connecting).
        trainer = getattr(model, "_trainer", None)
        if trainer is None:
            # connected before any Trainer holds it (Lightning's own data-connector tests do this): nothing
            # to measure against yet, so behave as any parallel strategy does; fit connects it again
            super().connect(model)
            return
        self._deferred = (self.chosen is None or trainer.strategy is self) and not _has_parameters(model)
        if self._deferred:
            info(
                "auto_parallel: the model has no parameters yet (layers built in setup()?): the strategy is"
                " chosen after the setup() hooks, when the model exists"
            )
            super().connect(model)
            return
        self._chosen_for(trainer, model).connect(model)

    @override
    def setup_distributed(self) -> None:
        # only for a deferred decision: the process group exists for prepare_data and setup(), as always
        self.reliability.setup_process_group(self, super().setup_distributed)

    @override
    def barrier(self, name: str | None = None, *args: Any, **kwargs: Any) -> None:
        super().barrier(name, *args, **kwargs)
        if name == "post_setup" and self._deferred:  # Lightning's barrier right after the setup() hooks
            self._deferred = False
            self._decide_after_setup()

    def _decide_after_setup(self) -> None:
        model = self.lightning_module
        trainer = model.trainer
        chosen = self._chosen_for(trainer, model)
        chosen.connect(model)
        # The chosen strategy takes over this process group and what was set up around it (the failure
        # reporter, the preemption handler, ownership) instead of starting them a second time.
        chosen.reliability = self.reliability  # type: ignore[attr-defined]
        owns = self.reliability.owns_process_group
        # Lightning's set-up re-seeds (``reset_seed``) as it did before setup(): keep the RNG where setup()
        # left it, as it is under a strategy given explicitly
        rng = capture_rng_state()
        chosen.setup_environment()  # finds the process group; builds its device mesh
        restore_rng_state(rng)
        self.reliability.owns_process_group = owns

    def _chosen_for(self, trainer: Any, model: Any) -> ParallelStrategy:
        """The chosen strategy, built and made ``trainer.strategy`` the first time ``trainer`` asks."""
        # The launcher keeps calling this object (e.g. a second ``fit``): the Trainer already has the
        # chosen strategy then, which holds the model trained so far. A new Trainer decides afresh.
        if self.chosen is None or trainer.strategy is self:
            advice = self.decide(model)
            name, extra = strategy_choice(advice, model)
            chosen = CANDIDATES[name](**{**extra, **self._kwargs_for(name)})
            self._hand_over(chosen)
            chosen.advice = advice  # type: ignore[attr-defined]
            self.advice, self.chosen = advice, chosen
            set_trainer_strategy(trainer, chosen)
        return self.chosen

    def _hand_over(self, chosen: ParallelStrategy) -> None:
        """Give ``chosen`` what Lightning's accelerator connector configured on this strategy."""
        chosen.accelerator = self.accelerator
        chosen.precision_plugin = self.precision_plugin
        chosen.cluster_environment = self.cluster_environment
        chosen.parallel_devices = self.parallel_devices
        chosen.num_nodes = self.num_nodes  # type: ignore[attr-defined]
        hand_over_lightning_state(self, chosen)
        chosen.set_world_ranks()  # type: ignore[attr-defined]

    @property
    def _common_kwargs(self) -> dict[str, Any]:
        """The common arguments by name, as this strategy passes them to the one it chooses."""
        return self.common_arguments.as_kwargs()

    def _kwargs_for(self, name: str) -> dict[str, Any]:
        """The arguments of the candidate ``name``: the common ones (every candidate takes them) and its
        ``strategy_kwargs``."""
        return {**self._common_kwargs, **self._strategy_kwargs.get(name, {})}

    def decide(self, model: Any, device_type: str | None = None) -> Advice | None:
        """Measure ``model`` and the devices and apply the rules (no process group needed); ``None`` for a
        model without parameters (nothing to shard: ``ddp_tuned``).

        Args:
            device_type: the type of the devices the memory is of; default: this strategy's root device's.
                A dry run plans for GPUs from a CPU process and passes ``"cuda"``, so the 1 GB a CUDA process
                reserves is kept (:func:`~lit_parallel.planner.rules.usable_memory`).
        """
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
        if not any(True for _ in measured.parameters()):
            info(
                "auto_parallel: the model has no parameters (also after setup() and configure_model()):"
                " nothing to shard or replicate, so ddp_tuned (advice is None)"
            )
            return None
        advice = advise(
            model=measured,
            devices=self.num_processes,
            nodes=self.num_nodes,
            memory_gb=memory_gb,
            precision=precision,
            block_types=block_types,
            memory_headroom=self._memory_headroom,
            # a GPU's memory also holds the CUDA context and NCCL's buffers, outside the allocator
            device_type=device_type or self.root_device.type,
        )
        advice.memory_source = source
        info(advice.describe())
        for note in advice.model.notes if advice.model is not None else ():
            info(f"auto_parallel: {note}")
        return advice

    def _block_types(self) -> Any:
        for name in ("fsdp_blocks", "hsdp", "tp_dp"):
            block_types = self._strategy_kwargs.get(name, {}).get("block_types")
            if block_types is not None:
                return block_types
        return "auto"

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="Measures model and devices, then hands over to ddp_tuned, tp_dp, hsdp or fsdp_blocks",
        )


def _has_parameters(model: torch.nn.Module) -> bool:
    """Whether the model (or its ``configure_model`` layers) has parameters to measure now."""
    return any(True for _ in _measurable(model).parameters())


def _measurable(model: torch.nn.Module) -> torch.nn.Module:
    """The model itself, or, when its layers are only created in ``configure_model``, a copy with them
    created on the meta device (the real model is left untouched)."""
    if any(True for _ in model.parameters()) or not is_overridden("configure_model", model):
        return model
    try:
        trainer = model.trainer
    except RuntimeError:  # not attached to a Trainer yet (under Lightning's launcher)
        trainer = None
    # The copy must not copy the Trainer: every reference to it becomes None in the copy.
    probe = copy.deepcopy(model, {id(trainer): None}) if trainer is not None else copy.deepcopy(model)
    with torch.device("meta"):
        probe.configure_model()
    return probe


def _check_candidate_kwargs(name: str, kwargs: dict[str, Any]) -> None:
    """``strategy_kwargs[name]``, checked as the candidate checks its own arguments: a trial construction
    (no process group; every candidate checks each argument when it is built)."""
    cls = CANDIDATES[name]
    params = inspect.signature(cls).parameters
    # a candidate that takes **kwargs (ddp_tuned, hsdp) checks those names itself when it is built
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    try:
        for key, value in kwargs.items():
            if key not in params and not open_ended:
                raise unknown_argument(cls.__name__, key, value, params)
        cls(**kwargs)
    except (TypeError, ValueError) as err:
        raise ValueError(f"strategy_kwargs[{name!r}]={kwargs!r} does not fit {cls.__name__}: {err}") from None


def strategy_choice(advice: Advice | None, model: Any) -> tuple[str, dict[str, Any]]:
    """The strategy to build for ``advice`` and the arguments the advice sets: ``fsdp_blocks``'s
    ``expert_parallel_size`` (rule 5), for ``pp_dp`` the stages and micro-batches of its evidence, or
    ``fsdp_blocks`` when the module has no ``pipeline_loss`` (with the expert-parallel size the advisor found
    for the model, if any: it is what rule 5 would have chosen)."""
    if advice is None:
        return "ddp_tuned", {}
    if advice.recommendation != "pp_dp":
        return advice.recommendation, advice.strategy_arguments
    if not callable(getattr(model, "pipeline_loss", None)):
        ep = advice.expert_parallel_size
        extra = {"expert_parallel_size": ep} if ep > 1 else {}
        info(
            "auto_parallel: the advice is pp_dp, but the LightningModule has no pipeline_loss(output, targets)"
            " (see docs/reference/strategies/pp_dp.md), so fsdp_blocks (sharded over every rank"
            + (f", expert_parallel_size={ep}" if extra else "")
            + ") instead"
        )
        return "fsdp_blocks", extra
    row = advice.row("HSDP")
    stages = pipeline_plan_for(
        row.state_bytes, row.activation_bytes or 0.0, advice.usable_bytes, advice.nodes
    )
    # as the evidence counts it: each stage is a group of nodes, sharded inside a node, replicated across
    # the stage's nodes (no parameter crosses a node; activations go stage to stage)
    return "pp_dp", {
        "pipeline_parallel_size": stages,
        "microbatches": 4 * stages,
        "data_parallel_replicate_size": advice.nodes // stages,
    }
