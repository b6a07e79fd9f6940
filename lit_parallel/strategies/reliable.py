"""The reliability hooks the strategies share (:mod:`lit_parallel.reliability`), each written once.

A strategy mixes one of these classes in before its Lightning base class (``class S(ReliableTrainingMixin,
DDPStrategy)``): each hook runs Lightning's hook (all but ``on_exception``), then calls
``self.reliability``, one call each. The one hook a strategy writes itself is the process-group set-up, because Lightning's base classes name it
differently (``DDPStrategy.setup_distributed``, ``ModelParallelStrategy._setup_distributed``): one line,
``self.reliability.setup_process_group(self, super().<that hook>)``.
"""

from __future__ import annotations

from typing import Any

from typing_extensions import override

from lit_parallel.reliability import Reliability
from lit_parallel.strategies.arguments import CommonArguments


class ReliableStrategyMixin:
    """What every lit_parallel strategy adds to its Lightning base class: the common arguments
    (``common_arguments``, ``auto_resume``), the :class:`~lit_parallel.reliability.Reliability` built from
    them (``reliability``), the watched launcher, and the reliability's teardown after Lightning's.

    Invariant: ``common_arguments``, ``auto_resume`` and ``reliability`` exist once ``__init__`` has called
    :meth:`_init_common` (right after Lightning's ``__init__``); every hook below relies on them.
    """

    common_arguments: CommonArguments
    auto_resume: bool
    reliability: Reliability

    def _init_common(self, common: CommonArguments) -> None:
        """Keep the checked common arguments and build this strategy's reliability from them."""
        self.common_arguments = common
        self.auto_resume = common.auto_resume
        self.reliability = Reliability(common.reliability_options(), common.timeout)

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        # the watched launcher calls the strategy's _validate_before_launch before it starts other ranks
        self.reliability.configure_launcher(self)

    @override
    def teardown(self) -> None:
        try:
            self.reliability.finish_checkpoints()  # fit returns after the pending background writes
        finally:
            super().teardown()
            self.reliability.teardown()


class ReliableTrainingMixin(ReliableStrategyMixin):
    """:class:`ReliableStrategyMixin` and the reliability hooks of the run a strategy trains itself: RNG
    states restored at the end of a checkpoint restore (``barrier``), a mid-epoch resume
    (``process_dataloader``) and the failure report (``on_exception``). ``AutoStrategy`` hands the run over
    to the strategy it chooses and keeps Lightning's ``DDPStrategy`` hooks for these.
    """

    @override
    def barrier(self, name: str | None = None, *args: Any, **kwargs: Any) -> None:
        super().barrier(name, *args, **kwargs)
        self.reliability.after_barrier(name)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        return self.reliability.process_dataloader(self, super().process_dataloader(dataloader))

    @override
    def on_exception(self, exception: BaseException) -> None:
        # Lightning's on_exception is not called: DDPStrategy's rewrites DDP's messages with advice for
        # DDPStrategy, ModelParallelStrategy's does nothing
        self.reliability.on_exception(exception, self.global_rank)
