"""lit_parallel: fast, correct multi-device training for PyTorch Lightning.

Importing the package registers its strategy names (``"ddp_tuned"``, ...) in Lightning's
``StrategyRegistry`` so that ``Trainer(strategy="ddp_tuned")`` and LightningCLI YAML work.
"""

import logging

from lightning.pytorch.strategies import StrategyRegistry

from lit_parallel.callbacks import (
    CrossRankMetrics,
    ParallelTrainingError,
    ParallelTrainingWarning,
    PitfallReport,
    SetEpochCheck,
    SyncBatchNormConversion,
    current_sample_indices,
    gather_by_index,
    per_rank_seed,
    scaled_learning_rate,
)
from lit_parallel.strategies import (
    ALL_STRATEGIES,
    AutoStrategy,
    HybridShardStrategy,
    PipelineParallelStrategy,
    TensorParallelStrategy,
    TransformerFSDPStrategy,
    TunedDDPStrategy,
)
from lit_parallel.strategies.dry_run import DryRun, dry_run

__version__ = "0.1.0"


def _configure_logging() -> None:
    # Like Lightning's own logger: decisions (bucket sizes, unused parameters, plans) show by default.
    logger = logging.getLogger(__name__)
    if not logger.handlers:
        logger.setLevel(logging.INFO)
        logger.addHandler(logging.StreamHandler())
        logger.propagate = False


def _register_strategies() -> None:
    for cls in ALL_STRATEGIES:
        cls.register_strategies(StrategyRegistry)


_configure_logging()
_register_strategies()

__all__ = [
    "AutoStrategy",
    "HybridShardStrategy",
    "PipelineParallelStrategy",
    "TensorParallelStrategy",
    "TransformerFSDPStrategy",
    "TunedDDPStrategy",
    "__version__",
    # callbacks
    "CrossRankMetrics",
    "ParallelTrainingError",
    "ParallelTrainingWarning",
    "PitfallReport",
    "SetEpochCheck",
    "SyncBatchNormConversion",
    "current_sample_indices",
    "gather_by_index",
    "per_rank_seed",
    "scaled_learning_rate",
    # a strategy's real setup on a simulated cluster (advise --dry-run)
    "DryRun",
    "dry_run",
]
