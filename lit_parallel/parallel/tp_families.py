"""Per-model-family tensor-parallel knowledge, as data: one :class:`PlanProvider` per family.

:func:`~lit_parallel.parallel.tp_infer.infer_tp_plan` asks :data:`PLAN_PROVIDERS` in order for each
transformer block and uses the first whose ``matches(block)`` is true. The last entry is the generic
planner (data flow when the model can be traced, module structure and name hints otherwise), which
matches every block. A new family (a packed-projection layout the data flow cannot reveal, heads laid
out differently) is a new entry in front of it, recognised by its module types, not a branch in the
planner.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from lit_parallel.parallel.tp_generic import (
    BlockSplit,
    Check,
    NameHints,
    plan_block_structural,
    plan_block_traced,
)
from lit_parallel.parallel.tp_plan import TPPlan
from lit_parallel.parallel.tp_trace import Flow

TracedPlanner = Callable[[nn.Module, str, nn.Module, Flow, TPPlan, list[Check]], BlockSplit]
StructuralPlanner = Callable[[nn.Module, str, nn.Module, TPPlan, list[Check], NameHints], BlockSplit]

# Names in common families (Llama/Mistral, GPT-2, BLOOM/Falcon/GPT-NeoX, nn.MultiheadAttention, ...).
GENERIC_HINTS = NameHints(
    row=re.compile(
        r"(^|[._])(o|out|down|wo|w2|c_proj|proj|fc2|fc_out|dense_4h_to_h|o_proj|out_proj|down_proj)$"
    ),
    fused=re.compile(r"(qkv|c_attn|in_proj|query_key_value|gate_up)", re.IGNORECASE),
)


@dataclass(frozen=True)
class PlanProvider:
    """How to plan the blocks of one model family.

    Attributes:
        name: the family, for messages.
        matches: ``matches(block)`` is true for the blocks this provider plans.
        hints: what layer names mean in this family (used when the model cannot be traced).
        traced: plans one block from its traced data flow.
        structural: plans one block from its module structure and ``hints``.
    """

    name: str
    matches: Callable[[nn.Module], bool]
    hints: NameHints = GENERIC_HINTS
    traced: TracedPlanner = plan_block_traced
    structural: StructuralPlanner = plan_block_structural

    def plan_block(
        self,
        root: nn.Module,
        block_name: str,
        block: nn.Module,
        flow: Flow | None,
        plan: TPPlan,
        checks: list[Check],
    ) -> BlockSplit:
        """Add this block's layers to ``plan`` (and its divisibility rules to ``checks``)."""
        if flow is None:
            return self.structural(root, block_name, block, plan, checks, self.hints)
        return self.traced(root, block_name, block, flow, plan, checks)


GENERIC = PlanProvider(name="generic", matches=lambda block: True)

# asked in order; the generic provider, which matches every block, stays last
PLAN_PROVIDERS: list[PlanProvider] = [GENERIC]


def provider_for(block: nn.Module) -> PlanProvider:
    """The first provider in :data:`PLAN_PROVIDERS` that recognises ``block``."""
    return next((p for p in PLAN_PROVIDERS if p.matches(block)), GENERIC)
