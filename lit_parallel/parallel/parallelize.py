"""The one path from a plain module to a parallel one: :func:`parallelize`.

Every strategy that splits a model (``fsdp_blocks``, ``hsdp``, ``tp_dp``) calls this function; it needs
no Trainer::

    dims = ParallelDims.for_fsdp(world_size)      # or for_hybrid_shard / for_tensor_parallel
    dims.build_mesh("cuda")
    parallelize(model, dims, ParallelizeConfig(activation_checkpointing=True))

It applies small single-purpose steps in a fixed order (torchtitan's: tensor parallel -> activation
checkpointing -> compile -> FSDP), each explained where it is called. Extension points: a model family's
tensor-parallel knowledge enters through the plan (``ParallelizeConfig.tp_plan``, inferred by
:func:`~lit_parallel.parallel.infer_tp_plan` from the family plan providers); a pipeline-stage split
belongs first, before tensor parallelism, so that each stage is parallelized on its own.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lit_parallel.parallel.blocks import BlockPlan, BlockTypes, find_transformer_blocks
from lit_parallel.parallel.expert_parallel import (
    apply_expert_parallel,
    experts_sharded_first,
    outside_experts,
    without_expert_modules,
)
from lit_parallel.parallel.fsdp import apply_fsdp, fsdp_kwargs
from lit_parallel.parallel.materialize import broadcast_from_rank0, has_meta, materialize_blocks, mesh_device
from lit_parallel.parallel.mesh import ParallelDims

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

    from lit_parallel.parallel.expert_parallel import ExpertParallelPlan
    from lit_parallel.parallel.tensor_parallel import TPPlan


@dataclass
class ParallelizeConfig:
    """What :func:`parallelize` applies.

    Args:
        block_types: what the transformer blocks are (see :func:`find_transformer_blocks`) or a ready plan.
        tp_plan: a tensor-parallel plan to apply over ``dims``' ``tensor_parallel`` mesh (``None``: no TP).
        expert_parallel: the MoE layers to split over ``dims``' ``expert_parallel`` mesh (from
            :func:`~lit_parallel.parallel.expert_parallel.plan_expert_parallel`; ``None``: no expert
            parallelism). Needs ``dims.expert_parallel == plan.size``.
        activation_checkpointing: recompute each block's activations in backward.
        compile: ``torch.compile`` each block (``True`` or a dict of ``torch.compile`` arguments).
        reshard_after_forward: ZeRO-3 (``True``) or ZeRO-2 (``False``), on every FSDP group.
        mp_policy: FSDP2 mixed-precision policy (``None``: compute in the parameters' dtype).
        offload: FSDP2 offload policy (``None``: keep everything on the device).
        forward_methods: methods of the module besides ``forward`` that run the model
            (``"training_step"``, ...): FSDP gathers the root group's parameters around them.
        sync_module_states: for a module not on the meta device, copy rank 0's weights to every rank first.
        sync_chunk_bytes: the most extra memory that copy allocates at once (``None``:
            :data:`~lit_parallel.parallel.materialize.SYNC_CHUNK_BYTES`, 64 MiB).
        filled_by_state_dict: a full state dict is loaded afterwards (``init_from``): parameters and
            persistent buffers of a meta-device module need no initialiser, only non-persistent buffers do.
    """

    block_types: BlockTypes | BlockPlan = "auto"
    tp_plan: TPPlan | None = None
    expert_parallel: ExpertParallelPlan | None = None
    activation_checkpointing: bool = False
    compile: bool | Mapping[str, Any] = False
    reshard_after_forward: bool = True
    mp_policy: MixedPrecisionPolicy | None = None
    offload: OffloadPolicy | None = None
    forward_methods: Iterable[str] = ()
    sync_module_states: bool = True
    sync_chunk_bytes: int | None = None
    filled_by_state_dict: bool = False


def parallelize(module: nn.Module, dims: ParallelDims, config: ParallelizeConfig | None = None) -> BlockPlan:
    """Split ``module`` over ``dims.mesh`` (built beforehand) as ``config`` says; returns the block plan."""
    from torch.distributed.fsdp import FSDPModule

    config = config or ParallelizeConfig()
    if isinstance(module, FSDPModule):
        raise ValueError(f"{type(module).__name__} already has FSDP applied; parallelize must run once")
    plan = config.block_types
    plan = plan if isinstance(plan, BlockPlan) else find_transformer_blocks(module, plan)
    blocks = [block for _, block in plan.blocks]
    sync = config.sync_module_states
    experts = config.expert_parallel if dims.ep_enabled else None
    if experts is not None and experts.size != dims.expert_parallel:
        raise ValueError(
            f"the expert-parallel plan splits experts over {experts.size} ranks but the mesh has"
            f" expert_parallel={dims.expert_parallel}; plan with the mesh's size"
        )
    if (config.tp_plan is not None or experts is not None) and not has_meta(module):
        # Every rank starts from rank 0's weights, so each one can take its TP / expert shard locally.
        broadcast_from_rank0([*module.parameters(), *module.buffers()], config.sync_chunk_bytes)
        sync = False
    if config.tp_plan is not None:
        # Tensor parallelism first: it turns parameters into DTensors that FSDP then shards further.
        tp_plan = config.tp_plan if experts is None else without_expert_modules(config.tp_plan, experts)
        apply_tensor_parallel(module, dims, tp_plan, synced=True)
    if experts is not None:
        # Experts next (the TP plan leaves them alone): each rank keeps its experts as DTensor shards.
        apply_expert_parallel(experts, dims.expert_mesh())
        blocks = outside_experts(experts, blocks)
    if config.activation_checkpointing:
        no_cache_under_recomputation(module)
    for block in blocks:
        # Activation checkpointing wraps the block's forward; FSDP's hooks stay outside it, so the
        # recomputation runs on the parameters FSDP gathered for backward.
        if config.activation_checkpointing:
            apply_activation_checkpointing(block)
        # Compile after AC (the compiled graph includes the recomputation) and before FSDP (torchtitan's order).
        if config.compile is not False:
            apply_compile(block, {} if config.compile is True else config.compile)
    # FSDP last, bottom-up: each block is materialised (or synced from rank 0) just before it is sharded, so
    # no rank ever holds more than one whole block beyond its shards; the root group comes after the blocks.
    ready = materialize_blocks(
        module,
        blocks,
        mesh_device(dims.mesh),
        sync_from_rank0=sync,
        filled_by_state_dict=config.filled_by_state_dict,
        chunk_bytes=config.sync_chunk_bytes,
    )
    if experts is not None:
        # each block's experts are FSDP-sharded over the ranks holding them just before the block itself
        ready = experts_sharded_first(
            module,
            ready,
            experts,
            dims,
            fsdp_kwargs(config.reshard_after_forward, config.mp_policy, config.offload),
        )
    apply_fsdp(
        module,
        dims.fsdp_mesh(),
        ready,
        reshard_after_forward=config.reshard_after_forward,
        mp_policy=config.mp_policy,
        offload=config.offload,
        forward_methods=config.forward_methods,
    )
    return plan


def apply_tensor_parallel(
    module: nn.Module,
    dims: ParallelDims,
    plan: TPPlan,
    *,
    chunk_bytes: int | None = None,
    synced: bool = False,
) -> None:
    """Apply ``plan`` over the tensor-parallel mesh; every rank takes its shard locally from rank 0's weights
    (copied in pieces of at most ``chunk_bytes``, see :func:`broadcast_from_rank0`; ``synced``: the caller
    copied them already)."""
    from lit_parallel.parallel.tensor_parallel import apply_tp

    if not synced and not has_meta(module):
        # Every rank starts from rank 0's weights, so each one can take its shard locally (no scatter).
        broadcast_from_rank0([*module.parameters(), *module.buffers()], chunk_bytes)
    apply_tp(module, dims.tp_mesh(), plan, src_data_rank=None)


def no_cache_under_recomputation(module: nn.Module) -> None:
    """Turn off a transformers model's key/value cache (``config.use_cache``), as transformers' own gradient
    checkpointing does: recomputing a block in backward would append its keys and values to the cache a
    second time, and attention would then see twice the sequence."""
    for m in module.modules():
        cfg = getattr(m, "config", None)
        if getattr(cfg, "use_cache", False) is True:
            cfg.use_cache = False
            if not dist.is_initialized() or dist.get_rank() == 0:
                # the package's logger, without Lightning's rank-zero helper (this layer imports no Lightning)
                logging.getLogger("lit_parallel").info(
                    f"activation checkpointing: {type(m).__name__}.config.use_cache set to False (a recomputed"
                    " block would fill the key/value cache twice)"
                )


def apply_activation_checkpointing(block: nn.Module) -> None:
    """Recompute ``block``'s activations in backward instead of storing them (non-reentrant checkpoint).

    The module keeps its name and class (no wrapper), so state-dict keys and ``block_types`` still match.
    """
    if getattr(block, "_lp_activation_checkpointing", False):
        return
    inner = block.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return torch.utils.checkpoint.checkpoint(inner, *args, use_reentrant=False, **kwargs)

    block.forward = forward
    block._lp_activation_checkpointing = True


def apply_compile(block: nn.Module, compile_kwargs: Mapping[str, Any] | None = None) -> None:
    """``torch.compile`` the block in place (``nn.Module.compile``: names and state-dict keys unchanged)."""
    block.compile(**dict(compile_kwargs or {}))
