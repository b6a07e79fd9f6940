"""Lightning callbacks that catch or fix multi-device training mistakes."""

from lit_parallel.callbacks.data_parallel import (
    DataParallelGroup,
    ParallelTrainingError,
    ParallelTrainingWarning,
    data_parallel_group,
)
from lit_parallel.callbacks.metrics import CrossRankMetrics, current_sample_indices, gather_by_index
from lit_parallel.callbacks.pitfall_checks import learning_rate_rule, per_rank_seed, scaled_learning_rate
from lit_parallel.callbacks.pitfalls import Finding, PitfallReport
from lit_parallel.callbacks.set_epoch import SetEpochCheck
from lit_parallel.callbacks.sync_batchnorm import SyncBatchNormConversion

__all__ = [
    "CrossRankMetrics",
    "current_sample_indices",
    "gather_by_index",
    "DataParallelGroup",
    "Finding",
    "PitfallReport",
    "ParallelTrainingError",
    "ParallelTrainingWarning",
    "SetEpochCheck",
    "SyncBatchNormConversion",
    "data_parallel_group",
    "learning_rate_rule",
    "per_rank_seed",
    "scaled_learning_rate",
]
