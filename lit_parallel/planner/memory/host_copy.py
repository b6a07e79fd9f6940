"""The host memory ``async_checkpoint=True`` takes per rank: one copy of what the rank saves.

An asynchronous save copies the rank's part of the checkpoint into host memory, allocated at the first save
and reused by the later ones (:class:`~lit_parallel.checkpoint.background.HostCopy`), and writes it from
there. The copy holds what the rank saves, in the dtypes the checkpoint holds them:

* the model's state dict: every parameter in the dtype the optimizer updates (the fp32 master weights under
  mixed precision, :attr:`~lit_parallel.planner.precision.PrecisionBytes.master`); a weight tied under two
  names is listed, and copied, under each. Every persistent buffer in its own dtype (a floating one in the
  parameters' dtype under ``*-true`` precision, which converts the module);
* AdamW's state of every trainable parameter: ``exp_avg`` and ``exp_avg_sq`` of the parameter's shape and
  dtype, and ``step``, one fp32 scalar (:data:`STEP_BYTES`);
* on rank 0, the RNG states of every rank (:func:`rng_state_bytes`), which lit_parallel's checkpoints keep.

What a rank holds of the model and optimizer state (:func:`saved_state_bytes`):

* ``ddp_tuned``: rank 0 writes the single file and holds all of it; the other ranks hold nothing.
* ``fsdp_blocks`` (and ZeRO-2), ``hsdp``: every parameter and its optimizer state are sharded on dim 0 over
  the ``N`` ranks sharding (``hsdp``: the devices of a node), as FSDP2 cuts them: rank ``i`` holds rows
  ``[i c, (i + 1) c)`` of the ``d`` rows, ``c = ceil(d / N)``, so rank 0 holds the most; buffers and ``step``
  are whole on every rank.
* ``fsdp_blocks`` with ``expert_parallel_size = e``: the rank's ``E / e`` experts of each MoE layer, sharded
  over the ``N / e`` ranks holding them; the rest over ``N``.
* ``tp_dp``: one tensor-parallel rank's model (split layers with their per-rank shapes:
  :func:`~lit_parallel.planner.memory.tensor_parallel.tp_local_model`), sharded over the data-parallel ranks.
* ``pp_dp``: the pieces of the rank's stage, and the modules outside every stage's pieces (every rank keeps
  them, with their buffers), sharded over the stage's data-parallel ranks.

:func:`host_copies` gives every strategy's figure for the rank that holds the most (rank 0: the largest
shards and the RNG states; under ``pp_dp`` the larger of rank 0's stage and the largest other stage).
Not counted: tensors Lightning's loops and callbacks save (``ModelCheckpoint``'s best scores: a few
scalars). The memory table's column is ZeRO's count of the same (:func:`host_copy_from_counts`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

from torch import nn

from lit_parallel.checkpoint.background import state_nbytes
from lit_parallel.parallel.expert_parallel import find_moe_layers
from lit_parallel.parallel.memory import estimate_memory
from lit_parallel.parallel.pipeline.plan import PipelinePlan
from lit_parallel.planner.precision import canonical_precision, precision_bytes
from lit_parallel.rng import capture_rng_state

# AdamW's ``step``: one fp32 scalar per parameter (torch keeps it on the CPU unless capturable or fused)
STEP_BYTES = 4
# a CUDA generator's state (``torch.cuda.get_rng_state``): its seed and offset, 8 bytes each
CUDA_RNG_STATE_BYTES = 16


def rng_state_bytes(device_type: str = "cuda") -> int:
    """Bytes of the tensors of one rank's RNG states in a checkpoint
    (:func:`~lit_parallel.rng.capture_rng_state`): torch's CPU generator, Python's and numpy's, counted on
    this process's own; with ``device_type="cuda"`` the rank's CUDA generator too."""
    state = capture_rng_state()
    state.pop("cuda", None)  # whether this process has one says nothing about the ranks predicted
    return state_nbytes(state) + (CUDA_RNG_STATE_BYTES if device_type == "cuda" else 0)


def _checkpoint_dtypes(precision: str) -> tuple[int, bool]:
    """Bytes of a saved parameter element, and whether floating buffers take the parameters' dtype (the
    module converted: ``*-true``)."""
    return precision_bytes(precision).master, canonical_precision(precision).endswith("-true")


def _chunk(rows: int, ranks: int, index: int) -> int:
    """Rows of dim 0 that rank ``index`` of ``ranks`` holds: FSDP2's ``torch.chunk`` of ``ceil(rows / ranks)``."""
    per = -(-rows // ranks)
    return max(0, min(per, rows - index * per))


def _expert_parts(module: nn.Module, expert_parallel: int, shard: int) -> dict[int, tuple[int, int] | None]:
    """``id(parameter) -> (rows the rank keeps, ranks sharding them)`` of every expert weight under expert
    parallelism, ``None`` for an expert of a module list that another rank keeps (rank 0 keeps the first
    ``E / e``)."""
    if expert_parallel == 1:
        return {}
    try:
        layers = find_moe_layers(module)
    except ValueError:  # experts already split by transformers' own expert parallelism: plain parameters
        return {}
    inner = shard // expert_parallel
    parts: dict[int, tuple[int, int] | None] = {}
    for layer in layers:
        local = layer.num_experts // expert_parallel
        if layer.kind == "stacked":
            for p in layer.module.parameters(recurse=False):
                parts[id(p)] = (local, inner)
            continue
        for j, expert in enumerate(getattr(layer.module, layer.experts_name or "")):
            for p in expert.parameters():
                parts[id(p)] = (p.shape[0] if p.dim() else 1, inner) if j < local else None
    return parts


def saved_state_bytes(
    module: nn.Module,
    *,
    precision: str,
    shard: int = 1,
    index: int = 0,
    expert_parallel: int = 1,
    keep: Callable[[str], bool] | None = None,
) -> int:
    """Bytes of the model and AdamW state one rank saves of ``module`` (any device, meta too): its state
    dict's entries, the parameters sharded on dim 0 over ``shard`` ranks of which this rank is the
    ``index``-th (module docstring), and each trainable parameter's ``exp_avg``, ``exp_avg_sq`` and ``step``.

    Args:
        precision: the Lightning precision flag (the dtypes the checkpoint holds).
        expert_parallel: ``e``: the rank keeps ``E / e`` experts of each MoE layer, sharded over ``shard /
            e`` ranks (rank 0's part: ``index`` 0 only).
        keep: which state-dict entries the rank has (``pp_dp``: its stage's), by name; default all.
    """
    if expert_parallel > 1 and index:
        raise ValueError(
            f"index={index} with expert_parallel={expert_parallel}: the experts' shards are predicted for"
            " rank 0 (index=0) only"
        )
    element, convert_buffers = _checkpoint_dtypes(precision)
    experts = _expert_parts(module, expert_parallel, shard)
    optimized: set[int] = set()
    copied: set[int] = set()  # a tensor under two names (tied weights) is copied once
    total = 0
    for name, tensor in module.state_dict(keep_vars=True).items():
        if tensor is None or (keep is not None and not keep(name)) or id(tensor) in copied:
            continue
        copied.add(id(tensor))
        if not isinstance(tensor, nn.Parameter):  # a persistent buffer: whole on every rank
            size = element if convert_buffers and tensor.is_floating_point() else tensor.element_size()
            total += tensor.numel() * size
            continue
        rows, ranks = (tensor.shape[0], shard) if tensor.dim() else (1, shard)
        if id(tensor) in experts:
            part = experts[id(tensor)]
            if part is None:  # another rank's expert
                continue
            rows, ranks = part
        local = _chunk(rows, ranks, index) * (math.prod(tensor.shape[1:]) if tensor.dim() else 1)
        total += local * element
        if tensor.requires_grad and id(tensor) not in optimized:  # tied: one optimizer state
            optimized.add(id(tensor))
            total += 2 * local * element + STEP_BYTES
    return total


def stage_entries(plan: PipelinePlan, stage: int) -> Callable[[str], bool]:
    """The state-dict entries a ``pp_dp`` rank of stage ``stage`` has: those of its pieces, and those outside
    every stage's pieces (every rank keeps the modules no stage owns)."""
    own = tuple(f"{p}." for p in plan.stages[stage].pieces)
    anyone = tuple(f"{p}." for s in plan.stages for p in s.pieces)
    return lambda name: name.startswith(own) or not name.startswith(anyone)


def host_copies(
    module: nn.Module,
    *,
    precision: str,
    devices: int,
    nodes: int = 1,
    device_type: str = "cuda",
    expert_parallel: int = 1,
    tp_local: nn.Module | None = None,
    pipeline: tuple[PipelinePlan, int] | None = None,
) -> dict[str, float]:
    """Every strategy's host copy for the rank that holds the most (module docstring), in bytes.

    Args:
        module: the model (any device, meta too).
        devices, nodes: the cluster shape.
        expert_parallel: above 1, ``fsdp_blocks`` with that ``expert_parallel_size`` too (``fsdp_blocks_ep``).
        tp_local: one tensor-parallel rank's model over ``devices`` ranks
            (:func:`~lit_parallel.planner.memory.tensor_parallel.tp_local_model`): ``tp_dp``'s figure;
            without it and with one device per node, ``tp_dp`` is FSDP over the nodes.
        pipeline: ``(plan, data-parallel ranks per stage)`` of ``pp_dp``: its figure.
    """
    world = devices * nodes
    rng = world * rng_state_bytes(device_type)  # rank 0's checkpoint holds every rank's

    state = functools.partial(saved_state_bytes, module, precision=precision)
    sharded = state(shard=world) + rng
    out = {"ddp_tuned": state() + rng, "zero2": sharded, "fsdp_blocks": sharded}
    out["hsdp"] = state(shard=devices) + rng
    if expert_parallel > 1:
        out["fsdp_blocks_ep"] = state(shard=world, expert_parallel=expert_parallel) + rng
    if tp_local is not None:
        out["tp_dp"] = float(saved_state_bytes(tp_local, precision=precision, shard=nodes)) + rng
    elif devices == 1:
        out["tp_dp"] = sharded
    if pipeline is not None:
        plan, data_parallel = pipeline
        stages = [
            state(shard=data_parallel, keep=stage_entries(plan, s.index)) + (rng if s.index == 0 else 0.0)
            for s in plan.stages
        ]
        out["pp_dp"] = max(stages)
    return out


def host_copy_from_counts(
    params: int,
    *,
    precision: str,
    world: int,
    strategy: str = "zero3",
    shard: int | None = None,
    trainable_params: int | None = None,
    expert_params: int = 0,
    expert_parallel: int = 1,
    param_tensors: int = 0,
    buffer_bytes: int = 0,
    device_type: str = "cuda",
) -> float:
    """ZeRO's count of a strategy's host copy on rank 0 (:func:`~lit_parallel.parallel.estimate_memory`'s
    division, ``P / N`` per rank, in the checkpoint's dtypes): the parameters and AdamW's two states of the
    trainable ones, ``param_tensors`` step counters and ``buffer_bytes`` of buffers when known, and every
    rank's RNG states. ``strategy``: ``"ddp"`` (rank 0 holds all of it) or ``"zero3"`` / ``"hsdp"`` sharded
    over ``shard`` (default ``world``) ranks."""
    element = precision_bytes(precision).master
    trainable = params if trainable_params is None else trainable_params
    experts = expert_params if expert_parallel > 1 else 0
    kw = {
        "world_size": world,
        "shard_size": shard,
        "strategy": strategy,
        "param_dtype": element,
        "expert_parallel": expert_parallel,
    }
    p = estimate_memory(params, optimizer="none", expert_params=experts, **kw)
    t = estimate_memory(trainable, optimizer="adamw", expert_params=min(experts, trainable), **kw)
    extra = STEP_BYTES * param_tensors + buffer_bytes + world * rng_state_bytes(device_type)
    return p.param_bytes + t.optimizer_bytes + extra
