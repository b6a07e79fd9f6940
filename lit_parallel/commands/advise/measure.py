"""`lit-parallel advise --verify`: run the step the planner predicts on this machine and compare.

One process: a real ``lightning.Trainer`` (CPU, 32-true) trains the model for a few steps on the
predicted input; :class:`~lit_parallel.measure.live_memory.LiveMemory` measures the fourth step's peak
by category (torch keeps no allocator statistics for CPU memory, so live tensor storages are counted),
torch's own ``MemTracker`` counts the same step beside it (:mod:`lit_parallel.measure.mem_tracker`: an
independent check of the counter), and the lower quartile of the following steps is the step time. A real
launch (``--verify-ranks N``, default 2) does the same in every rank under ``ddp_tuned``, ZeRO-2,
``fsdp_blocks``, ``hsdp`` (two replicas, :func:`hybrid_layout`), ``tp_dp`` (tensor parallel over every rank)
and ``pp_dp`` (one launch), and measures the all-reduce bus bandwidth there for the communication term.

The rounds of an ``advise --verify`` launch made into one set of figures: the parts each rank timed
between a strategy's steps (at the slowest rank's pace) and the medians over the rounds. (:func:`combine_rounds`).

``pp_dp`` (:func:`measure_pipeline_step`, also used by `lit-parallel lab memory`):

The step is the one the planner predicts (:mod:`lit_parallel.planner.memory.pipeline`): the model's
``forward`` pipelined by :class:`~lit_parallel.strategies.pipeline.PipelineParallelStrategy` over every rank
of the launch (one stage per rank, data parallel size 1), the planner's default loss on each micro-batch,
AdamW. Every rank measures its own peak with :class:`~lit_parallel.measure.live_memory.LiveMemory` (the
fourth step, as for the other strategies); the stage with the largest peak is the figure. torch's MemTracker
does not count it: it refuses a module that runs more than once in a step, as a stage does per micro-batch.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lit_parallel.commands.launch import add_worker_arguments
from lit_parallel.measure.live_memory import CATEGORIES, MemoryPeak
from lit_parallel.planner.pipeline_layout import pipeline_microbatches
from lit_parallel.planner.time.step import StepTime, median_timing, typical_seconds

if TYPE_CHECKING:
    from lit_parallel.commands.advise.cost_timers import AllReduceTimer, FSDPCostTimer
    from lit_parallel.planner.time.step import PartsTimer

LAUNCH_STRATEGIES = ("ddp_tuned", "zero2", "fsdp_blocks", "hsdp", "tp_dp", "pp_dp")
CALIBRATION_REPEATS = 24  # calibration steps: the costs are differences of them, noisier than either
STEP_REPEATS = 12  # measured steps after the warm-up (their lower quartile is the step time)
# the launch (and one process) measures everything this many times, interleaved; each round's prediction is
# compared with that round's steps, and figures are medians over the rounds (why 5: docs/explanations/advise-accuracy.md)
ROUNDS = 5
# what a launcher tells a rank: hidden while a rank runs a one-process Trainer (Lightning would join the launch)
_LAUNCH_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
)


@dataclass
class Measured:
    """What one run measured: the peak by category (max over ranks) and the step seconds (lower quartile)."""

    strategy: str
    peak: MemoryPeak
    step_s: float
    busbw_gbps: float | None = None
    notes: list[str] = field(default_factory=list)


def _lightning_module(model: nn.Module):
    import lightning as L

    from lit_parallel.planner.simulation import default_loss

    class VerifyStep(L.LightningModule):
        """forward, the planner's default loss, backward, AdamW: the step that is predicted."""

        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch, batch_idx):
            args = tuple(batch)
            return default_loss(self.model(*args), args)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.model.parameters(), lr=1e-5)

    return VerifyStep()


def _probe(track_batch: int, live_from_start: Any = None, between: Any = None, mem_tracker: bool = False):
    from lightning.pytorch import Callback

    from lit_parallel._compat import tree_flatten
    from lit_parallel.measure.live_memory import LiveMemory
    from lit_parallel.measure.mem_tracker import start_mem_tracker, stop_mem_tracker

    class Probe(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.peak: MemoryPeak | None = None
            self.by_torch: dict[str, int] | None = None  # torch's MemTracker's peak (mem_tracker=True)
            self.tracker: Any = None  # LiveMemory while it counts
            self.torch_tracker: Any = None  # torch's MemTracker while it counts

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == track_batch:
                self.tracker = LiveMemory(pl_module, trainer.optimizers[0])
                self.tracker.__enter__()
                held = list(live_from_start(trainer, batch)) if live_from_start is not None else []
                self.tracker.count(held)
                if mem_tracker:  # inside LiveMemory, and stopped before it: both count the same ops
                    batch_tensors = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]
                    self.torch_tracker = start_mem_tracker(
                        pl_module, trainer.optimizers[0], *batch_tensors, *held
                    )
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            elapsed = time.perf_counter() - self.start
            if batch_idx == track_batch:
                if self.torch_tracker is not None:
                    tracker, self.torch_tracker = self.torch_tracker, None
                    self.by_torch = stop_mem_tracker(tracker, trainer.strategy.root_device)
                tracker, self.tracker = self.tracker, None
                tracker.__exit__(None, None, None)
                self.peak = tracker.peak
            elif batch_idx > track_batch:
                self.times.append(elapsed)
                if between is not None:
                    between()

        def abandon(self) -> bool:
            """After a failed run: stop the trackers still counting (torch's first: it is the inner mode),
            so that no dispatch mode outlives the run; whether torch's was one of them."""
            torch_counting = self.torch_tracker is not None
            for tracker in (self.torch_tracker, self.tracker):
                if tracker is not None:
                    with contextlib.suppress(Exception):  # the failure may have left it half-way
                        tracker.__exit__(None, None, None)
            self.torch_tracker = self.tracker = None
            return torch_counting

    return Probe()


class _FailedUnderMemTracker(Exception):
    """A run failed in its measured step while torch's MemTracker counted it (its cause: ``__cause__``)."""


def measure_step(
    model: nn.Module,
    inputs: tuple,
    *,
    strategy: Any = "auto",
    devices: int = 1,
    repeats: int = STEP_REPEATS,
    module: Any = None,
    live_from_start: Any = None,
    between: Any = None,
):
    """Train ``model`` for ``4 + repeats`` steps on ``inputs``; the fourth step's peak and the lower quartile
    of the ``repeats`` after it. Returns ``(peak, seconds)``. ``module``: the LightningModule to fit around
    ``model`` (default: forward, the planner's loss, AdamW). ``live_from_start(trainer, batch)``: tensors
    made before the measured step that are live all of it (counted from its start). ``between()``: called
    after each timed step, outside it (``advise --verify`` times the prediction's parts there)."""
    probe = _fit_probed(
        model, inputs, strategy, devices, repeats, module, live_from_start, between, mem_tracker=False
    )
    return probe.peak, typical_seconds(probe.times)


def measure_step_with_mem_tracker(
    model: nn.Module,
    inputs: tuple,
    *,
    strategy: Any = "auto",
    devices: int = 1,
    repeats: int = STEP_REPEATS,
    module: Any = None,
    live_from_start: Any = None,
    between: Any = None,
) -> tuple[MemoryPeak, dict[str, int] | None, float]:
    """:func:`measure_step` with its measured step counted by torch's ``MemTracker`` as well
    (:mod:`lit_parallel.measure.mem_tracker`). Returns ``(peak, torch's peak, seconds)``; torch's peak is
    ``None`` where torch has no MemTracker, or where it failed in the measured step (it refuses a model
    called twice in a step, as a pipeline stage is once per micro-batch): then the run is made again
    without it, and a WARNING says why (the check must not cost the measurement)."""
    from lit_parallel import _logging

    run = (model, inputs, strategy, devices, repeats, module, live_from_start, between)
    try:
        probe = _fit_probed(*run, mem_tracker=True)
    except _FailedUnderMemTracker as failed:
        cause = failed.__cause__
        _logging.warning(
            f"lit_parallel: torch's MemTracker failed in the measured step ({type(cause).__name__}: {cause});"
            " measured again without it, by LiveMemory alone"
        )
        probe = _fit_probed(*run, mem_tracker=False)
    return probe.peak, probe.by_torch, typical_seconds(probe.times)


def _fit_probed(
    model: nn.Module,
    inputs: tuple,
    strategy: Any,
    devices: int,
    repeats: int,
    module: Any,
    live_from_start: Any,
    between: Any,
    *,
    mem_tracker: bool,
):
    """The Trainer run of :func:`measure_step`; returns its probe (peaks and step times). Raises
    :class:`_FailedUnderMemTracker` from what the run raised while torch's MemTracker counted it."""
    import warnings

    import lightning as L

    probe = _probe(track_batch=3, live_from_start=live_from_start, between=between, mem_tracker=mem_tracker)
    for name in ("lightning.pytorch", "lightning.fabric", "lit_parallel"):  # every Trainer's tips and banners
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        precision="32-true",
        max_steps=4 + repeats,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[probe],
        use_distributed_sampler=False,  # every rank steps every batch: the measured steps are all there
    )
    loader = torch.utils.data.DataLoader([inputs] * (4 + repeats), batch_size=None)
    try:
        trainer.fit(module if module is not None else _lightning_module(model), loader)
    except Exception as err:
        if probe.abandon():
            raise _FailedUnderMemTracker() from err
        raise
    return probe


def calibrate(
    strategy: str | None = None, devices: int = 1, repeats: int = CALIBRATION_REPEATS
) -> dict[str, float]:
    """Median step seconds of each :mod:`~lit_parallel.planner.time.calibration` shape under ``strategy`` (a
    :data:`LAUNCH_STRATEGIES` name; ``None``: one process)."""
    from lit_parallel.planner.time.calibration import calibration_input, calibration_model, shapes_of

    out = {}
    if strategy == "pp_dp":  # its cost is per pipeline slot and per group of a stage
        from lit_parallel.commands.advise.measure import measure_pipeline_step
        from lit_parallel.planner.time.calibration import PIPELINE_SHAPES

        for name in PIPELINE_SHAPES:
            torch.manual_seed(0)
            _, out[name] = measure_pipeline_step(
                calibration_model(name), calibration_input(), devices=devices, repeats=repeats
            )
        return out
    for name in shapes_of(strategy):
        torch.manual_seed(0)
        _, out[name] = measure_step(
            calibration_model(name),
            calibration_input(),
            devices=devices,
            repeats=repeats,
            strategy="auto" if strategy is None else strategy_object(strategy, devices),
        )
    return out


def lightning_overhead(repeats: int = 10) -> float:
    """Seconds Lightning's loop adds to every step on this machine: the step time of a one-weight model."""
    _, step_s = measure_step(nn.Linear(1, 1), (torch.zeros(1, 1),), repeats=repeats)
    return step_s


def hybrid_layout(ranks: int) -> tuple[int, int]:
    """``(shard, replicas)`` of the ``hsdp`` a launch of ``ranks`` verifies: two replicas (each a pretend
    node of ``ranks / 2``), so that both of HSDP's collectives run; one replica per rank for an odd count."""
    shard = ranks // 2 if ranks % 2 == 0 else 1
    return shard, ranks // shard


def strategy_object(name: str, ranks: int = 2):
    """The lit_parallel strategy a launch of ``ranks`` verifies: ZeRO-2 is fsdp_blocks without resharding,
    ``hsdp`` shards over :func:`hybrid_layout`'s ranks, ``tp_dp`` is tensor parallel over every rank."""
    import lit_parallel as lp

    if name == "zero2":
        return lp.TransformerFSDPStrategy(reshard_after_forward=False)
    if name == "fsdp_blocks":
        return lp.TransformerFSDPStrategy()
    if name == "hsdp":
        return lp.HybridShardStrategy(shard_size=hybrid_layout(ranks)[0])
    if name == "tp_dp":
        return lp.TensorParallelStrategy(tensor_parallel_size=ranks, data_parallel_size=1)
    return lp.TunedDDPStrategy()


def between_step_timer(name: str, ranks: int) -> AllReduceTimer | FSDPCostTimer | None:
    """The :mod:`~lit_parallel.commands.advise.cost_timers` timer of the strategy ``name`` as a launch of ``ranks``
    verifies it (:func:`strategy_object`); ``None`` for ``ddp_tuned`` and ``pp_dp``. Every rank builds it at
    once: it makes process groups."""
    from lit_parallel.commands.advise.cost_timers import AllReduceTimer, FSDPCostTimer
    from lit_parallel.parallel.mesh import ParallelDims

    if name == "tp_dp":
        return AllReduceTimer()
    if name in ("zero2", "fsdp_blocks"):
        return FSDPCostTimer(ParallelDims.for_fsdp(ranks), reshard_after_forward=name == "fsdp_blocks")
    if name == "hsdp":
        return FSDPCostTimer(ParallelDims.for_hybrid_shard(ranks, hybrid_layout(ranks)[0]), True)
    return None


def peak_dict(peak: MemoryPeak) -> dict[str, int]:
    return {"total": peak.total, **{k: peak.by_category.get(k, 0) for k in CATEGORIES}}


def peak_from(d: dict[str, int]) -> MemoryPeak:
    return MemoryPeak(d["total"], {k: d[k] for k in CATEGORIES})


# --- the launch: python -m torch.distributed.run ... -m lit_parallel.commands.advise.measure --worker ---------------


def worker(args: argparse.Namespace) -> int:
    """In every rank: each strategy in turn on the same model and input; rank 0 writes the results."""
    import torch.distributed as dist

    from lit_parallel.commands.launch import init_ranks, write_result
    from lit_parallel.measure.collectives import bus_bandwidth
    from lit_parallel.planner.model_summary import load_model_class

    factory = load_model_class(args.model)
    kwargs = __import__("json").loads(args.model_kwargs or "{}")
    results: dict[str, Any] = {}
    names = args.strategies.split(",")
    init_ranks()  # the Trainers below use the process group as it is; the bandwidth measurement needs it
    plain = [n for n in names if n != "pp_dp"]
    timer = worker_timer(args, kwargs)
    # what each strategy adds (tp_dp: per all-reduce; FSDP: fixed and per group), timed between its steps as
    # the parts are (lit_parallel/commands/advise/cost_timers.py); built on every rank at once: they make groups
    costs = {name: between_step_timer(name, dist.get_world_size()) for name in plain}
    # In rounds: Lightning's per-step overhead and the calibration shapes in one process, timed here on every
    # rank at once (ranks that share a machine's cores and memory compute more slowly than one process
    # alone, and that is the compute they will have), then each strategy's step and right after it its
    # calibration. Between the strategy's steps every rank times the parts `advise` times in one process
    # (``timer``): this machine's speed drifts by tens of percent within a second, and so the prediction's
    # parts and the measured steps see it at the same moments. Every figure is the median over the rounds.
    rounds: list[dict[str, Any]] = []
    for _ in range(args.rounds):
        rounds.append({"alone": measure_alone(args)})
        for name in plain:
            if any("error" in r.get(name, {}) for r in rounds):
                continue
            # torch's MemTracker counts the first round's step too (the peaks reported are that round's)
            rounds[-1][name] = _measure_strategy(
                factory, kwargs, args, name, timer, costs[name], mem_tracker=len(rounds) == 1
            )
            if "error" not in rounds[-1][name]:
                rounds[-1][f"calibration.{name}"] = calibrate(name, args.devices, args.calibration_repeats)
    results.update(combine_rounds(rounds, plain))
    results["rounds"] = rounds  # each round's own figures, as measured
    # the doctor measurement, here: latency of a tiny all-reduce, bus bandwidth at the gradients' size
    tiny, _ = _all_reduce_seconds(torch.ones(1))
    seconds, n = _all_reduce_seconds(torch.ones(max(1, args.grad_bytes // 4)))
    results["latency_s"] = tiny
    results["busbw_gbps"] = bus_bandwidth(n * 4, max(1e-9, seconds - tiny), dist.get_world_size())[1]
    if dist.get_rank() == 0:
        write_result(args.result, results)
    # pp_dp can end the launch (see _measure_pipeline): no rank starts it before rank 0's results are written
    dist.barrier()
    if "pp_dp" in names:
        _measure_pipeline(factory, kwargs, args, results, timer)
    return 0


def _input_shape(args: argparse.Namespace) -> tuple[int, ...] | None:
    """``--input-shape 1,8,8`` as a tuple; ``None`` without it."""
    return tuple(int(x) for x in args.input_shape.split(",")) if args.input_shape else None


def worker_timer(args: argparse.Namespace, kwargs: dict) -> PartsTimer | None:
    """The :class:`~lit_parallel.planner.time.step.PartsTimer` of the unit `advise` timed
    (``--timing-unit``: a block's name, empty for the whole model); ``None`` without one."""
    if args.timing_unit is None:
        return None
    from lit_parallel.planner.model_summary import meta_model, shaped_input
    from lit_parallel.planner.time.step import PartsTimer

    _, module, _, _ = meta_model(args.model, kwargs)
    shape = _input_shape(args)
    # pp_dp's micro-batch, as advise predicts it (the launch's ranks are its stages)
    m = pipeline_microbatches(args.batch_size, args.devices) if args.batch_size else None
    return PartsTimer(
        module,
        block_name=args.timing_unit or None,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        example_inputs=shaped_input(shape),
        low_batch=args.batch_size // m if m else None,
    )


def _measure_strategy(
    factory: Any,
    kwargs: dict,
    args: argparse.Namespace,
    name: str,
    timer: PartsTimer | None,
    cost: AllReduceTimer | FSDPCostTimer | None = None,
    mem_tracker: bool = False,
) -> dict[str, Any]:
    """One strategy's measured step in this launch: every rank's peak, the step seconds and the parts
    ``timer`` timed between the steps (``cost``, a timer of :mod:`~lit_parallel.commands.advise.cost_timers`: what
    the strategy adds, timed there too, as ``timed_costs``), or the error. With ``mem_tracker``, every rank's
    peak by torch's MemTracker in the same step as well (``mem_tracker_peaks``; ``None`` entries where torch
    has none)."""
    import torch.distributed as dist

    model, inputs = _model_and_inputs(factory, kwargs, args)
    samplers = [t.sample for t in (timer, cost) if t is not None]
    run = dict(
        strategy=strategy_object(name, args.devices),
        devices=args.devices,
        repeats=args.repeats,
        between=(lambda: [f() for f in samplers]) if samplers else None,
    )
    try:
        if mem_tracker:
            peak, by_torch, step_s = measure_step_with_mem_tracker(model, inputs, **run)
        else:
            (peak, step_s), by_torch = measure_step(model, inputs, **run), None
    except Exception as err:  # a strategy this model cannot run: reported, the others still measured
        parts_timing(timer)  # what it sampled before failing belongs to no row
        if cost is not None:
            cost.samples = []
        return {"error": f"{type(err).__name__}: {err}"}
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak_dict(peak))
    out = {"peaks": peaks, "step_s": step_s, "timing": slowest_rank_timing(timer)}
    if mem_tracker:
        out["mem_tracker_peaks"] = [None] * dist.get_world_size()
        dist.all_gather_object(out["mem_tracker_peaks"], by_torch)
    if cost is not None:
        out["timed_costs"] = cost.costs()
    return out


@contextlib.contextmanager
def as_one_process():
    """Inside a launched rank, Lightning sees no launch meanwhile: a Trainer made here is one process."""
    hidden = {
        k: os.environ.pop(k)
        for k in list(os.environ)
        if k in _LAUNCH_VARIABLES or k.startswith("TORCHELASTIC")
    }
    try:
        yield
    finally:
        os.environ.update(hidden)


def measure_alone(args: argparse.Namespace) -> dict[str, Any]:
    """On every rank at the same moment, in one process (no strategy, no collective): Lightning's per-step
    overhead and the calibration shapes. Returns rank 0's figures: ``overhead_s`` and ``one_process``
    (seconds per calibration shape)."""
    import torch.distributed as dist

    with as_one_process():
        dist.barrier()
        overhead = lightning_overhead()
        dist.barrier()
        one_process = calibrate(None, 1, args.calibration_repeats)
    return {"overhead_s": overhead, "one_process": one_process}


def _model_and_inputs(factory: Any, kwargs: dict, args: argparse.Namespace) -> tuple[nn.Module, tuple]:
    from lit_parallel.parallel.example_inputs import meta_example_input, real_inputs, vocabulary

    torch.manual_seed(0)
    model = factory(**kwargs)
    shape = _input_shape(args)
    given = torch.empty((args.batch_size or 1, *shape), device="meta") if shape else None
    ex = meta_example_input(model, batch_size=args.batch_size, seq_len=args.seq_len, given=given)
    return model, real_inputs(ex.args, vocabulary(model))


def _measure_pipeline(
    factory: Any, kwargs: dict, args: argparse.Namespace, results: dict[str, Any], timer: Any
) -> None:
    """pp_dp last (devices stages, data parallel 1): a rank that fails inside a pipeline step leaves the
    others waiting for its activations, so a failure ends this process at once (torchrun then stops the
    others) after writing why next to the result; what was measured before is already written."""
    import sys

    import torch.distributed as dist

    from lit_parallel.commands.launch import write_result
    from lit_parallel.reliability.groups import exit_process

    try:
        for one_round in results["rounds"]:  # in rounds, as the other strategies (see worker)
            model, inputs = _model_and_inputs(factory, kwargs, args)
            one_round["pp_dp"] = pipeline_worker_entry(
                model, inputs, devices=args.devices, repeats=args.repeats, timer=timer
            )
            one_round["calibration.pp_dp"] = calibrate("pp_dp", args.devices, args.calibration_repeats)
        pipeline = combine_rounds(results["rounds"], ["pp_dp"])
        results["pp_dp"] = pipeline["pp_dp"]
        results["calibration"]["pp_dp"] = pipeline["calibration"]["pp_dp"]
    except Exception as err:
        why = f"{type(err).__name__}: {err}"
        with contextlib.suppress(OSError):
            with open(f"{args.result}.error.{dist.get_rank()}", "w") as f:
                f.write(why)
        print(f"lit_parallel advise --verify: pp_dp failed on rank {dist.get_rank()}: {why}", file=sys.stderr)
        sys.stderr.flush()
        exit_process(1)  # aborts the communicators first: the other ranks' collectives fail at once
    if dist.get_rank() == 0:
        write_result(args.result, results)


def _all_reduce_seconds(buf: torch.Tensor, repeats: int = 15) -> tuple[float, int]:
    import torch.distributed as dist

    dist.all_reduce(buf)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(buf)
        times.append(time.perf_counter() - start)
    return typical_seconds(times), buf.numel()


def launch(
    model: str,
    model_kwargs: str | None,
    *,
    ranks: int,
    batch_size: int | None,
    seq_len: int | None,
    grad_bytes: int,
    repeats: int = STEP_REPEATS,
    timeout: float = 900,
    input_shape: tuple[int, ...] | None = None,
    calibration_repeats: int = CALIBRATION_REPEATS,
    timing_unit: str | None = None,
    rounds: int = ROUNDS,
    strategies: tuple[str, ...] = LAUNCH_STRATEGIES,
) -> dict[str, Any]:
    """Start ``ranks`` processes (torchrun) that measure ``strategies`` (:data:`LAUNCH_STRATEGIES`, in that
    order); rank 0's results."""
    from lit_parallel.commands.launch import run_ranks

    argv = [f"--model={model}", f"--devices={ranks}", f"--repeats={repeats}", f"--grad-bytes={grad_bytes}"]
    argv.append(f"--strategies={','.join(strategies)}")
    argv.append(f"--calibration-repeats={calibration_repeats}")
    argv.append(f"--rounds={rounds}")
    if timing_unit is not None:  # "": the whole model
        argv.append(f"--timing-unit={timing_unit}")
    if model_kwargs:
        argv.append(f"--model-kwargs={model_kwargs}")
    if batch_size:
        argv.append(f"--batch-size={batch_size}")
    if seq_len:
        argv.append(f"--seq-len={seq_len}")
    if input_shape:
        argv.append(f"--input-shape={','.join(map(str, input_shape))}")
    results = run_ranks("lit_parallel.commands.advise.measure", ranks, argv, timeout=timeout, partial=True)
    errors = results.pop("launch_errors", None)
    if errors is not None and "pp_dp" not in results:  # pp_dp runs last: the launch ended there
        # the rank that failed first says why; the others only lost their connection to it
        causes = [e for e in errors if "Connection closed" not in e and "Connection reset" not in e] or errors
        results["pp_dp"] = {"error": "; ".join(causes) or "the launch failed in pp_dp (see the output above)"}
    return results


# --- pp_dp ---------------------------------------------------------------------------------------------

PIPELINE_SCHEDULE = "1F1B"  # the strategy's default


def _pipeline_module(model: nn.Module):
    import lightning as L

    from lit_parallel.planner.simulation import default_loss

    class PipelineVerifyStep(L.LightningModule):
        """The pp_dp contract around the verified model: forward, the planner's loss per micro-batch, AdamW."""

        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, *args: Any) -> Any:
            return self.model(*args)

        def pipeline_split_batch(self, batch: Any) -> tuple[tuple, Any]:
            args = tuple(batch)
            return args, args[0]  # default_loss needs the first input (token ids are the targets)

        def pipeline_loss(self, output: Any, first_input: Any) -> torch.Tensor:
            return default_loss(output, (first_input,))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.model.parameters(), lr=1e-5)

    return PipelineVerifyStep()


def measure_pipeline_step(
    model: nn.Module,
    inputs: tuple,
    *,
    devices: int,
    microbatches: int | None = None,
    schedule: str = PIPELINE_SCHEDULE,
    repeats: int | None = None,
    between: Any = None,
):
    """Train ``model`` under ``pp_dp`` (``devices`` stages, data parallel 1) for ``4 + repeats`` steps on
    ``inputs``; this rank's peak of the fourth step and the lower quartile of the later steps. Call in every rank of a
    launch of ``devices`` ranks. Returns ``(peak, seconds)``; ``between``: as in
    :func:`~lit_parallel.commands.advise.measure.measure_step`."""
    import lit_parallel as lp

    batch = next(a for a in inputs if isinstance(a, torch.Tensor)).shape[0]
    m = microbatches or pipeline_microbatches(batch, devices)
    if m is None:
        raise ValueError(
            f"a batch of {batch} does not split into between {devices} and {4 * devices} equal micro-batches,"
            f" which pp_dp with {devices} stages (1F1B) needs; use a batch size divisible by {devices}"
        )
    strategy = lp.PipelineParallelStrategy(pipeline_parallel_size=devices, microbatches=m, schedule=schedule)
    return measure_step(
        model,
        inputs,
        strategy=strategy,
        devices=devices,
        repeats=repeats or STEP_REPEATS,
        module=_pipeline_module(model),
        live_from_start=held_by_the_pipeline,
        between=between,
    )


def held_by_the_pipeline(trainer: Any, batch: Any) -> list[torch.Tensor]:
    """What a pipeline rank holds through a whole step though its first use may come late: the step's
    batch (a stage that is neither first nor last never reads it) and torch's receive buffers, made at the
    first step and kept, one per micro-batch for the activations and for the gradients coming back."""
    from lit_parallel._compat import tree_flatten

    held = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]
    pipeline = getattr(trainer.strategy, "pipeline", None)
    for stage in getattr(pipeline, "pipe_stages", ()):
        for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values()):
            held += [info.buffer for info in infos if isinstance(getattr(info, "buffer", None), torch.Tensor)]
    return held


def pipeline_worker_entry(
    model: nn.Module, inputs: tuple, *, devices: int, repeats: int | None = None, timer: Any = None
) -> dict[str, Any]:
    """``pp_dp`` measured in every rank of an ``advise --verify`` launch (``devices`` ranks = stages), in the
    shape the launch reports the other strategies: ``{"peaks": [per rank], "step_s": s, "timing": t}``
    (``t``: ``timer``'s parts timed between the steps, as the slowest rank saw them,
    :func:`~lit_parallel.commands.advise.measure.slowest_rank_timing`). Raises what the strategy raised (a model pp_dp
    cannot split, such as one with weights tied across stages): the caller ends the launch, since another
    rank may be waiting inside a pipeline step."""
    import torch.distributed as dist

    peak, step_s = measure_pipeline_step(
        model, inputs, devices=devices, repeats=repeats, between=timer.sample if timer else None
    )
    peaks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak_dict(peak))
    return {"peaks": peaks, "step_s": step_s, "timing": slowest_rank_timing(timer)}


# --- rounds --------------------------------------------------------------------------------------------


def parts_timing(timer: Any) -> dict[str, Any] | None:
    """What ``timer`` sampled between a run's steps, as a :class:`StepTime` dict (``None`` without a timer
    or samples); the samples are dropped, so the next run starts afresh."""
    from dataclasses import asdict

    if timer is None or not timer.samples:
        return None
    return asdict(timer.timing())


def slowest_rank_timing(timer: Any) -> dict[str, Any] | None:
    """:func:`parts_timing` as the slowest rank saw it; call in every rank. A step that synchronises its
    ranks (every collective) goes at the pace of the slowest: every rank took its samples between the same
    two steps, so each sample becomes its largest over the ranks."""
    import torch.distributed as dist

    if timer is None:
        return None
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, timer.samples)
    timer.samples = [
        [max(parts) for parts in zip(*same, strict=True)] for same in zip(*gathered, strict=True)
    ]
    return parts_timing(timer)


def combine_rounds(rounds: list[dict[str, Any]], plain: list[str]) -> dict[str, Any]:
    """The rounds' figures as one: medians of the seconds, of the parts' timings and of the costs timed
    between the steps; the peaks of the first round (memory does not drift), LiveMemory's and torch's
    MemTracker's (``None`` where it did not count that round)."""
    med = statistics.median
    alone = [r["alone"] for r in rounds]
    out: dict[str, Any] = {
        "alone": {
            "overhead_s": med(a["overhead_s"] for a in alone),
            "one_process": {k: med(a["one_process"][k] for a in alone) for k in alone[0]["one_process"]},
        },
        "calibration": {},
    }
    for name in plain:
        got = [r[name] for r in rounds if name in r]
        failed = [g for g in got if "error" in g]
        if failed:  # in any round (the later rounds skip it): the strategy is reported as failed
            out[name] = failed[0]
            continue
        out[name] = {
            "peaks": got[0]["peaks"],
            "mem_tracker_peaks": got[0].get("mem_tracker_peaks"),  # torch's count of the same step, if made
            "step_s": med(g["step_s"] for g in got),
            "timing": median_timing_dict([g.get("timing") for g in got]),
        }
        timed = [g.get("timed_costs") or {} for g in got]  # costs timed between its steps
        keys = {k for t in timed for k, v in t.items() if v is not None}
        if keys:
            out[name]["timed_costs"] = {k: med(t[k] for t in timed if t.get(k) is not None) for k in keys}
        cal = [r[f"calibration.{name}"] for r in rounds if f"calibration.{name}" in r]
        out["calibration"][name] = {k: med(c[k] for c in cal) for k in cal[0]}
    return out


def median_timing_dict(timings: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Several rounds' parts timings (:class:`StepTime` dicts) as one, the median of each rate."""
    from dataclasses import asdict

    got = [StepTime(**t) for t in timings if t]
    return asdict(median_timing(got)) if got else None


def _worker_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lit_parallel.commands.advise.measure")
    add_worker_arguments(p)
    p.add_argument("--model")
    p.add_argument("--model-kwargs")
    p.add_argument("--devices", type=int)
    p.add_argument("--repeats", type=int, default=STEP_REPEATS)
    p.add_argument("--rounds", type=int, default=ROUNDS)
    p.add_argument("--timing-unit", help="the block advise times (empty: the whole model; absent: none)")
    p.add_argument("--grad-bytes", type=int, default=4 << 20)
    p.add_argument("--calibration-repeats", type=int, default=CALIBRATION_REPEATS)
    p.add_argument("--strategies", default=",".join(LAUNCH_STRATEGIES))
    p.add_argument("--batch-size", type=int)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--input-shape")
    return p


if __name__ == "__main__":
    raise SystemExit(worker(_worker_parser().parse_args()))
