"""Dry runs: the real setup of a strategy on a simulated process group, and the per-rank state it leaves.

:mod:`~lit_parallel.parallel.simulated` makes one process one rank of a world of any size;
:mod:`.state` reads each parameter's placements and local shape from the module the setup left;
:mod:`lit_parallel.planner.memory.rank_state` is the planner's accounting of the same bytes, written from shapes
alone, which the tests check against the simulated state. The Lightning part (building a strategy and running its setup) lives in
:mod:`lit_parallel.strategies.dry_run`.
"""

from lit_parallel.planner.dry_run.state import ParameterPlacement, RankState, rank_state

__all__ = ["ParameterPlacement", "RankState", "rank_state"]
