"""Lightning's precision flags under ``pp_dp``: the FSDP2 plugins (:mod:`~lit_parallel.plugins.precision.fsdp`)
with gradient clipping by one norm over every pipeline stage (each rank holds only its stages' gradients)."""

from __future__ import annotations

from typing import Any

import torch

from lit_parallel.parallel.pipeline.schedule import clip_grad_norm_across_stages
from lit_parallel.plugins.precision.fsdp import FSDPHalfPrecision, FSDPPrecision


class PipelineClipping:
    """Clipping by one norm over every stage (each rank holds only its stages' gradients)."""

    pp_group: Any = None
    pp_device: torch.device | None = None  # the pipeline group's device (the strategy's root device)

    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        clip_grad_norm_across_stages(
            self.main_params(optimizer),  # type: ignore[attr-defined]
            clip_val,
            self.pp_group,
            device=self.pp_device,
        )


class PipelinePrecision(PipelineClipping, FSDPPrecision):
    """``32-true`` / ``bf16-mixed`` (FSDP2's policy casts) with clipping across stages."""


class PipelineHalfPrecision(PipelineClipping, FSDPHalfPrecision):
    """``bf16-true`` / ``16-true`` with clipping across stages."""
