"""lit_parallel: fast, correct multi-device training for PyTorch Lightning.

Importing the package registers its strategy names (``"ddp_tuned"``, ...) in Lightning's
``StrategyRegistry`` so that ``Trainer(strategy="ddp_tuned")`` and LightningCLI YAML work.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lit_parallel.strategies import ALL_STRATEGIES, TunedDDPStrategy

__version__ = "0.1.0"


def _register_strategies() -> None:
    for cls in ALL_STRATEGIES:
        cls.register_strategies(StrategyRegistry)


_register_strategies()

__all__ = ["TunedDDPStrategy", "__version__"]
