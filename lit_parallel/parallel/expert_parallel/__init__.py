"""Expert parallelism for mixture-of-experts layers: discovery, token dispatch, splitting.

Per-family knowledge is data (:mod:`.families`); :func:`find_moe_layers` finds the layers,
:func:`plan_expert_parallel` checks a size against them, :func:`apply_expert_parallel` splits them over the
``expert_parallel`` mesh and routes tokens by all-to-all (:func:`dispatch_combine`), and
:func:`shard_experts` FSDP-shards the experts over the ranks that hold the same ones.
"""

from lit_parallel.parallel.expert_parallel.apply import (
    ExpertParallelPlan,
    RemoteExpert,
    apply_expert_parallel,
    expert_norm_group,
    experts_sharded_first,
    local_expert_modules,
    outside_experts,
    plan_expert_parallel,
    shard_experts,
    without_expert_modules,
)
from lit_parallel.parallel.expert_parallel.discovery import MoELayer, expert_parameter_count, find_moe_layers
from lit_parallel.parallel.expert_parallel.dispatch import ExchangeStats, dispatch_combine

__all__ = [
    "ExchangeStats",
    "ExpertParallelPlan",
    "MoELayer",
    "RemoteExpert",
    "apply_expert_parallel",
    "dispatch_combine",
    "expert_norm_group",
    "experts_sharded_first",
    "expert_parameter_count",
    "find_moe_layers",
    "local_expert_modules",
    "outside_experts",
    "plan_expert_parallel",
    "shard_experts",
    "without_expert_modules",
]
