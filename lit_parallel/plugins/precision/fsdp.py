"""Lightning's precision flags under FSDP2: which plugin runs and which FSDP2 policy casts.

Exactly one of them casts: ``"bf16-mixed"`` becomes FSDP2's ``MixedPrecisionPolicy`` (bf16 compute and
all-gathers, fp32 gradient reduction) with Lightning's autocast off; ``"bf16-true"`` / ``"16-true"`` store the
parameters in half precision. Both plugins clip gradients that mix plain tensors and DTensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision

from lit_parallel.parallel.fsdp import SUPPORTED_PRECISIONS, clip_grad_norm_, mixed_precision_policy

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy


class ShardedClipping:
    """Gradient clipping for any mix of plain and DTensor gradients (Lightning's calls torch's, which
    refuses the mix)."""

    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        clip_grad_norm_(self.main_params(optimizer), clip_val)  # type: ignore[attr-defined]

    def clip_grad_by_value(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        from torch.distributed.tensor import DTensor

        for p in self.main_params(optimizer):  # type: ignore[attr-defined]
            if p.grad is not None:
                g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                g.clamp_(min=-clip_val, max=clip_val)


class FSDPPrecision(ShardedClipping, Precision):
    """``32-true`` or ``bf16-mixed`` under FSDP2: no autocast (FSDP's MixedPrecisionPolicy casts)."""

    def __init__(self, precision: str = "32-true") -> None:
        self.precision = precision  # type: ignore[assignment]


class FSDPHalfPrecision(ShardedClipping, HalfPrecision):
    """``bf16-true`` / ``16-true``: parameters stored in half precision, no FSDP casting."""


def fsdp_precision(
    plugin: Precision | None, user: MixedPrecisionPolicy | None, name: str
) -> tuple[Precision, MixedPrecisionPolicy | None]:
    """The precision plugin and FSDP2 policy for Lightning's ``plugin`` and the strategy's own ``mixed_precision``
    (``name``: the strategy, for error messages); conflicting or unsupported settings are refused."""
    plugin = plugin if plugin is not None else Precision()
    flag = str(getattr(plugin, "precision", "32-true"))
    if type(plugin) not in (Precision, MixedPrecision, HalfPrecision) or flag not in SUPPORTED_PRECISIONS:
        raise ValueError(
            f"Trainer(precision={flag!r}) ({type(plugin).__name__}) is not supported by {name}; choose"
            f" precision= one of {', '.join(SUPPORTED_PRECISIONS)} (bf16-mixed is FSDP2's mixed precision)"
        )
    if user is not None:
        if flag in ("bf16-true", "16-true"):
            raise ValueError(
                f"conflicting precision: {name}(mixed_precision={user}) together with"
                f" Trainer(precision={flag!r}), which already stores the parameters in half precision, so"
                " both would cast. Fix: use Trainer(precision='32-true') with the policy, or drop"
                " mixed_precision"
            )
        if flag == "bf16-mixed" and user.param_dtype != torch.bfloat16:
            raise ValueError(
                f"conflicting precision: Trainer(precision='bf16-mixed') asks for bf16 compute but"
                f" {name}(mixed_precision=...) has param_dtype={user.param_dtype}. Fix: pass"
                " Trainer(precision='32-true') to let the policy decide, or a policy with"
                " param_dtype=torch.bfloat16, or drop mixed_precision"
            )
        policy = user
    else:
        policy = mixed_precision_policy(flag)
    if isinstance(plugin, HalfPrecision):
        return FSDPHalfPrecision(flag), policy  # type: ignore[arg-type]
    return FSDPPrecision(flag), policy
