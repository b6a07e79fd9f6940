"""Lightning callbacks that catch or fix multi-device training mistakes."""

from lit_parallel.callbacks.data_parallel import (
    DataParallelGroup,
    ParallelTrainingError,
    ParallelTrainingWarning,
    data_parallel_group,
)
from lit_parallel.callbacks.set_epoch import SetEpochCheck

__all__ = [
    "DataParallelGroup",
    "ParallelTrainingError",
    "ParallelTrainingWarning",
    "SetEpochCheck",
    "data_parallel_group",
]
