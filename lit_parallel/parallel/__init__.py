"""Pure PyTorch building blocks (no Lightning import): usable without a Trainer."""

# FSDP2 per transformer block, meshes, memory and communication (issue 3)
from lit_parallel.parallel.blocks import BlockPlan, NoBlocksFoundError, find_transformer_blocks
from lit_parallel.parallel.fsdp import (
    FSDPPlan,
    apply_activation_checkpointing,
    apply_compile,
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
    Collective,
    CommCounter,
    MemoryEstimate,
    estimate_comm_bytes,
    estimate_memory,
    training_state_bytes,
)
from lit_parallel.parallel.mesh import ParallelDims, divisors

# DDP: bucket sizes from a measurement, communication hooks, collective counting (issue 2)
from lit_parallel.parallel.buckets import (
    AllReduceMeasurement,
    BucketPlan,
    broadcast_measurement,
    choose_bucket_sizes,
    gradient_bytes_in_ready_order,
    measure_allreduce,
)
from lit_parallel.parallel.comm import CollectiveStats, count_collectives
from lit_parallel.parallel.ddp import COMM_HOOKS, average_gradients, build_comm_hook, validate_comm_hook
