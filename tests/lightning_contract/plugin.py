"""A pytest plugin that runs Lightning's own tests with lit_parallel's strategies substituted for Lightning's.

Loaded by ``tests/lightning_contract/run.py`` (``-p tests.lightning_contract.plugin``) into a pytest session
over Lightning's ``tests/tests_pytorch`` (never copied into this project). ``--lit-strategy`` chooses what
stands in for what (:data:`MODES`):

- ``lightning``: nothing is substituted (Lightning's own strategies: the baseline);
- ``ddp_tuned``: every registry name whose strategy is ``DDPStrategy`` (``"ddp"``, ``"ddp_spawn"``,
  ``"ddp_find_unused_parameters_true"``, ...) builds :class:`~lit_parallel.TunedDDPStrategy` with the same
  arguments, and the name ``DDPStrategy`` in the test modules is ``TunedDDPStrategy``;
- ``auto_parallel``: the registry name ``"ddp"`` (also what ``strategy="auto"`` picks for several devices)
  builds :class:`~lit_parallel.AutoStrategy`;
- ``fsdp_blocks`` / ``hsdp`` / ``tp_dp`` / ``pp_dp``: the name ``ModelParallelStrategy`` in the test modules is
  ``TransformerFSDPStrategy`` / ``HybridShardStrategy`` / ``TensorParallelStrategy`` /
  ``PipelineParallelStrategy``.

Names are substituted while the test modules are imported (so ``parametrize`` arguments built at import get
ours too) and restored afterwards, so Lightning's own code keeps its classes. ``--lit-results PATH`` writes
every test's outcome (``passed``, ``failed``, ``skipped``, ``xfailed``, ``xpassed``) as JSON.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

MODES = ("lightning", "ddp_tuned", "auto_parallel", "fsdp_blocks", "hsdp", "tp_dp", "pp_dp")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("lit_parallel contract")
    group.addoption(
        "--lit-strategy", choices=MODES, default="lightning", help="strategy substituted for Lightning's"
    )
    group.addoption("--lit-results", default=None, help="write every test's outcome to this JSON file")


def _registry_substitutions(mode: str) -> dict[str, dict[str, Any]]:
    """Registry name -> the entry that replaces Lightning's for ``mode``."""
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

    import lit_parallel as lp

    entries: dict[str, dict[str, Any]] = {}
    if mode == "ddp_tuned":
        for name, entry in StrategyRegistry.items():
            if entry["strategy"] is DDPStrategy:
                entries[name] = {**entry, "strategy": lp.TunedDDPStrategy}
    elif mode == "auto_parallel":
        entries["ddp"] = {**StrategyRegistry["ddp"], "strategy": lp.AutoStrategy, "init_params": {}}
    return entries


def _name_substitutions(mode: str) -> list[tuple[Any, str, Any]]:
    """(module, attribute, our class) for the names test modules import."""
    import lightning.pytorch.strategies as strategies
    import lightning.pytorch.strategies.ddp as ddp_module
    import lightning.pytorch.strategies.model_parallel as mp_module

    import lit_parallel as lp

    if mode == "ddp_tuned":
        return [(m, "DDPStrategy", lp.TunedDDPStrategy) for m in (strategies, ddp_module)]
    ours = {
        "fsdp_blocks": lp.TransformerFSDPStrategy,
        "hsdp": lp.HybridShardStrategy,
        "tp_dp": lp.TensorParallelStrategy,
        "pp_dp": lp.PipelineParallelStrategy,
    }
    if mode in ours:
        return [(m, "ModelParallelStrategy", ours[mode]) for m in (strategies, mp_module)]
    return []


class ContractPlugin:
    """Substitutes the strategies and records outcomes."""

    def __init__(self, mode: str, results: str | None) -> None:
        self.mode = mode
        self.results_path = Path(results) if results else None
        self.outcomes: dict[str, str] = {}

    def install_registry(self) -> None:
        from lightning.pytorch.strategies import StrategyRegistry

        for name, entry in _registry_substitutions(self.mode).items():
            StrategyRegistry[name] = entry

    @pytest.hookimpl(wrapper=True)
    def pytest_collection(self, session: pytest.Session) -> Iterator[None]:
        saved = [(m, attr, getattr(m, attr)) for m, attr, _ in _name_substitutions(self.mode)]
        for module, attr, ours in _name_substitutions(self.mode):
            setattr(module, attr, ours)
        try:
            return (yield)
        finally:
            for module, attr, original in saved:
                setattr(module, attr, original)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
        elif report.failed:
            outcome = "failed"
        elif report.skipped:
            outcome = "skipped"
        elif report.when == "call":
            outcome = "passed"
        else:
            return
        previous = self.outcomes.get(report.nodeid)
        if previous != "failed":  # an error in teardown after a passing call counts as a failure
            self.outcomes[report.nodeid] = outcome

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.results_path is not None:
            self.results_path.parent.mkdir(parents=True, exist_ok=True)
            self.results_path.write_text(json.dumps({"mode": self.mode, "outcomes": self.outcomes}, indent=0))


def pytest_configure(config: pytest.Config) -> None:
    mode = config.getoption("--lit-strategy")
    plugin = ContractPlugin(mode, config.getoption("--lit-results"))
    if mode != "lightning":
        import lit_parallel  # noqa: F401  (registers our strategies)

        plugin.install_registry()
    config.pluginmanager.register(plugin, "lit_parallel_contract")
