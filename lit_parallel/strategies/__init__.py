"""Lightning strategies: thin shells over the pure functions in :mod:`lit_parallel.parallel`."""

from lit_parallel.strategies.auto import AutoStrategy
from lit_parallel.strategies.ddp import TunedDDPStrategy
from lit_parallel.strategies.fsdp import TransformerFSDPStrategy
from lit_parallel.strategies.hsdp import HybridShardStrategy
from lit_parallel.strategies.pipeline import PipelineParallelStrategy
from lit_parallel.strategies.tensor_parallel import TensorParallelStrategy

# Every strategy here is registered in Lightning's StrategyRegistry when lit_parallel is imported.
ALL_STRATEGIES = (
    TunedDDPStrategy,
    TransformerFSDPStrategy,
    HybridShardStrategy,
    TensorParallelStrategy,
    PipelineParallelStrategy,
    AutoStrategy,
)

__all__ = [
    "ALL_STRATEGIES",
    "AutoStrategy",
    "HybridShardStrategy",
    "PipelineParallelStrategy",
    "TensorParallelStrategy",
    "TransformerFSDPStrategy",
    "TunedDDPStrategy",
]
