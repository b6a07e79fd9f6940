"""Lightning strategies: thin shells over the pure functions in :mod:`lit_parallel.parallel`."""

from lit_parallel.strategies.ddp import TunedDDPStrategy

# Every strategy here is registered in Lightning's StrategyRegistry when lit_parallel is imported.
ALL_STRATEGIES = (TunedDDPStrategy,)

__all__ = ["ALL_STRATEGIES", "TunedDDPStrategy"]
