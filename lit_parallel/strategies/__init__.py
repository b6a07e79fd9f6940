"""Lightning strategies: thin shells over the pure functions in :mod:`lit_parallel.parallel`."""

from lit_parallel.strategies.ddp import TunedDDPStrategy
from lit_parallel.strategies.fsdp import TransformerFSDPStrategy
from lit_parallel.strategies.hsdp import HybridShardStrategy

# Every strategy here is registered in Lightning's StrategyRegistry when lit_parallel is imported.
ALL_STRATEGIES = (TunedDDPStrategy, TransformerFSDPStrategy, HybridShardStrategy)

__all__ = ["ALL_STRATEGIES", "HybridShardStrategy", "TransformerFSDPStrategy", "TunedDDPStrategy"]
