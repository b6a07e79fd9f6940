"""Per-model-family tensor-parallel knowledge, as data: one :class:`PlanProvider` per family.

:func:`~lit_parallel.parallel.tensor_parallel.infer.infer_tp_plan` asks :data:`PLAN_PROVIDERS` in order for each
transformer block and uses the first whose ``matches(block)`` is true. The last entry is the generic
planner (data flow when the model can be traced, module structure and name hints otherwise), which
matches every block. A new family (a packed-projection layout the data flow cannot reveal, heads laid
out differently) is a new entry in front of it, recognised by its module types, not a branch in the
planner.

Families whose projections are not ``nn.Linear`` register a
:class:`~lit_parallel.parallel.tensor_parallel.plan.ProjectionKind` here (HF ``Conv1D``: weight stored ``(in, out)``),
so tracing, planning and the split styles treat them as projections.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from lit_parallel.parallel.tensor_parallel.block_plan import (
    BlockSplit,
    Check,
    NameHints,
    plan_block_structural,
    plan_block_traced,
)
from lit_parallel.parallel.tensor_parallel.plan import (
    COLWISE,
    PROJECTION_KINDS,
    REPLICATED,
    ProjectionKind,
    TPLayer,
    TPPlan,
    is_projection,
)
from lit_parallel.parallel.tensor_parallel.styles import parallel_style
from lit_parallel.parallel.tensor_parallel.trace import Flow

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
        width_attributes: integer attributes of the modules owning the column layers that hold a
            split width (GPT-2's ``split_size``, the width of each packed q/k/v chunk): divided by the
            tensor-parallel size like head counts.
        head_embeddings: attributes naming an ``nn.Embedding`` whose outputs are one value per head
            (T5's relative position bias): split over its embedding dimension with the heads.
    """

    name: str
    matches: Callable[[nn.Module], bool]
    hints: NameHints = GENERIC_HINTS
    traced: TracedPlanner = plan_block_traced
    structural: StructuralPlanner = plan_block_structural
    width_attributes: tuple[str, ...] = ()
    head_embeddings: tuple[str, ...] = ()

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
            split = self.structural(root, block_name, block, plan, checks, self.hints)
        else:
            split = self.traced(root, block_name, block, flow, plan, checks)
        owners = {c.rsplit(".", 1)[0] for c in split.cols}
        self._split_head_embeddings(block_name, block, owners, split, plan, checks)
        self._divide_widths(root, owners, plan)
        return split

    def _split_head_embeddings(self, block_name, block, owners, split, plan, checks) -> None:
        for name, module in block.named_modules():
            for attr in self.head_embeddings:
                emb = getattr(module, attr, None)
                if not isinstance(emb, nn.Embedding):
                    continue
                owner = ".".join(x for x in (block_name, name) if x)
                path = f"{owner}.{attr}" if owner else attr
                detail = f"Embedding {emb.num_embeddings} x {emb.embedding_dim} (one value per head)"
                if owner not in owners:
                    why = f"{owner}'s projections are not split, so its heads stay whole"
                    plan.layers.append(TPLayer(path, REPLICATED, detail, why))
                    continue
                checks.append((path, "heads (embedding dimension)", emb.embedding_dim))
                plan.styles[path] = parallel_style(COLWISE)
                plan.layers.append(TPLayer(path, COLWISE, detail + ", each rank its heads"))
                split.local[path] = (0, emb.embedding_dim // plan.tp_size)

    def _divide_widths(self, root, owners, plan) -> None:
        tp = plan.tp_size
        for path in sorted(owners):
            module = root.get_submodule(path)
            for attr in self.width_attributes:
                value = getattr(module, attr, None)
                if isinstance(value, int) and not isinstance(value, bool) and value % tp == 0:
                    plan.head_attributes.append((path, attr, value, value // tp))


GENERIC = PlanProvider(name="generic", matches=lambda block: True)


# --- Hugging Face transformers (recognised by module structure; transformers is never imported) -------


def _is_hf_conv1d(module: nn.Module) -> bool:
    """HF's ``Conv1D`` (GPT-2, GPT, ...): a Linear whose weight is stored ``(nx, nf)`` = ``(in, out)``."""
    weight = getattr(module, "weight", None)
    nx, nf = getattr(module, "nx", None), getattr(module, "nf", None)
    return (
        type(module).__name__ == "Conv1D"
        and isinstance(nx, int)
        and isinstance(nf, int)
        and isinstance(weight, torch.Tensor)
        and tuple(weight.shape) == (nx, nf)
    )


HF_CONV1D = ProjectionKind(
    "Conv1D", _is_hf_conv1d, in_features=lambda m: m.nx, out_features=lambda m: m.nf, out_dim=1
)
if all(k.name != HF_CONV1D.name for k in PROJECTION_KINDS):
    PROJECTION_KINDS.append(HF_CONV1D)


def _has_module(block: nn.Module, test: Callable[[nn.Module], bool]) -> bool:
    return any(test(m) for m in block.modules())


# GPT-2: packed c_attn (q, k, v chunks of ``split_size`` features each, split with .split(split_size))
HF_GPT2 = PlanProvider(
    name="HF GPT-2 (Conv1D, packed c_attn)",
    matches=lambda block: _has_module(
        block,
        lambda m: (
            isinstance(getattr(m, "split_size", None), int)
            and is_projection(getattr(m, "c_attn", None) or nn.Identity())
        ),
    ),
    width_attributes=("split_size",),
)


def _plan_by_structure(root, block_name, block, flow, plan, checks) -> BlockSplit:
    """Plan from the module structure even when a trace exists: T5's attention reads the position bias
    handed on from the first block, which the data flow shows as a non-Linear input of the output
    projection (the traced planner would leave the later blocks' attention replicated)."""
    return plan_block_structural(root, block_name, block, plan, checks, GENERIC_HINTS)


# T5: the first layer's attention holds relative_attention_bias = Embedding(buckets, n_heads); the bias
# it computes is handed to the later layers, so every rank computes only its heads' bias.
HF_T5 = PlanProvider(
    name="HF T5 (relative position bias)",
    matches=lambda block: _has_module(
        block, lambda m: isinstance(getattr(m, "has_relative_attention_bias", None), bool)
    ),
    traced=_plan_by_structure,
    head_embeddings=("relative_attention_bias",),
)

# asked in order; the generic provider, which matches every block, stays last
PLAN_PROVIDERS: list[PlanProvider] = [HF_GPT2, HF_T5, GENERIC]


def provider_for(block: nn.Module) -> PlanProvider:
    """The first provider in :data:`PLAN_PROVIDERS` that recognises ``block``."""
    return next((p for p in PLAN_PROVIDERS if p.matches(block)), GENERIC)
