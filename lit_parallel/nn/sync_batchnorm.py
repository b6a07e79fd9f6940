"""Synchronized BatchNorm for every backend, built on a differentiable all-reduce.

``torch.nn.SyncBatchNorm`` runs only on CUDA. :class:`SyncBatchNorm` gathers every rank's per-channel
count, mean and sum of squared deviations in one all-gather and combines them exactly (Chan et al.'s
parallel variance, as torch's CUDA kernel does), and lets autograd differentiate through the gather:
its backward sums each rank's share of the gradient over all ranks, so each rank's input gradient is
that of the sum of every rank's loss, as if one process had seen the whole global batch. Ranks may
hold different numbers of samples (the last batch of an epoch), even none: the statistics weigh each
rank by its count.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lit_parallel._compat import BatchNormBase as _BatchNorm


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = tensor.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def all_reduce_sum(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Sum of ``tensor`` over ``group`` (default: the world), differentiable: its backward sums gradients."""
    return _AllReduceSum.apply(tensor, group)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        ctx.rank = dist.get_rank(group)
        out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, tensor.contiguous(), group=group)
        return torch.stack(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # every rank's output holds every rank's input: this rank's input gradient is the sum, over
        # ranks, of the gradient each of them has for this rank's row
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad[ctx.rank], None


def all_gather_stacked(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Every rank's ``tensor`` stacked along a new dim 0 (rank order), differentiable."""
    return _AllGather.apply(tensor, group)


class SyncBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics are those of the global batch over a process group.

    Works on any backend (gloo, NCCL, ...) and any input of shape ``(N, C, *)``; on CUDA with NCCL
    prefer ``torch.nn.SyncBatchNorm`` (fused kernels), which :class:`~lit_parallel.SyncBatchNormConversion`
    picks there. In eval mode, or outside a process group, it is an ordinary BatchNorm.

    Args:
        num_features, eps, momentum, affine, track_running_stats: as in ``torch.nn.BatchNorm2d``.
        process_group: ranks to synchronize over (default: the world).
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any = None,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects an input of shape (N, C, *), got {input.dim()}D input")

    def _needs_sync(self) -> bool:
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return False
        return dist.get_world_size(self.process_group) > 1

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if input.shape[1] != self.num_features:
            raise ValueError(
                f"SyncBatchNorm({self.num_features}) got an input with {input.shape[1]} channels (dim 1)"
            )
        if not self._needs_sync():
            return super().forward(input)

        factor = 0.0
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum

        # Statistics in float32 at least, whatever the input precision.
        stat_dtype = torch.promote_types(input.dtype, torch.float32)
        x = input.to(stat_dtype)
        dims = [0, *range(2, input.dim())]
        shape = [1, -1] + [1] * (input.dim() - 2)
        local_count = torch.full(
            (1,), input.numel() // max(input.shape[1], 1), dtype=stat_dtype, device=x.device
        )

        # this rank's count, mean and sum of squared deviations, exact in two passes
        n_local = local_count[0]
        mean_local = x.sum(dims) / n_local.clamp(min=1)
        m2_local = ((x - mean_local.view(shape)) ** 2).sum(dims)
        stats = all_gather_stacked(torch.cat([mean_local, m2_local, local_count]), self.process_group)
        c = input.shape[1]
        means, m2s, counts = stats[:, :c], stats[:, c : 2 * c], stats[:, 2 * c :]
        count = counts.sum()
        mean = (means * counts).sum(0) / count
        var = (m2s + counts * (means - mean) ** 2).sum(0) / count
        centered = x - mean.view(shape)
        out = centered * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            out = out * self.weight.to(stat_dtype).view(shape) + self.bias.to(stat_dtype).view(shape)

        n = float(count.detach())
        if n <= 1:
            raise ValueError(
                f"SyncBatchNorm: expected more than 1 value per channel when training, got {n:.0f} over all"
                " ranks; use a larger batch or put the layer in eval mode"
            )
        if self.track_running_stats and self.running_mean is not None:
            with torch.no_grad():
                unbiased = var.detach() * (n / (n - 1))
                self.running_mean.mul_(1 - factor).add_(
                    mean.detach().to(self.running_mean.dtype), alpha=factor
                )
                self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)
        return out.to(input.dtype)

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module, process_group: Any = None) -> torch.nn.Module:
        """``module`` with every BatchNorm layer (``torch.nn.SyncBatchNorm`` included) replaced by this class.

        Parameters and buffers are moved over, not copied. Returns ``module`` itself unless it is a
        BatchNorm layer.
        """
        if isinstance(module, _BatchNorm) and type(module) is not cls:
            return _converted(module, cls, process_group)
        for name, child in module.named_children():
            new = cls.convert_sync_batchnorm(child, process_group)
            if new is not child:
                module.add_module(name, new)
        return module


def _converted(bn: _BatchNorm, cls: type, process_group: Any) -> _BatchNorm:
    if isinstance(bn.weight, torch.nn.parameter.UninitializedParameter):
        raise ValueError(
            f"{type(bn).__name__} is a lazy BatchNorm that has not seen an input yet; run one forward pass (or"
            " give num_features) before converting it to SyncBatchNorm"
        )
    new = cls(
        bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats, process_group=process_group
    )
    if bn.affine:
        new.weight = bn.weight
        new.bias = bn.bias
    new.running_mean = bn.running_mean
    new.running_var = bn.running_var
    new.num_batches_tracked = bn.num_batches_tracked
    new.train(bn.training)
    if hasattr(bn, "qconfig"):
        new.qconfig = bn.qconfig
    return new


def batchnorm_layers(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    return [(name, m) for name, m in module.named_modules() if isinstance(m, _BatchNorm)]
