"""Host synchronisations per optimizer step, every strategy, counted by a dispatch mode on real gloo ranks.

Each ``.item()`` / ``float(t)`` / ``bool(t)`` is ``aten._local_scalar_dense``: on CUDA a wait for every queued
kernel. With gradient clipping on and the SLURM preemption check on, the only one left per step is Lightning's
own (``_broadcast_sigterm_tensor`` in its training loop, in every strategy, Lightning's ``ddp`` included).
"""

from __future__ import annotations

import pytest

from tests.scenarios.host_syncs import STRATEGIES

pytestmark = pytest.mark.multiprocess

LIGHTNINGS_OWN = "_broadcast_sigterm_tensor"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", STRATEGIES)
def test_at_most_one_host_sync_per_optimizer_step_and_it_is_lightnings(advise_two_ranks, name):
    for rank, out in enumerate(advise_two_ranks.scenario("syncs_per_step")):
        run = out[name]
        # the preemption check (an all-reduce after every optimizer step) ran in every strategy of ours
        assert run["preemption_on"] is (name != "ddp"), (name, rank)
        assert len(run["per_step"]) == 4 and all(n <= 1 for n in run["per_step"]), (
            name,
            rank,
            run["per_step"],
        )
        ours = [w for w in run["where"] if LIGHTNINGS_OWN not in w]
        assert not ours, f"{name} rank {rank}: host syncs of lit_parallel in steps 3-6:\n" + "\n".join(ours)
