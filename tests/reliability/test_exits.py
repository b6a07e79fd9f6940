"""Every way a rank ends itself (``os._exit``: a stall, a signal, Lightning's launcher's watchdogs, a failed
``advise --verify`` pipeline step) aborts its process group's communicators first, within a bounded time.

On NCCL an exit without the abort leaves the peers waiting in their collectives until the timeout; the abort
makes them fail at once. Here on a real gloo group, in a forked copy of this process (the exit ends it): a
spy around the compatibility layer's abort records that it ran, with how many groups, and that
``torch.distributed`` was uninitialised afterwards. The multi-process launches of ``test_stall.py`` check
the same through the stall and signal exits of real runs.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from lit_parallel import _compat
from lit_parallel.reliability import groups, launcher


def _in_fork(
    tmp_path, body, *, hang_abort: bool = False, wait_s: float = 30.0
) -> tuple[int, dict | None, float]:
    """Fork; in the child, join a 1-rank gloo group (and a sub-group), spy on the abort, run ``body()``
    (which must end the process). Returns the child's exit status, what the spy saw, and the seconds taken."""
    r, w = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child: never returns to pytest
        try:
            os.close(r)
            store = dist.FileStore(str(tmp_path / "store"), 1)
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
            dist.new_group([0])
            real = _compat.abort_process_groups

            def spy():
                seen = {"groups": len(_compat.all_process_groups())}
                if hang_abort:
                    time.sleep(3600)  # an abort that never returns (a driver in a bad state)
                real()
                seen["initialized_after"] = dist.is_initialized()
                os.write(w, json.dumps(seen).encode())

            _compat.abort_process_groups = spy
            body()
        finally:
            os._exit(99)  # body() returned or raised: not an exit path
    os.close(w)
    seen, status = b"", None
    deadline = time.monotonic() + wait_s
    while status is None and time.monotonic() < deadline:
        if select.select([r], [], [], 0.05)[0]:
            seen += os.read(r, 4096)
        done, raw = os.waitpid(pid, os.WNOHANG)
        if done:
            status = os.waitstatus_to_exitcode(raw)
    if status is None:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail(f"the forked rank did not exit within {wait_s} s")
    while select.select([r], [], [], 0)[0]:
        chunk = os.read(r, 4096)
        if not chunk:
            break
        seen += chunk
    os.close(r)
    return status, (json.loads(seen) if seen else None), time.monotonic() - start


@pytest.fixture
def fork(tmp_path):
    def run(body, **kw):
        return _in_fork(tmp_path, body, **kw)

    return run


@pytest.mark.timeout(120)
def test_exit_process_aborts_every_group_then_exits_with_the_status(fork):
    code, seen, _ = fork(lambda: groups.exit_process(7))
    assert code == 7
    assert seen == {"groups": 2, "initialized_after": False}  # the default group and the sub-group


@pytest.mark.timeout(120)
def test_an_abort_that_hangs_cannot_keep_the_process_alive(fork):
    def body():
        groups.ABORT_WAIT_S = 0.5
        groups.exit_process(5)

    code, seen, took = fork(body, hang_abort=True)
    assert code == 5 and seen is None  # exited while the abort still hung
    assert took < 10.0


@pytest.mark.timeout(120)
def test_the_launching_process_ending_the_run_aborts_its_communicators(fork):
    def body():
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        launcher._LauncherWatchdog([child], 1, wait_s=1.0)._end("lit_parallel: rank 1 exited", exit_code=3)

    code, seen, _ = fork(body)
    assert code == 3 and seen == {"groups": 2, "initialized_after": False}


@pytest.mark.timeout(120)
def test_a_rank_whose_launching_process_is_gone_aborts_its_communicators(fork):
    def body():
        launcher._ParentWatchdog(os.getppid() + 10_000_000).start()  # not its parent: "gone"
        time.sleep(30)

    code, seen, _ = fork(body)
    assert code == 1 and seen == {"groups": 2, "initialized_after": False}
