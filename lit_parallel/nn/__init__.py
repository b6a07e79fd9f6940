"""Modules lit_parallel must provide itself."""

from lit_parallel.nn.attention import SplittableMultiheadAttention
from lit_parallel.nn.sync_batchnorm import SyncBatchNorm, all_gather_stacked, all_reduce_sum

__all__ = ["SplittableMultiheadAttention", "SyncBatchNorm", "all_gather_stacked", "all_reduce_sum"]
