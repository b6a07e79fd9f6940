"""Bytes per parameter that training keeps under each Lightning precision flag (ZeRO's accounting).

With mixed precision and Adam every parameter costs 2 bytes (fp16/bf16 parameter) + 2 bytes (gradient) +
12 bytes (fp32 master weight, momentum and variance) = 16 bytes (Rajbhandari et al. 2020); in fp32 it costs
4 + 4 + 8.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrecisionBytes:
    """Bytes per parameter that training keeps (ZeRO's accounting), and the compute dtype's size.

    Attributes:
        params: the stored parameter (2 for fp16/bf16, 4 for fp32).
        grads: its gradient.
        optimizer: Adam's state: fp32 master weight + momentum + variance (12) with mixed precision,
            momentum + variance (8) in fp32, both in half precision (4) with ``*-true`` half precision.
        compute: bytes of one element in the compute dtype (block parameters gathered for a forward,
            their gradients, activations).
    """

    params: int
    grads: int
    optimizer: int
    compute: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def master(self) -> int:
        """Bytes of one element of the weights the optimizer updates, as a checkpoint stores them and AdamW's
        two states: the fp32 master weight under mixed precision (``optimizer`` = master + two states = 3 x
        4), the parameter itself otherwise (``optimizer`` = two states of ``params`` bytes each)."""
        return self.params if self.optimizer == 2 * self.params else self.optimizer // 3

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of :attr:`compute`'s size that simulated steps run in (fp16 flags as ``bfloat16``: the
        same bytes)."""
        return {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[self.compute]


PRECISIONS: dict[str, PrecisionBytes] = {
    "bf16-mixed": PrecisionBytes(2, 2, 12, 2),
    "16-mixed": PrecisionBytes(2, 2, 12, 2),
    "32-true": PrecisionBytes(4, 4, 8, 4),
    "bf16-true": PrecisionBytes(2, 2, 4, 2),
    "16-true": PrecisionBytes(2, 2, 4, 2),
    "64-true": PrecisionBytes(8, 8, 16, 8),
}
# the short spellings Lightning's Trainer(precision=...) accepts (strings and ints), same meaning as there
PRECISION_ALIASES = {"64": "64-true", "32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}


def canonical_precision(precision: str | int) -> str:
    """Lightning's full name of a precision flag: ``"bf16"`` -> ``"bf16-mixed"``, ``32`` -> ``"32-true"``."""
    flag = PRECISION_ALIASES.get(str(precision), str(precision))
    if flag not in PRECISIONS:
        hint = (
            "; Transformer Engine's FP8 is not modelled: use bf16-mixed for its estimate"
            if "transformer-engine" in flag
            else ""
        )
        raise ValueError(
            f"precision={precision!r} is not a Lightning precision flag this accounting knows; use one of"
            f" {', '.join(PRECISIONS)} or Lightning's short forms {', '.join(PRECISION_ALIASES)}{hint}"
        )
    return flag


def precision_bytes(precision: str | int) -> PrecisionBytes:
    """The accounting for a Lightning precision flag (``"bf16-mixed"``, ``"32-true"``, ``"bf16"``, ...)."""
    return PRECISIONS[canonical_precision(precision)]


def compute_dtype(precision: str | int) -> torch.dtype:
    """The dtype a step under a Lightning precision flag is simulated in (:attr:`PrecisionBytes.compute_dtype`)."""
    return precision_bytes(precision).compute_dtype
