"""What MoE layers look like, as data: the attribute names that tell a layer's experts, router and top-k.

Two storage layouts are recognised (:mod:`~lit_parallel.parallel.expert_parallel.discovery` reads these
tables; nothing else holds per-family knowledge):

- **stacked**: one module holds every expert's weights as tensors whose first dimension is the expert
  (transformers 5's ``*Experts``: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``, optional biases
  ``[E, ...]``). It is called as ``experts(hidden_states, top_k_index, top_k_weights)``: the routing happened
  in the caller, so the experts module can be replaced by an all-to-all around its own forward.
- **module list**: an ``nn.ModuleList`` of identical expert MLPs next to a router (hand-written MoE code).
  The routing lives in the layer's own forward, which calls ``experts[i](x)``.
"""

from __future__ import annotations

# attribute of a stacked-experts module holding the number of experts (transformers 5 uses ``num_experts``)
NUM_EXPERTS_ATTRIBUTES = ("num_experts", "num_local_experts", "n_routed_experts")

# the positional arguments a stacked-experts forward takes, in order (transformers 5's ``*Experts.forward``)
STACKED_FORWARD_ARGUMENTS = ("hidden_states", "top_k_index", "top_k_weights")

# attribute of a stacked-experts module that, when present and True, says the module already runs expert
# parallelism itself (transformers' inference-time EP): refused rather than split twice
ALREADY_PARALLEL_ATTRIBUTES = ("_is_expert_parallel",)

# a module-list MoE layer's router: a child with one output per expert (an nn.Linear, or a module whose
# ``weight`` has ``num_experts`` rows)
ROUTER_NAMES = ("gate", "router", "w_gate", "gating", "switch", "route")

# where a module-list MoE layer keeps its top-k (shown in plans; the routing itself is the layer's own code)
TOP_K_ATTRIBUTES = ("top_k", "num_experts_per_tok", "k", "topk", "n_activated_experts")

# transformers MoE configurations: the attribute holding the experts per layer and the top-k (the planner
# reads these on models it has only a config for)
CONFIG_NUM_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts")
CONFIG_TOP_K = ("num_experts_per_tok", "moe_top_k", "top_k")
