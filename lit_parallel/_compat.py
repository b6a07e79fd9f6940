"""The one place lit_parallel reaches into private torch / Lightning names.

Every private name the package uses is an entry of :data:`ENTRIES`: what it is used for, the versions it
was checked with, and the public alternative where one exists (none of them does the job yet, or the
entry would not be here). ``tests/test_compat.py`` resolves every entry, so an upgrade that moves or
removes one fails in that test, naming the entry, instead of somewhere in a training run.

Three kinds of entry: a name handed out, resolved on first use (importing this module imports neither
Lightning nor heavy torch submodules); an accessor function (:func:`attached_trainer`, ...); a check only
(``"DDPStrategy._ddp_kwargs"``): protected state our subclasses reach through ``self``/``super()``.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

CHECKED = "torch 2.11.0, 2.13.0 and 2.14.1, lightning 2.6.6"


@dataclass(frozen=True)
class Entry:
    """``target``: ``"module:qualname"`` (``"module:"``: the module); ``attributes``: its private members."""

    target: str
    used_for: str
    public: str = "none"
    attributes: tuple[str, ...] = ()
    checked: str = CHECKED


_C10D = "torch.distributed.distributed_c10d"
_DCP = "torch.distributed.checkpoint"
_PYTREE = "torch.utils._pytree"  # no public pytree in torch 2.13
_FSDP_PARAM_GROUP = "torch.distributed.fsdp._fully_shard._fsdp_param_group:FSDPParamGroup"
_LAUNCHER = "lightning.pytorch.strategies.launchers.subprocess_script:_SubprocessScriptLauncher"
_MP_LAUNCHER = "lightning.pytorch.strategies.launchers.multiprocessing:_MultiProcessingLauncher"

# FSDP2 methods in which the compute stream waits on a collective stream's event (measure/collective_waits.py).
FSDP_WAIT_METHODS = ("wait_for_unshard", "_wait_for_post_backward", "finalize_backward")

ENTRIES: dict[str, Entry] = {
    # --- torch: names handed out ---------------------------------------------------------------------
    "BatchNormBase": Entry(
        "torch.nn.modules.batchnorm:_BatchNorm",
        "base of every BatchNorm layer: nn/sync_batchnorm subclasses it; callbacks find BatchNorm layers",
        "isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)) misses user"
        " subclasses of _BatchNorm",
    ),
    "TorchDispatchMode": Entry(
        "torch.utils._python_dispatch:TorchDispatchMode",
        "measure/collectives.CommCounter: sees every c10d op, also those issued from C++ (DDP's reducer, FSDP2)",
        "torch.overrides.TorchFunctionMode is public but does not see ops issued from C++",
    ),
    "tree_flatten": Entry(
        f"{_PYTREE}:tree_flatten",
        "the tensors of nested args (TP, tensor_parallel.trace, live_memory, planner.simulation)",
    ),
    "flash_attention_for_cpu": Entry(
        "torch:ops.aten._scaled_dot_product_flash_attention_for_cpu", "fused_attention"
    ),
    "tree_map": Entry(
        f"{_PYTREE}:tree_map", "parallel/tensor_parallel/trace: tag every tensor of a nested output"
    ),
    "all_to_all_single_autograd": Entry(
        "torch.distributed._functional_collectives:all_to_all_single_autograd",
        "parallel/expert_parallel/dispatch: the differentiable uneven all-to-all of tokens to their experts",
        "torch.distributed.nn.functional.all_to_all_single, deprecated in its favour (a FutureWarning per call)",
    ),
    "resolve_process_group": Entry(
        f"{_C10D}:_resolve_process_group",
        "measure/collectives: the size of the group a functional collective (DTensor) names by string",
    ),
    "get_default_store": Entry(
        f"{_C10D}:_get_default_store",
        "reliability: the rendezvous store carries stall reports and a retry's fresh rendezvous keys",
        "none (a separate TCPStore would need its own port)",
    ),
    "set_pg_timeout": Entry(
        f"{_C10D}:_set_pg_timeout",
        "reliability: the strategy's timeout on groups torch created with its default (mesh sub-groups)",
        "none (timeout= of init_process_group / new_group / init_device_mesh applies at creation only)",
    ),
    "foreach_mul_": Entry(
        "torch:_foreach_mul_",
        "parallel/fsdp: scale local gradient shards in place, one kernel per device (gradient clipping)",
        "torch.nn.utils.clip_grads_with_norm_ takes parameters, not local shards of DTensor gradients",
    ),
    "functional_collectives": Entry(
        "torch.distributed._functional_collectives:",
        "measure/collective_waits: wait_tensor is where compute waits on a DTensor redistribution; it is patched",
    ),
    "FSDPParamGroup": Entry(
        _FSDP_PARAM_GROUP,
        "measure/collective_waits: its wait methods (FSDP_WAIT_METHODS) are where CUDA compute waits on FSDP2",
        attributes=FSDP_WAIT_METHODS,
    ),
    "MEM_FORMAT_ENCODING": Entry(
        f"{_DCP}.metadata:_MEM_FORMAT_ENCODING",
        "checkpoint: a class pickled in DCP's .metadata, allowed when it is read with weights_only=True",
    ),
    "StorageInfo": Entry(
        f"{_DCP}.filesystem:_StorageInfo", "checkpoint: as MEM_FORMAT_ENCODING (pickled in .metadata)"
    ),
    "get_layout": Entry(
        "torch.serialization:_get_layout", "checkpoint: as MEM_FORMAT_ENCODING (pickled in .metadata)"
    ),
    "set_element": Entry(
        f"{_DCP}._traverse:set_element",
        "checkpoint: a planner that loads non-tensor entries with weights_only=True puts them in place",
    ),
    "EmptyStateDictLoadPlanner": Entry(
        f"{_DCP}.default_planner:_EmptyStateDictLoadPlanner",
        "checkpoint.load_sharded: builds the state dict from the metadata (as dcp_to_torch_save does)",
        "none (dcp.format_utils.dcp_to_torch_save writes a file and reads everything)",
    ),
    "load_state_dict": Entry(
        f"{_DCP}.state_dict_loader:_load_state_dict",
        "checkpoint.load_sharded: load into one process without a process group",
        "dcp.load(no_dist=True) warns and fills only keys already in the state dict (ours starts empty)",
    ),
    "create_host_state_dict": Entry(
        "torch.distributed._state_dict_utils:_create_cpu_state_dict",
        "checkpoint/background: the host copy of a state (DTensors kept as CPU DTensors, pinned on CUDA),"
        " allocated once and reused by every asynchronous save, as DCP's own stagers do",
        "torch.distributed.checkpoint.staging.BlockingAsyncStager(cache_staged_state_dict=True) pins"
        " unconditionally (fails without CUDA) and copies every time (no reuse of a copy already made)",
    ),
    "MemTracker": Entry(
        "torch.distributed._tools.mem_tracker:MemTracker",
        "measure/mem_tracker: torch's own count of a step's live tensor memory, which `advise --verify`"
        " reports beside measure/live_memory.LiveMemory's (an independent check of the package's counter);"
        " tests (tests/memory_reference.py) check LiveMemory against it",
        "torch.cuda.max_memory_allocated (CUDA only: torch keeps no allocator statistics for CPU memory)",
        attributes=("track_external", "get_tracker_snapshot"),
    ),
    "FakeStore": Entry(
        "torch.testing._internal.distributed.fake_pg:FakeStore",
        "parallel/simulated: the store of a simulated process group (importing its module registers torch's"
        " fake backend, which answers every collective without communicating): advise --dry-run",
        "none (the fake backend is registered only by this module)",
    ),
    "FakeTensorMode": Entry(
        "torch._subclasses.fake_tensor:FakeTensorMode",
        "planner/dry_run/step: one training step of a dry run, every tensor with its shape and no storage",
        "none (torch.device('meta') has no FSDP2 support: its lazy init asks for materialised parameters)",
    ),
    "unset_fake_temporarily": Entry(
        "torch._subclasses.fake_tensor:unset_fake_temporarily",
        "planner/dry_run/step: DeviceMesh computes its coordinates on real tensors inside the fake step"
        " (fake_step_context)",
    ),
    # --- torch: accessors -----------------------------------------------------------------------------
    "all_process_groups": Entry(
        f"{_C10D}:_world", "reliability: every process group of this rank", attributes=("pg_map",)
    ),
    "flatten_mesh": Entry(
        "torch.distributed.device_mesh:DeviceMesh",
        "parallel/mesh: the flattened data_parallel dimension of (replicate, shard)",
        attributes=("_flatten",),
    ),
    "fsdp_params": Entry(
        "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam",
        "planner/dry_run: the bytes FSDP2 stores for a parameter on this rank (its shard padded along dim 0),"
        " which the DTensor's local tensor (unpadded) does not show",
        "none (DTensor.to_local() is the unpadded view of the padded storage)",
        attributes=("padded_sharded_param_size", "sharded_param", "_param_fqn"),
    ),
    "fsdp_state": Entry(
        "torch.distributed.fsdp:FSDPModule",
        "planner/dry_run: a module's FSDP2 state, to reach its parameter group (fsdp_params)",
        attributes=("_get_fsdp_state",),
    ),
    "storage_key": Entry(
        "torch:UntypedStorage",
        "planner/rules, activations: identity of a storage, also on meta (where data_ptr() is 0)",
        "untyped_storage().data_ptr() is 0 for every meta storage",
        attributes=("_cdata",),
    ),
    "undo_compile": Entry(
        "torch.nn:Module",
        "strategies/ddp: revert nn.Module.compile() (the probe step runs uncompiled)",
        attributes=("_compiled_call_impl",),
    ),
    "ddp_logging_data": Entry(
        "torch.nn.parallel:DistributedDataParallel",
        "callbacks/pitfalls: DDP's own timing of the all-reduce it could not hide behind backward",
        attributes=("_get_ddp_logging_data", "_set_ddp_runtime_logging_sample_rate"),
    ),
    # --- torch: checks only (base-class members our subclasses and op matchers rely on) ---------------
    "ColwiseParallel._partition_linear_fn": Entry(
        "torch.distributed.tensor.parallel:ColwiseParallel",
        "parallel/tensor_parallel/styles.FusedColwiseParallel permutes rows, then calls super()",
        attributes=("_partition_linear_fn",),
    ),
    "ColwiseParallel/RowwiseParallel hooks": Entry(
        "torch.distributed.tensor.parallel:RowwiseParallel",
        "parallel/tensor_parallel/styles.Transposed{Colwise,Rowwise}Parallel (HF Conv1D): own partition fn, torch's"
        " input/output hooks",
        attributes=("_prepare_input_fn", "_prepare_output_fn", "_apply"),
    ),
    "SequenceParallel._prepare_input_fn": Entry(
        "torch.distributed.tensor.parallel:SequenceParallel",
        "parallel/tensor_parallel/styles.SequenceParallelNorm: SequenceParallel with a gathered output",
        attributes=("_prepare_input_fn", "_replicate_module_fn", "_apply"),
    ),
    "_BatchNorm._check_input_dim": Entry(
        "torch.nn.modules.batchnorm:_BatchNorm",
        "nn/sync_batchnorm.SyncBatchNorm overrides and calls it",
        attributes=("_check_input_dim",),
    ),
    "c10d private op names": Entry(
        "torch:ops.c10d",
        "measure/collectives: CommCounter classifies c10d ops by name",
        attributes=("_allgather_base_", "_reduce_scatter_base_"),
    ),
    "_c10d_functional ops": Entry(
        "torch:ops._c10d_functional",
        "measure/collectives: CommCounter classifies DTensor's functional collectives by name",
        attributes=(
            "all_reduce",
            "all_gather_into_tensor",
            "reduce_scatter_tensor",
            "broadcast",
            "wait_tensor",
        ),
    ),
    # --- Lightning: names handed out (resolved on first use: importing this module imports no Lightning)
    "SubprocessScriptLauncher": Entry(
        _LAUNCHER,
        "reliability: Lightning's own launcher, subclassed to add a watchdog",
        "none (Strategy._configure_launcher builds it; Lightning has no public launcher class for DDP)",
    ),
    "MultiProcessingLauncher": Entry(
        _MP_LAUNCHER,
        "reliability: Lightning's ddp_spawn launcher, subclassed so that a failing rank reports itself (the"
        " processes it starts run the fit outside Lightning's exception handling)",
        "none (Strategy._configure_launcher builds it; Lightning has no public launcher class for DDP)",
    ),
    "launch_process_observer": Entry(
        "lightning.fabric.strategies.launchers.subprocess_script:_launch_process_observer",
        "reliability: Lightning's observer that kills the other ranks when one dies",
    ),
    "set_num_threads_if_needed": Entry(
        "lightning.fabric.utilities.distributed:_set_num_threads_if_needed",
        "reliability: OMP_NUM_THREADS per rank, as Lightning's launcher sets it",
    ),
    "init_dist_connection": Entry(
        "lightning.fabric.utilities.distributed:_init_dist_connection",
        "reliability: create the process group as Lightning would (cluster environment, MASTER_ADDR/PORT)",
        "torch.distributed.init_process_group without the cluster environment's settings",
    ),
    "distributed_checkpoint_save": Entry(
        "lightning.fabric.strategies.model_parallel:_distributed_checkpoint_save",
        "reliability: ModelParallelStrategy.save_checkpoint's write, under a temporary name",
        "torch.distributed.checkpoint.save without Lightning's state conversion and meta.pt",
    ),
    "sync_module_states": Entry(
        "lightning.pytorch.overrides.distributed:_sync_module_states",
        "strategies/ddp: every rank holds rank 0's weights before the probe step",
        "none public (torch.distributed.utils._sync_module_states is private too)",
    ),
    "optimizers_to_device": Entry(
        "lightning.fabric.utilities.optimizer:_optimizers_to_device",
        "strategies/fsdp: optimizer state on the root device, as ModelParallelStrategy.setup does",
    ),
    "wrap_link_checkpoint": Entry(
        "lightning.pytorch.callbacks:ModelCheckpoint",
        "reliability/async_checkpoints: save_last='link' links only to a checkpoint whose background write"
        " finished (the link waits with it)",
        "none (ModelCheckpoint links right after trainer.save_checkpoint returns)",
        attributes=("_link_checkpoint",),
    ),
    # --- Lightning: accessors -------------------------------------------------------------------------
    "attached_trainer": Entry(
        "lightning.pytorch:LightningModule",
        "strategies, reliability: the Trainer or None (lm.trainer raises when none is attached)",
        "lm.trainer (raises when detached); writing: lm.trainer = ... (also sets child LightningModules)",
        attributes=("_trainer",),
    ),
    "set_device_mesh": Entry(
        "lightning.pytorch:LightningModule",
        "strategies/fsdp: lm.device_mesh, as ModelParallelStrategy.setup_environment sets it",
        "none (LightningModule.device_mesh is read-only)",
        attributes=("_device_mesh",),
    ),
    "process_group_backend": Entry(
        "lightning.pytorch.strategies:DDPStrategy",
        "reliability: the backend the strategy will create its process group with",
        "strategy.process_group_backend is None until the group exists",
        attributes=("_get_process_group_backend",),
    ),
    "saves_distributed_checkpoint": Entry(
        "lightning.pytorch.strategies:ModelParallelStrategy",
        "reliability/checkpoints: whether save_checkpoint writes DCP shards or one file",
        "none (the constructor argument save_distributed_checkpoint is stored privately)",
        attributes=("_save_distributed_checkpoint",),
    ),
    "set_trainer_strategy": Entry(
        "lightning.pytorch:Trainer",
        "strategies/auto: AutoStrategy hands the Trainer the strategy it chose",
        "none (Trainer.strategy is read-only; the connector picks the strategy when the Trainer is built)",
        attributes=("_accelerator_connector",),
    ),
    "should_accumulate": Entry(
        "lightning.pytorch.loops.training_epoch_loop:_TrainingEpochLoop",
        "strategies/ddp, reliability: whether this batch only accumulates (no optimizer step)",
        attributes=("_should_accumulate",),
    ),
    "hpc_save_path": Entry(
        "lightning.pytorch.trainer.connectors.checkpoint_connector:_CheckpointConnector",
        "reliability: the path Lightning's own SLURM requeue saves to (hpc_ckpt_N.ckpt)",
        attributes=("hpc_save_path",),
    ),
    "wrap_resume_start": Entry(
        "lightning.pytorch:Trainer",
        "hpc_save_path; resume: what fit restores (auto_resume)",
        "none",
        ("_checkpoint_connector",),
    ),
    "combined_loader": Entry(
        "lightning.pytorch.loops.evaluation_loop:_EvaluationLoop",
        "callbacks/metrics: the dataloaders of the loop now running",
        "trainer.val_dataloaders prefers fit's loop over validate's, whichever is running",
        attributes=("_combined_loader",),
    ),
    "disable_layer_sync": Entry(
        "lightning.pytorch.strategies:ParallelStrategy",
        "callbacks/sync_batchnorm: Trainer(sync_batchnorm=True) would convert our layers again",
        attributes=("_layer_sync",),
    ),
    "set_launcher": Entry(
        "lightning.pytorch.strategies:Strategy",
        "reliability: the watched launcher replaces the one Strategy._configure_launcher built",
        "none (Strategy.launcher is read-only)",
        attributes=("_launcher",),
    ),
    "hand_over_lightning_state": Entry(
        "lightning.pytorch.strategies:ParallelStrategy",
        "strategies/auto: the chosen strategy takes over what the connector and Trainer.fit set on AutoStrategy",
        "public setters cover accelerator, precision, devices and cluster environment; not these",
        attributes=("_launcher", "_lightning_module", "_layer_sync", "_checkpoint_io"),
    ),
    # --- Lightning: checks only (protected state and hooks of the strategies we subclass) -------------
    "DDPStrategy protected": Entry(
        "lightning.pytorch.strategies:DDPStrategy",
        "strategies/ddp, auto, reliability: TunedDDPStrategy wraps the model itself and changes DDP kwargs",
        attributes=(
            "_ddp_kwargs",
            "_setup_model",
            "_register_ddp_hooks",
            "_get_process_group_backend",
            "_configure_launcher",
            "_timeout",
            "_launcher",
            "_precision_plugin",
            "_layer_sync",
            "_accelerator",
            "_checkpoint_io",
            "_lightning_module",
            "_parallel_devices",
        ),
    ),
    "ModelParallelStrategy protected": Entry(
        "lightning.pytorch.strategies:ModelParallelStrategy",
        "strategies/fsdp, reliability: fsdp_blocks builds the mesh itself and checks the launch",
        attributes=(
            "_setup_distributed",
            "_configure_launcher",
            "_device_mesh",
            "_timeout",
            "_precision_plugin",
            "_save_distributed_checkpoint",
            "_get_process_group_backend",
            "_launcher",
            "_lightning_module",
            "_layer_sync",
            "_checkpoint_io",
            "_accelerator",
            "_parallel_devices",
        ),
    ),
    "_SubprocessScriptLauncher protected": Entry(
        _LAUNCHER,
        "reliability: the watched launcher starts the ranks",
        attributes=("_call_children_scripts",),
    ),
    "metric_progress": Entry(
        "torchmetrics:Metric",
        "callbacks/metrics: a forward outside the gathered evaluation must not count (torchmetrics 1.9.0)",
        "metric.update_count reads the count; neither can be written publicly",
        attributes=("_update_count", "_computed"),
    ),
}


def _import_target(target: str) -> Any:
    module_name, _, qualname = target.partition(":")
    obj = importlib.import_module(module_name)
    for part in filter(None, qualname.split(".")):
        obj = getattr(obj, part)
    return obj


def _has_member(obj: Any, name: str) -> bool:
    if hasattr(obj, name):
        return True
    # instance state: assigned in a method of the class or of one of its bases
    for cls in getattr(obj, "__mro__", ())[:-1]:
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):
            continue
        if re.search(rf"\bself\.{re.escape(name)}\b|[\"']{re.escape(name)}[\"']", source):
            return True
    return False


def check(name: str) -> Any:
    """Resolve entry ``name`` (its target and attributes); raise ImportError naming the entry if gone."""
    entry = ENTRIES[name]
    try:
        obj = _import_target(entry.target)
    except (ImportError, AttributeError) as err:
        raise ImportError(_message(name, entry, f"{entry.target} is gone ({err})")) from err
    missing = [a for a in entry.attributes if not _has_member(obj, a)]
    if missing:
        raise ImportError(_message(name, entry, f"{entry.target} has no {', '.join(missing)}"))
    return obj


def _message(name: str, entry: Entry, what: str) -> str:
    used = f"Used for: {entry.used_for}. Checked with {entry.checked}; public alternative: {entry.public}"
    return f"lit_parallel._compat entry {name!r}: {what}. {used}"


def __getattr__(name: str) -> Any:
    # Handed-out names resolve on first use, then are cached (accessor functions never reach this hook).
    if name not in ENTRIES or not name.isidentifier():
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = check(name)
    globals()[name] = value
    return value


# --- torch features by version ---------------------------------------------------------------------------
# Supported: torch 2.11 up to the newest release (docs/reference/versions.md, "Tested versions"). Public torch names
# and arguments younger than the oldest supported torch are entries of FEATURES: the code asks has_feature()
# and takes another path on an older torch, never failing to import. Where that path gives up something,
# log_degraded() says so once per process (rank 0), naming the torch version that has the feature. A private
# name the package can do without is a feature too (``entry``: its key in ENTRIES): every supported torch has it,
# but a later one may move or drop it, and then the package goes on without it, saying so in the same way.

OLDEST_TORCH = "2.11"


@dataclass(frozen=True)
class Feature:
    """``since``: the first torch release with ``name``; ``older``: what the package does without it (the log
    line); ``lost``: whether that path gives something up (then :func:`log_degraded` logs it, else nothing);
    ``entry``: for a private name, its key in :data:`ENTRIES` (``since`` is then empty: every supported torch
    has it, and the probe is whether the entry still resolves)."""

    name: str
    since: str
    older: str
    lost: bool
    probe: Callable[[], bool]
    entry: str = ""


def _ddp_takes(argument: str) -> bool:
    from torch.nn.parallel import DistributedDataParallel

    return argument in inspect.signature(DistributedDataParallel.__init__).parameters


def _torch_at_least(version: str) -> Callable[[], bool]:
    def probe() -> bool:
        import torch

        return torch.__version__ >= version  # TorchVersion compares release numbers, not strings

    return probe


def _c10d_has(name: str) -> Callable[[], bool]:
    def probe() -> bool:
        import torch.distributed as dist

        return hasattr(dist, name)

    return probe


def _entry_resolves(name: str) -> Callable[[], bool]:
    def probe() -> bool:
        try:
            check(name)
        except ImportError:
            return False
        return True

    return probe


FEATURES: dict[str, Feature] = {
    "ddp_forward_sync_buffers": Feature(
        "DistributedDataParallel(forward_sync_buffers=)",
        "2.13",
        "ddp_tuned builds DDP with buffers synced at construction and then sets its broadcast_buffers"
        " attribute, which older DDP reads before each forward: the same behaviour",
        lost=False,
        probe=lambda: _ddp_takes("forward_sync_buffers"),
    ),
    "ddp_batched_grad_copy": Feature(
        "DistributedDataParallel(batched_grad_copy=)",
        "2.12",
        "batched_grad_copy=True is ignored: DDP copies each gradient into its bucket one parameter at a time",
        lost=True,
        probe=lambda: _ddp_takes("batched_grad_copy"),
    ),
    "pipelining_integer_tensors": Feature(
        "torch.distributed.pipelining: integer tensors between stages",
        "2.13",
        "pp_dp sends the integer inputs (token ids) that later stages read as floating tensors of the same"
        " bytes (1-byte types as float32) and sends zero gradients of that size back for them",
        lost=True,
        probe=_torch_at_least("2.13"),
    ),
    "pipelining_mode_switch": Feature(
        "torch.distributed.pipelining: a schedule that runs eval() and then step()",
        "2.12",
        "pp_dp builds separate torch pipeline stages for training and for evaluation (one more set of"
        " receive buffers), since an older stage first run by eval() has receive buffers without gradients",
        lost=True,
        probe=_torch_at_least("2.12"),
    ),
    "fake_foreach_dtensor": Feature(
        "AdamW's foreach step over fake DTensors holding no more than the optimizer state",
        "2.13",
        "a dry run's measured step (advise --dry-run --step) uses AdamW's for-loop implementation: torch 2.11's"
        " foreach step over fake DTensors allocated several copies of the optimizer state (checked with 2.11"
        " and 2.13; 2.12 not checked)",
        lost=False,
        probe=_torch_at_least("2.13"),
    ),
    "c10d_single_collectives": Feature(
        "torch.distributed.all_gather_single / reduce_scatter_single",
        "2.13",
        "nothing to replace: an older FSDP2 calls all_gather_into_tensor / reduce_scatter_tensor, which the"
        " collective counters and wait timers measure instead",
        lost=False,
        probe=_c10d_has("all_gather_single"),
    ),
    "mem_tracker": Feature(
        "torch.distributed._tools.mem_tracker.MemTracker",
        "",
        "advise --verify reports the peak of lit_parallel's own counter (LiveMemory) without torch's MemTracker"
        " peak beside it",
        lost=True,
        probe=_entry_resolves("MemTracker"),
        entry="MemTracker",
    ),
}

# has_feature() answers from here first: tests force a feature off to run the older path on a newer torch
_FORCED: dict[str, bool] = {}
_PROBED: dict[str, bool] = {}
_LOGGED: set[str] = set()


def has_feature(key: str) -> bool:
    """Whether the installed torch has feature ``key`` of :data:`FEATURES` (probed once)."""
    feature = FEATURES[key]  # KeyError names an unknown feature
    if key in _FORCED:
        return _FORCED[key]
    if key not in _PROBED:
        _PROBED[key] = feature.probe()
    return _PROBED[key]


def _global_rank() -> int:
    import os
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    for variable in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):  # Lightning's order
        if variable in os.environ:
            return int(os.environ[variable])
    return 0


def degraded_message(key: str) -> str:
    import torch

    feature = FEATURES[key]
    if feature.entry:  # a private name: no release is known to have it for good
        had = f"a private name, checked with {ENTRIES[feature.entry].checked}"
    else:
        had = f"torch {feature.since} and later have it"
    return f"lit_parallel: torch {torch.__version__} lacks {feature.name} ({had}): {feature.older}"


def log_degraded(key: str) -> None:
    """Say once per process, on rank 0, what is given up without feature ``key`` (a WARNING)."""
    if key in _LOGGED or not FEATURES[key].lost:
        return
    _LOGGED.add(key)
    if _global_rank() == 0:
        logging.getLogger("lit_parallel").warning(degraded_message(key))


def set_forward_sync_buffers(ddp: Any, value: bool) -> None:
    """``DistributedDataParallel(forward_sync_buffers=value)`` on a torch without that argument: ``ddp`` was
    built with buffers synced at construction (the default); older DDP reads ``broadcast_buffers`` before
    each forward."""
    if has_feature("ddp_forward_sync_buffers"):
        ddp.forward_sync_buffers = value
    else:
        ddp.broadcast_buffers = value


# --- accessors -------------------------------------------------------------------------------------------


def all_process_groups() -> list[Any]:
    """Every process group of this rank (torch's registry of them)."""
    return list(check("all_process_groups").pg_map)


def flatten_mesh(mesh: Any, name: str) -> Any:
    """The 1-D mesh spanning all dimensions of ``mesh`` (a sub-mesh), named ``name``."""
    return mesh._flatten(name)


def fsdp_params(module: Any) -> list[Any]:
    """FSDP2's records of the parameters of every ``fully_shard``-ed module in ``module`` (``FSDPParam``: its
    ``sharded_param`` and ``padded_sharded_param_size``), in module order."""
    from torch.distributed.fsdp import FSDPModule

    check("fsdp_params")
    records = []
    for m in module.modules():
        if isinstance(m, FSDPModule):
            group = m._get_fsdp_state()._fsdp_param_group
            records.extend(group.fsdp_params if group is not None else ())
    return records


@contextmanager
def meshes_on_real_tensors() -> Iterator[None]:
    """``DeviceMesh`` objects built inside the ``with`` body compute their coordinates on real tensors even
    under a ``FakeTensorMode`` (FSDP2 and DTensor build sub-meshes while they set up; the mesh's rank table
    is a real tensor, and a fake ``nonzero`` has no size)."""
    from torch.distributed.device_mesh import DeviceMesh

    unset = check("unset_fake_temporarily")
    original = DeviceMesh.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        with unset():
            original(self, *args, **kwargs)

    DeviceMesh.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        DeviceMesh.__init__ = original  # type: ignore[method-assign]


def storage_key(tensor: Any) -> int:
    """Identity of ``tensor``'s storage (several views of one storage share it; works on meta)."""
    return tensor.untyped_storage()._cdata


def undo_compile(module: Any) -> None:
    """Undo ``module.compile()``: its calls run the eager ``forward`` again."""
    module._compiled_call_impl = None


def ddp_logging_data(ddp: Any, sample_rate: int | None = None) -> dict[str, Any]:
    """DDP's own runtime statistics; ``sample_rate``: sample its timers every that many iterations."""
    if sample_rate is not None:
        ddp._set_ddp_runtime_logging_sample_rate(sample_rate)
    return ddp._get_ddp_logging_data()


def attached_trainer(module: Any) -> Any:
    """The Trainer ``module`` (a LightningModule) is attached to, or None."""
    return getattr(module, "_trainer", None)


def set_device_mesh(module: Any, mesh: Any) -> None:
    """What ``module.device_mesh`` returns (a LightningModule's mesh is set by its strategy)."""
    module._device_mesh = mesh


def process_group_backend(strategy: Any) -> str:
    """The backend ``strategy`` (DDPStrategy or ModelParallelStrategy) creates its process group with."""
    return strategy._get_process_group_backend()


def saves_distributed_checkpoint(strategy: Any) -> bool:
    """Whether ``strategy`` (a ModelParallelStrategy) saves sharded DCP checkpoints."""
    return strategy._save_distributed_checkpoint


def launcher_start_method(launcher: Any) -> str:
    """The start method (``"spawn"``, ``"fork"``, ``"forkserver"``) of Lightning's multiprocessing launcher."""
    return launcher._start_method


def set_launcher(strategy: Any, launcher: Any) -> None:
    """Make ``launcher`` the one ``strategy`` starts its processes with."""
    strategy._launcher = launcher


def hand_over_lightning_state(source: Any, target: Any) -> None:
    """Give strategy ``target`` what ``source`` holds without public setters: the launcher (it holds the
    other ranks), the attached model, the layer sync and a ``CheckpointIO`` plugin (if one was given)."""
    target._launcher = source.launcher
    target._lightning_module = source.lightning_module
    target._layer_sync = source._layer_sync
    if source._checkpoint_io is not None:
        target.checkpoint_io = source._checkpoint_io


def set_trainer_strategy(trainer: Any, strategy: Any) -> None:
    """Make ``strategy`` the Trainer's strategy from now on (``Trainer.strategy`` has no setter)."""
    trainer._accelerator_connector.strategy = strategy


def should_accumulate(trainer: Any) -> bool:
    """Whether the current training batch only accumulates gradients (no optimizer step follows)."""
    return trainer.fit_loop.epoch_loop._should_accumulate()


def hpc_save_path(trainer: Any, folder: str) -> str:
    """The path Lightning's SLURM requeue saves its checkpoint to (``hpc_ckpt_N.ckpt`` in ``folder``)."""
    return trainer._checkpoint_connector.hpc_save_path(folder)


def wrap_resume_start(trainer: Any, wrap: Any) -> None:
    """Make ``wrap(original)`` what ``trainer.fit`` calls to restore its ``ckpt_path`` (once per Trainer)."""
    c = trainer._checkpoint_connector
    if not getattr(c.resume_start, "lit_parallel", False):
        c.resume_start = wrap(c.resume_start)


def wrap_link_checkpoint(callback: Any, wrap: Any) -> None:
    """Make ``wrap(original)`` what the ``ModelCheckpoint`` ``callback`` calls to link ``last.ckpt`` (once)."""
    original = callback._link_checkpoint
    if not getattr(original, "lit_parallel", False):
        callback._link_checkpoint = wrap(original)


def combined_loader(loop: Any) -> Any:
    """The ``CombinedLoader`` of an evaluation loop, or None before it has one."""
    return getattr(loop, "_combined_loader", None)


def disable_layer_sync(strategy: Any) -> bool:
    """Stop Lightning converting BatchNorm layers (``Trainer(sync_batchnorm=True)``); whether it would have."""
    had = getattr(strategy, "_layer_sync", None) is not None
    strategy._layer_sync = None
    return had


def metric_progress(metric: Any) -> tuple[int, Any]:
    """A torchmetrics ``Metric``'s update count and cached result, to put back with :func:`restore_metric_progress`."""
    return metric._update_count, metric._computed


def restore_metric_progress(metric: Any, progress: tuple[int, Any]) -> None:
    metric._update_count, metric._computed = progress


__all__ = [  # the handed-out names resolve through __getattr__
    "CHECKED",
    "ENTRIES",
    "FSDP_WAIT_METHODS",
    "Entry",
    "check",
    "restore_metric_progress",
    *(name for name in ENTRIES if name.isidentifier()),
]


# --- reliability on NCCL: abort communicators before exiting, read group timeouts, compile events ------------
# (one block, kept apart from the entries above: issue 29, items 4 and 7)

ENTRIES.update(
    {
        "abort_process_groups": Entry(
            f"{_C10D}:_abort_process_group",
            "reliability/groups.exit_process: abort every communicator before os._exit, so that NCCL peers"
            " fail at once instead of waiting out the collective timeout (fallback: ProcessGroup.abort)",
            "none (destroy_process_group waits for a healthy group; ProcessGroup.abort is per group)",
        ),
        "group_timeout": Entry(
            "torch.distributed:ProcessGroup",
            "reliability: the collective timeout a group really has (torchrun's or the user's group), so the"
            " stall limits are derived from it",
            "none (the timeout is passed at creation and never exposed)",
            attributes=("_get_backend",),
        ),
        "compile_callbacks": Entry(
            "torch._dynamo.callback:callback_handler",
            "reliability/stall: the stall clock pauses while torch.compile compiles (dynamo's frame"
            " compiles, AOTAutograd's lazy backward compile, CUDA graph recording), also recompiles late in"
            " training",
            "none (torch._dynamo.on_compile_start/on_compile_end register the same way but cannot remove)",
            attributes=(
                "register_start_callback",
                "register_end_callback",
                "remove_start_callback",
                "remove_end_callback",
                "start_callbacks",
                "end_callbacks",
            ),
        ),
    }
)


def abort_process_groups() -> None:
    """Abort every process group of this rank (NCCL: ``ncclCommAbort``; pending collectives end at once,
    the peers see the communicator fail). Afterwards ``torch.distributed`` is uninitialised."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None:
        abort()
        return
    for group in all_process_groups():  # older torch: each group's own abort
        group.abort()


def group_timeout(group: Any) -> Any:
    """The collective timeout (``timedelta``) ``group`` was created or set with, or ``None`` if unreadable."""
    import torch

    for device in ("cuda", "cpu"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError):
            continue
    return None


def watch_compiles(start: Any, end: Any) -> None:
    """Call ``start(*args)`` / ``end(*args)`` when torch.compile starts / ends compiling (the outermost
    compile only; on whatever thread compiles). Idempotent: call again after ``torch._dynamo.reset()``,
    which removes every callback."""
    handler = check("compile_callbacks")
    if start not in handler.start_callbacks:
        handler.register_start_callback(start)
    if end not in handler.end_callbacks:
        handler.register_end_callback(end)


def unwatch_compiles(start: Any, end: Any) -> None:
    handler = check("compile_callbacks")
    if start in handler.start_callbacks:
        handler.remove_start_callback(start)
    if end in handler.end_callbacks:
        handler.remove_end_callback(end)


__all__ += [name for name in ENTRIES if name.isidentifier() and name not in __all__]  # this block's entries
__all__ += ["unwatch_compiles", "watch_compiles"]
