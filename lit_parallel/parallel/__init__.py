"""Pure PyTorch building blocks (no Lightning import): usable without a Trainer.

Sizes and meshes (``ParallelDims``), a simulated process group of any size for dry runs (``simulated_world``), transformer blocks, FSDP2 per block, DDP buckets and comm hooks,
tensor parallelism inside blocks (plan inference, per-family plan providers, application), per-rank memory
and communication volume, and the measurements of collectives and the waits on them (``PitfallReport``'s
exposed communication).
"""

from lit_parallel.formatting import divisors, format_bytes, format_choices
from lit_parallel.measure.collective_waits import CollectiveWaitTimer, Window, transfer_waits
from lit_parallel.measure.collectives import Collective, CollectiveStats, CommCounter, count_collectives
from lit_parallel.parallel.blocks import BlockPlan, NoBlocksFoundError, find_transformer_blocks
from lit_parallel.parallel.ddp.buckets import (
    AllReduceMeasurement,
    BucketPlan,
    broadcast_measurement,
    choose_bucket_sizes,
    gradient_bytes_in_ready_order,
    measure_allreduce,
)
from lit_parallel.parallel.ddp.comm_hooks import (
    COMM_HOOKS,
    average_gradients,
    build_comm_hook,
    validate_comm_hook,
)
from lit_parallel.parallel.expert_parallel import (
    ExchangeStats,
    ExpertParallelPlan,
    MoELayer,
    apply_expert_parallel,
    dispatch_combine,
    expert_parameter_count,
    find_moe_layers,
    plan_expert_parallel,
)
from lit_parallel.parallel.fsdp import (
    FSDPPlan,
    apply_fsdp,
    clip_grad_norm_,
    full_state_dict,
    load_full_state_dict,
    mixed_precision_policy,
    no_gradient_sync,
    offload_policy,
    plan_fsdp,
    set_gradient_sync,
)
from lit_parallel.parallel.memory import (
    MemoryEstimate,
    estimate_all_to_all_bytes,
    estimate_comm_bytes,
    estimate_memory,
    training_state_bytes,
)
from lit_parallel.parallel.mesh import ParallelDims

# the one orchestrating function: TP -> activation checkpointing -> compile -> FSDP
from lit_parallel.parallel.parallelize import (
    ParallelizeConfig,
    apply_activation_checkpointing,
    apply_compile,
    parallelize,
)
from lit_parallel.parallel.simulated import is_simulated, simulated_world
from lit_parallel.parallel.tensor_parallel import (
    TPLayer,
    TPPlan,
    TPPlanError,
    apply_tp,
    check_tp_plan,
    infer_tp_plan,
    local_parameter_bytes,
    plan_from_spec,
)
from lit_parallel.parallel.tensor_parallel.families import PLAN_PROVIDERS, PlanProvider

__all__ = [
    "plan_expert_parallel",
    "find_moe_layers",
    "expert_parameter_count",
    "dispatch_combine",
    "apply_expert_parallel",
    "MoELayer",
    "ExpertParallelPlan",
    "ExchangeStats",
    "AllReduceMeasurement",
    "apply_activation_checkpointing",
    "apply_compile",
    "apply_fsdp",
    "apply_tp",
    "average_gradients",
    "BlockPlan",
    "broadcast_measurement",
    "BucketPlan",
    "build_comm_hook",
    "check_tp_plan",
    "choose_bucket_sizes",
    "clip_grad_norm_",
    "Collective",
    "CollectiveStats",
    "CollectiveWaitTimer",
    "COMM_HOOKS",
    "CommCounter",
    "count_collectives",
    "divisors",
    "estimate_all_to_all_bytes",
    "estimate_comm_bytes",
    "estimate_memory",
    "find_transformer_blocks",
    "format_bytes",
    "format_choices",
    "FSDPPlan",
    "full_state_dict",
    "gradient_bytes_in_ready_order",
    "infer_tp_plan",
    "load_full_state_dict",
    "local_parameter_bytes",
    "measure_allreduce",
    "MemoryEstimate",
    "mixed_precision_policy",
    "no_gradient_sync",
    "NoBlocksFoundError",
    "offload_policy",
    "ParallelDims",
    "parallelize",
    "ParallelizeConfig",
    "plan_from_spec",
    "PLAN_PROVIDERS",
    "PlanProvider",
    "plan_fsdp",
    "set_gradient_sync",
    "simulated_world",
    "is_simulated",
    "TPLayer",
    "TPPlan",
    "TPPlanError",
    "training_state_bytes",
    "transfer_waits",
    "validate_comm_hook",
    "Window",
]
