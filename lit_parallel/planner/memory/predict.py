"""Per-rank peak memory of one training step under every strategy, predicted before any run: the
data-parallel strategies (:mod:`~lit_parallel.planner.memory.peak`), ``tp_dp``
(:mod:`~lit_parallel.planner.memory.tensor_parallel`) and ``pp_dp``
(:mod:`~lit_parallel.planner.memory.pipeline`) from the same simulated steps, into one
:class:`~lit_parallel.planner.memory.peak.PeakReport`.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lit_parallel.parallel.tensor_parallel.plan import TPPlan
from lit_parallel.planner.activations import estimate_activations
from lit_parallel.planner.memory.host_copy import host_copies
from lit_parallel.planner.memory.peak import ModelShape, Peak, PeakReport, add_strategy_peaks
from lit_parallel.planner.memory.pipeline import predict_pipeline
from lit_parallel.planner.memory.table import memory_rows
from lit_parallel.planner.memory.tensor_parallel import tp_local_model, tp_peaks
from lit_parallel.planner.pipeline_layout import pipeline_plan
from lit_parallel.planner.precision import canonical_precision, compute_dtype, precision_bytes
from lit_parallel.planner.simulation import StepSimulation, simulate_step


def predict_peaks(
    module: nn.Module,
    *,
    precision: str = "32-true",
    devices: int = 1,
    nodes: int = 1,
    batch_size: int | None = None,
    seq_len: int | None = None,
    example_inputs: Any = None,
    block_names: list[str] = (),  # type: ignore[assignment]
    device_type: str = "cuda",
    tp_plan: tuple[nn.Module, TPPlan] | None = None,
    expert_parallel: int = 1,
) -> PeakReport:
    """Per-rank peak of one training step (AdamW) for every strategy, with and without checkpointing, and
    the host copy ``async_checkpoint=True`` keeps (:mod:`~lit_parallel.planner.memory.host_copy`).

    Args:
        module: the model (any device: it is simulated on meta without copying memory).
        precision: the Lightning precision flag.
        devices, nodes: the cluster shape; the micro-batch is per rank.
        block_names: the transformer blocks' qualified names (as found by ``find_transformer_blocks``).
        device_type: where it will train: AdamW's default implementation is ``foreach`` on ``"cuda"`` and
            a for-loop on ``"cpu"``; their scratch memory differs.
        tp_plan: ``(model, plan)``: ``tp_dp``'s plan for ``devices`` ranks
            (:func:`~lit_parallel.parallel.tensor_parallel.infer.infer_tp_plan`) and the copy of ``module`` it was inferred
            on (converted for tensor parallelism); its row is then one rank's model
            (:func:`~lit_parallel.planner.memory.tensor_parallel.tp_peaks`);
            without it, a share of the one-process figures.
        expert_parallel: above 1, ``fsdp_blocks`` with ``expert_parallel_size`` this is predicted too (row
            ``fsdp_blocks_ep``; the advisor's size: :func:`~lit_parallel.planner.rules.expert_parallel_choice`).
    """
    precision = canonical_precision(precision)
    c = precision_bytes(precision).compute
    blocks = [module.get_submodule(n) for n in block_names]
    shape = ModelShape.of(module, blocks)
    kw = {"batch_size": batch_size, "seq_len": seq_len, "example_inputs": example_inputs}
    sims, failed = _simulations(module, precision, list(block_names), kw)
    sim = sims[(precision, False)]
    report = PeakReport(precision, devices, nodes, sim.batch_size, sim.input_description, shape)
    report.checkpointing_note = failed
    report.expert_parallel_size = _checked_expert_parallel(expert_parallel, shape, devices)
    report.moe_calls = sim.moe_calls
    for (prec, ac), s in sims.items():
        report.activations.setdefault(prec, {})["on" if ac else "off"] = s.saved_bytes
    report.block_activation_share = _block_share(module, blocks, precision, kw)
    rows = {
        r.name: r
        for r in memory_rows(
            shape.params,
            devices=devices,
            nodes=nodes,
            precision=precision,
            trainable_params=shape.trainable,
            tp_split_params=shape.block_params or None,
            expert_params=shape.expert_params,
            expert_parallel=report.expert_parallel_size,
        )
    }
    opt_elem = 4 if precision_bytes(precision).optimizer >= 8 else 2  # AdamW's scratch in the master dtype
    opt_bytes = (shape.trainable if device_type == "cuda" else 2 * shape.largest_param) * opt_elem
    add_strategy_peaks(report, sims, rows, c=c, opt_bytes=opt_bytes, device_type=device_type)
    if tp_plan is not None:
        report.peaks["tp_dp"], report.peaks_checkpointed["tp_dp"] = tp_peaks(
            *tp_plan,
            precision=precision,
            nodes=nodes,
            block_names=list(block_names),
            kw=kw,
            opt_elem=opt_elem,
            device_type=device_type,
        )
    add_pipeline_peaks(
        report,
        module,
        list(block_names),
        precision=precision,
        device_type=device_type,
        seq_len=seq_len,
        example_inputs=example_inputs,
    )
    pipeline = None
    if report.pipeline is not None:
        layout = report.pipeline.layout
        pipeline = (pipeline_plan(module, list(block_names), layout), layout.data_parallel)
    report.host_copy = host_copies(
        module,
        precision=precision,
        devices=devices,
        nodes=nodes,
        device_type=device_type,
        expert_parallel=report.expert_parallel_size,
        tp_local=tp_local_model(*tp_plan) if tp_plan is not None else None,
        pipeline=pipeline,
    )
    return report


def _checked_expert_parallel(size: int, shape: ModelShape, devices: int) -> int:
    """``size`` when the model's experts split into it inside a node (what ``fsdp_blocks`` would accept)."""
    if size == 1:
        return 1
    counts = [e.num_experts for group in (*shape.block_experts, shape.root_experts) for e in group]
    if not counts or any(n % size for n in counts) or devices % size:
        raise ValueError(
            f"expert_parallel={size} needs MoE layers whose experts it divides ({counts or 'none found'}) and"
            f" must divide the {devices} devices of a node"
        )
    return size


def _simulations(
    module: nn.Module, precision: str, block_names: list[str], kw: dict
) -> tuple[dict[tuple[str, bool], StepSimulation], str]:
    """One simulated step per (precision, activation checkpointing); and why checkpointing was not
    simulated, when a block cannot be recomputed on meta (T5)."""
    sims, failed = {}, ""
    for prec in dict.fromkeys([precision, "32-true", "bf16-mixed"]):
        for ac in (False, True) if block_names else (False,):
            try:
                sims[(prec, ac)] = simulate_step(
                    module,
                    dtype=compute_dtype(prec),
                    block_names=block_names,
                    activation_checkpointing=ac,
                    **kw,
                )
            except RuntimeError as err:  # checkpointing a block the model cannot recompute (T5 on meta)
                if not ac:
                    raise
                failed = f"activation checkpointing not simulated: {str(err).splitlines()[0]}"
    return sims, failed


def _block_share(module: nn.Module, blocks: list[nn.Module], precision: str, kw: dict) -> float:
    """The share of saved activations produced inside transformer blocks (what tensor parallelism divides)."""
    if not blocks:
        return 0.0
    est = estimate_activations(module, precision=precision, blocks=blocks, **kw)
    return est.block_bytes / est.total_bytes if est.total_bytes else 0.0


def add_pipeline_peaks(
    report: PeakReport,
    module: nn.Module,
    block_names: list[str],
    *,
    precision: str,
    device_type: str,
    seq_len: int | None,
    example_inputs: Any,
) -> None:
    """Put ``pp_dp``'s peaks (the largest stage, :func:`~lit_parallel.planner.memory.pipeline.predict_pipeline`)
    into ``report``, or a note saying why it is not predicted."""
    try:
        pred = predict_pipeline(
            module,
            block_names,
            precision_bytes(precision),
            devices=report.devices,
            nodes=report.nodes,
            batch_size=report.batch_size,
            seq_len=seq_len,
            example_inputs=example_inputs,
            device_type=device_type,
        )
    except ValueError as err:
        report.notes.append(f"pp_dp not predicted: {err}")
        return
    except (
        RuntimeError
    ) as err:  # a stage the meta device cannot run (a Hugging Face cache grown by recomputation)
        report.notes.append(
            f"pp_dp not predicted: its micro-batch does not run on meta: {str(err).splitlines()[0]}"
        )
        return
    report.pipeline = pred
    for target, x in ((report.peaks, pred.off), (report.peaks_checkpointed, pred.on)):
        target["pp_dp"] = Peak("pp_dp", x.params, x.grads, x.optimizer, x.activations, x.temporaries, x.phase)
