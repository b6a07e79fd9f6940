"""CollectiveWaitTimer counts the waits of every thread while a window is open (on CUDA, FSDP2 waits for its
reduce-scatters on autograd's device thread, not on the thread that opened the step's window).

Real gloo process groups, three ranks in this one process (each rank's group object used from its own
thread), so that two threads wait at once for a third rank that arrives late.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lit_parallel.measure.collective_waits import CollectiveWaitTimer

LATE_S = 0.3


def _groups(n: int) -> list:
    store = dist.HashStore()
    out: list = [None] * n

    def join(rank: int) -> None:  # the ranks rendezvous with each other: each on its own thread
        out[rank] = dist.ProcessGroupGloo(dist.PrefixStore("waits", store), rank, n, timedelta(seconds=60))

    threads = [threading.Thread(target=join, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.mark.timeout(120)
def test_waits_on_other_threads_count_and_overlapping_waits_count_once():
    pgs = _groups(3)
    tensors = [torch.ones(8) for _ in pgs]
    began: dict[int, float] = {}

    def wait_on(rank: int) -> None:  # ranks 0 and 1: a helper thread each, as autograd's device thread
        work = pgs[rank].allreduce([tensors[rank]])
        began[rank] = time.perf_counter()
        work.wait()

    timer = CollectiveWaitTimer("cpu").install()
    try:
        timer.open()  # on this thread, which never waits itself
        helpers = [threading.Thread(target=wait_on, args=(r,)) for r in (0, 1)]
        for t in helpers:
            t.start()
        time.sleep(LATE_S)
        arrived = time.perf_counter()
        late = pgs[2].allreduce([tensors[2]])  # rank 2 arrives late; its own wait comes after the window
        for t in helpers:
            t.join()
        timer.close()
        late.wait()
    finally:
        timer.uninstall()
    assert [t[0].item() for t in tensors] == [3.0, 3.0, 3.0]  # the all-reduce really ran
    (window,) = timer.windows()
    assert len(window.waits) == 2  # both helper threads' waits; before: none (not the opening thread)
    # each waited at least from its own wait's start until rank 2 arrived (its own time stamps)
    for wait, rank in zip(sorted(window.waits), sorted(began, key=began.get, reverse=True)):
        assert wait >= arrived - began[rank] - 1e-3, (window.waits, began, arrived)
    # the two waits overlapped: the time compute waited counts them once, within the window
    assert window.waited < sum(window.waits)
    assert arrived - max(began.values()) - 1e-3 <= window.waited <= window.span


@pytest.mark.timeout(120)
def test_a_wait_that_ends_after_its_window_closed_is_not_counted():
    pgs = _groups(2)
    a, b = torch.ones(4), torch.ones(4)
    timer = CollectiveWaitTimer("cpu").install()
    try:
        timer.open()
        work = pgs[0].allreduce([a])
        helper = threading.Thread(target=work.wait)
        helper.start()
        time.sleep(0.05)
        timer.close()  # the helper still waits for rank 1
        pgs[1].allreduce([b]).wait()
        helper.join()
    finally:
        timer.uninstall()
    (window,) = timer.windows()
    assert window.waits == () and window.waited == 0.0
