"""A dry run of a strategy's real setup on a simulated cluster of any size, in one process.

:func:`dry_run` builds the strategy and a ``lightning.Trainer`` for the cluster shape (the Trainer's
constructor runs the strategy's own checks of sizes and precision), then, for each chosen rank, makes this
process that rank of a simulated world (:func:`~lit_parallel.parallel.simulated.simulated_world`: torch's fake
backend, nothing communicated), connects the model built on the meta device (the strategy's model checks:
blocks, tensor-parallel plan, pipeline split, experts) and runs the strategy's own ``_parallelize`` on the
device mesh it builds. The model stays on the meta device (nothing is materialised while the world is
simulated), and the parameters are left with the placements and local shapes they would have on that rank;
:func:`~lit_parallel.planner.dry_run.rank_state` reads them. An error the setup raises is reported with its
message (the strategies' messages name the value, the rule and the fix) instead of propagating.

``ddp_tuned`` replicates the model: its dry run runs the Trainer's checks and counts the whole model (DDP
itself cannot wrap a meta-device module). ``auto_parallel`` is dry-run as the strategy it chooses for the
model and cluster (its decision, from the advisor's rules, is reported).
"""

from __future__ import annotations

import itertools
import logging
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import nn

from lit_parallel._compat import set_device_mesh
from lit_parallel.parallel.mesh import DP_REPLICATE, PP
from lit_parallel.parallel.simulated import simulated_world
from lit_parallel.planner.dry_run import RankState, rank_state
from lit_parallel.planner.dry_run.step import (
    StepMemory,
    fake_inputs,
    fake_module,
    fake_step_context,
    measure_step,
)
from lit_parallel.planner.simulation import default_loss

STRATEGIES = ("ddp_tuned", "fsdp_blocks", "hsdp", "tp_dp", "pp_dp")
# the parameter dtype of Lightning's "-true" precisions other than 32-true
_TRUE_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64}


@dataclass
class DryRun:
    """What the dry run of one strategy found.

    Attributes:
        strategy: the strategy's registry name (for ``auto_parallel``: the one it chose).
        kwargs: the arguments it was built with.
        world_size: ranks simulated.
        mesh: the mesh, in words (``None`` when the setup failed before it).
        ranks: the state of each rank dry-run, in the order run (empty when the setup failed).
        error: the error the real setup would raise (``"ValueError: ..."``), or ``None``.
        log: what the strategy logged at setup on the first rank (its plans: blocks, tensor-parallel split,
            pipeline stages, experts).
        seconds: wall time of the whole dry run.
        decision: ``auto_parallel``'s decision in words, when it chose.
        sizes: the mesh's sizes (``world``, ``data_parallel_replicate``, ``data_parallel_shard``,
            ``tensor_parallel``, ``pipeline_parallel``, ``expert_parallel``).
        step: the first rank's peak of one training step measured on fake tensors
            (:mod:`lit_parallel.planner.dry_run.step`), when asked for and possible.
        step_note: why the step was not measured, when it was asked for.
    """

    strategy: str
    kwargs: dict[str, Any]
    world_size: int
    mesh: str | None = None
    ranks: list[RankState] = field(default_factory=list)
    error: str | None = None
    log: list[str] = field(default_factory=list)
    seconds: float = 0.0
    decision: str | None = None
    sizes: dict[str, int] = field(default_factory=dict)
    step: StepMemory | None = None
    step_note: str | None = None

    @property
    def largest(self) -> RankState | None:
        """The rank holding the most state."""
        return max(self.ranks, key=lambda r: r.state_bytes, default=None)

    def as_dict(self) -> dict[str, Any]:
        largest = self.largest
        return {
            "strategy": self.strategy,
            "kwargs": {
                k: repr(v) if not isinstance(v, (int, float, str, bool, type(None))) else v
                for k, v in self.kwargs.items()
            },
            "world_size": self.world_size,
            "mesh": self.mesh,
            "sizes": self.sizes,
            "error": self.error,
            "decision": self.decision,
            "seconds": self.seconds,
            "ranks": [r.as_dict() for r in self.ranks],
            "largest_rank": largest.rank if largest is not None else None,
            "step": self.step.as_dict() if self.step is not None else None,
            "step_note": self.step_note,
            "log": self.log,
        }


class _Wrapped(L.LightningModule):
    """A plain ``nn.Module`` as the strategies take it; its parameters are named ``model.<name>``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def pipeline_loss(self, output: Any, targets: Any) -> torch.Tensor:  # pp_dp's hook (never run here)
        raise NotImplementedError("a dry run runs no step")


@contextmanager
def _quiet() -> Iterator[list[str]]:
    """Lightning's banner and warnings silenced; what lit_parallel logs at INFO collected instead."""
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    ours, handler = logging.getLogger("lit_parallel"), Collect(logging.INFO)
    lightning = [logging.getLogger(n) for n in ("lightning.pytorch", "lightning.fabric", "lightning")]
    handlers, level, propagate = ours.handlers[:], ours.level, ours.propagate
    lightning_levels, rank = [lg.level for lg in lightning], rank_zero_only.rank
    ours.handlers = [handler]
    ours.setLevel(logging.INFO)
    ours.propagate = False
    for lg in lightning:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield lines
    finally:
        ours.handlers, ours.propagate = handlers, propagate
        ours.setLevel(level)
        for lg, lightning_level in zip(lightning, lightning_levels):
            lg.setLevel(lightning_level)
        rank_zero_only.rank = rank


def _build(
    name: str, kwargs: dict[str, Any], devices: int, num_nodes: int, precision: str
) -> tuple[Any, L.Trainer]:
    """The strategy ``name`` and a Trainer for the cluster shape holding it (its constructor checks the sizes
    and the precision, as on the cluster); ``auto_parallel`` too."""
    from lit_parallel.strategies.auto import CANDIDATES, AutoStrategy

    strategy = AutoStrategy(**kwargs) if name == "auto_parallel" else CANDIDATES[name](**kwargs)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=num_nodes,
        strategy=strategy,
        precision=precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return strategy, trainer


def _as_lightning(model: nn.Module) -> L.LightningModule:
    return model if isinstance(model, L.LightningModule) else _Wrapped(model)


def positions(mesh: Any) -> list[tuple[int, dict[str, int]]]:
    """The distinct rank positions of ``mesh``: every pipeline stage, the first replica (replicas hold the same),
    and the first and last coordinate of each other dimension (a shard of uneven rows is largest on the first
    rank and smallest on the last); as ``(global rank, {dimension: coordinate})``, rank 0 first."""
    names = mesh.mesh_dim_names
    choices = [
        range(size) if name == PP else [0] if name == DP_REPLICATE else sorted({0, size - 1})
        for name, size in zip(names, mesh.mesh.shape)
    ]
    out = []
    for coords in itertools.product(*choices):
        out.append((int(mesh.mesh[coords].item()), dict(zip(names, coords))))
    return out


def _setup_rank(
    name: str,
    kwargs: dict[str, Any],
    factory: Callable[[], nn.Module],
    devices: int,
    num_nodes: int,
    precision: str,
    rank: int,
    mode: Any = None,
) -> tuple[Any, nn.Module, Any, list[nn.Module]]:
    """The strategy's setup as rank ``rank`` of the simulated world: returns the strategy, the module, the mesh and the
    modules sharded apart from it (``pp_dp``'s stages). ``mode``: a ``FakeTensorMode`` the model is made fake
    in and set up under (for :func:`~lit_parallel.planner.dry_run.step.measure_step`)."""
    strategy, trainer = _build(name, kwargs, devices, num_nodes, precision)
    world = devices * num_nodes
    strategy.cluster_environment.set_global_rank(rank)
    strategy.cluster_environment.set_world_size(world)
    rank_zero_only.rank = rank
    inner = factory()
    if mode is not None:
        # torch cannot swap a fake parameter for its cast copy: the model is cast on meta, before it is made fake,
        # and this strategy's precision cast (for *-true precisions) left out, its work already done
        dtype = _TRUE_DTYPES.get(precision)
        if dtype is not None:
            inner.to(dtype)
            strategy.precision_plugin.convert_module = lambda m: m
        fake_module(inner, mode)
    module = _as_lightning(inner)
    module.trainer = trainer
    fake = mode if mode is not None else nullcontext()
    with fake:
        strategy.connect(module)
    if name == "ddp_tuned":
        with fake:
            return strategy, strategy.precision_plugin.convert_module(module), None, []
    mesh = strategy.parallel_dims.build_mesh("cpu")
    strategy._device_mesh = mesh
    set_device_mesh(module, mesh)
    with fake:
        strategy._parallelize()
    return strategy, strategy.model, mesh, list(getattr(strategy, "_stages", ()))


def dry_run(
    model: Callable[[], nn.Module],
    strategy: str,
    *,
    devices: int,
    num_nodes: int = 1,
    precision: str = "bf16-mixed",
    strategy_kwargs: dict[str, Any] | None = None,
    ranks: Sequence[int] | str = "positions",
    memory_gb: float = 80.0,
    step: bool = False,
    batch_size: int | None = None,
    seq_len: int | None = None,
) -> DryRun:
    """Run ``strategy``'s setup for ``model`` on a simulated cluster of ``num_nodes`` x ``devices`` ranks.

    Args:
        model: builds the model on the meta device (called once per rank dry-run), an ``nn.Module`` or a
            ``LightningModule``.
        strategy: a registry name: ``ddp_tuned``, ``fsdp_blocks``, ``hsdp``, ``tp_dp``, ``pp_dp`` or
            ``auto_parallel`` (dry-run as the strategy it chooses).
        strategy_kwargs: the strategy's arguments (``{"tensor_parallel_size": 8}``, ...).
        ranks: the global ranks to dry-run, ``"positions"`` (every distinct position: :func:`positions`) or
            ``"first"`` (rank 0 only).
        memory_gb: the memory of one device ``auto_parallel`` decides with.
        step: also run one training step of the first rank on fake tensors and measure its peak by category
            (:mod:`lit_parallel.planner.dry_run.step`; not for ``pp_dp``); ``batch_size`` and ``seq_len`` give
            its micro-batch (as ``advise``'s options: default the model's ``example_input_array``, or tokens).
    """
    from lit_parallel.strategies.auto import CANDIDATES

    start = time.perf_counter()
    kwargs = dict(strategy_kwargs or {})
    world = devices * num_nodes
    known = (*STRATEGIES, "auto_parallel")
    if strategy not in known:
        raise ValueError(f"strategy={strategy!r} is not one a dry run knows; use one of {', '.join(known)}")
    if isinstance(ranks, str) and ranks not in ("positions", "first"):
        raise ValueError(f"ranks={ranks!r} must be 'positions', 'first' or a list of global ranks")
    if not isinstance(ranks, str):
        bad = [r for r in ranks if not isinstance(r, int) or not 0 <= r < world]
        if bad or not ranks:
            raise ValueError(f"ranks={list(ranks)!r} must be global ranks of the world, 0 to {world - 1}")
    out = DryRun(strategy, kwargs, world)
    with _quiet() as lines:
        try:
            if strategy == "auto_parallel":
                out.strategy, extra, out.decision = _auto_choice(
                    model, devices, num_nodes, precision, memory_gb
                )
                out.kwargs = kwargs = {**extra, **kwargs}
            assert out.strategy in CANDIDATES
            measure = (batch_size, seq_len) if step else None
            _run_ranks(out, model, devices, num_nodes, precision, ranks, lines, measure)
        except Exception as err:  # noqa: BLE001 - the error is the report: what the real setup would raise
            out.error = f"{type(err).__name__}: {err}"
    out.seconds = time.perf_counter() - start
    return out


def _run_ranks(
    out: DryRun,
    factory: Callable[[], nn.Module],
    devices: int,
    num_nodes: int,
    precision: str,
    ranks: Sequence[int] | str,
    lines: list[str],
    measure: tuple[int | None, int | None] | None = None,
) -> None:
    world = devices * num_nodes
    # the Trainer's constructor runs the strategy's checks of sizes and precision, before any process group
    strategy, _ = _build(out.strategy, out.kwargs, devices, num_nodes, precision)
    if out.strategy != "ddp_tuned":
        dims = strategy.parallel_dims
        out.mesh = dims.describe()
        out.sizes = {
            "world": dims.world_size,
            "data_parallel_replicate": dims.data_parallel_replicate,
            "data_parallel_shard": dims.data_parallel_shard,
            "tensor_parallel": dims.tensor_parallel,
            "pipeline_parallel": dims.pipeline_parallel,
            "expert_parallel": dims.expert_parallel,
        }
    else:
        out.sizes = {"world": world, "data_parallel_replicate": world, "data_parallel_shard": 1}
    # the ranks asked for, or rank 0 first: its mesh gives the other positions
    todo = list(dict.fromkeys(ranks)) if not isinstance(ranks, str) else [0]
    done: set[int] = set()
    while todo:
        rank = todo.pop(0)
        if rank in done:
            continue
        first = not out.ranks
        step_input = _step_input(out, factory, measure) if first and measure is not None else None
        with simulated_world(world, rank), fake_step_context() if step_input else nullcontext() as mode:
            strategy, module, mesh, stages = _setup_rank(
                out.strategy, out.kwargs, factory, devices, num_nodes, precision, rank, mode
            )
            if step_input is not None:
                args, description = step_input
                out.step = measure_step(
                    module,
                    fake_inputs(args, mode),
                    default_loss,
                    mode,
                    input_description=description,
                    context=strategy.precision_plugin.forward_context,
                )
                if out.strategy == "ddp_tuned":
                    out.step_note = (
                        "ddp_tuned: the step of the model without DDP (DDP cannot wrap fake parameters): DDP keeps"
                        " the gradients in its buckets for the whole step, one more copy of them at the peak"
                    )
            coords: dict[str, int] = {}
            if mesh is not None:
                coords = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate() or ()))
                if first and ranks == "positions":
                    todo.extend(r for r, _ in positions(mesh) if r != rank)
            # FSDP2's root group lives on the wrapper: read the whole module, name parameters as the user does
            prefix = "model." if isinstance(module, _Wrapped) else ""
            state = rank_state(module, rank, coords, prefix=prefix, sharded_by=stages)
        if first:
            out.log = list(lines)
        out.ranks.append(state)
        done.add(rank)


def _step_input(
    out: DryRun, factory: Callable[[], nn.Module], measure: tuple[int | None, int | None]
) -> tuple[tuple, str] | None:
    """The micro-batch of the measured step (meta tensors) and its description, or ``None`` with the reason
    in ``out.step_note``."""
    from lit_parallel.parallel.example_inputs import NoExampleInput, meta_example_input

    if out.strategy == "pp_dp":
        out.step_note = (
            "pp_dp: not measured: its stages exchange activations point to point and the simulated process group"
            " delivers none, so a later stage has nothing to compute on; advise's per-stage prediction stands"
        )
        return None
    batch_size, seq_len = measure
    try:
        example = meta_example_input(factory(), batch_size=batch_size, seq_len=seq_len)
    except NoExampleInput as err:
        out.step_note = f"not measured: {err}"
        return None
    return example.args, example.description


def _auto_choice(
    factory: Callable[[], nn.Module], devices: int, num_nodes: int, precision: str, memory_gb: float
) -> tuple[str, dict[str, Any], str]:
    """The strategy ``auto_parallel`` chooses for the model and cluster, its arguments, and why."""
    from lit_parallel.strategies.auto import strategy_choice

    strategy, _ = _build("auto_parallel", {"memory_gb": memory_gb}, devices, num_nodes, precision)
    module = _as_lightning(factory())
    # planning GPUs from a CPU process: the usable memory keeps CUDA's reserve
    advice = strategy.decide(module, device_type="cuda")
    name, extra = strategy_choice(advice, module)
    why = (
        "the model has no parameters"
        if advice is None
        else f"rule {advice.rule.number if advice.rule else '?'}"
    )
    arguments = f"({', '.join(f'{k}={v!r}' for k, v in extra.items())})" if extra else ""
    return name, extra, f"auto_parallel chose {name}{arguments} ({why})"
