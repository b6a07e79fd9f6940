"""Stall reports, signals and what a strategy leaves behind after ``fit``, on real
gloo ranks.

Three launches, each failing on purpose at its end:

1. Lightning's launcher, 2 ranks: three fits in the same processes with ``stall_timeout=2`` and slow phases
   that are not stalls (a slow first step, a slow torch.compile recompilation late in the fit, validation,
   checkpoint save, data loading), threads and environment checked during and after each; then rank 1
   sleeps for good in ``training_step``.
2. Lightning's launcher, 2 ranks: rank 1 sleeps for good, rank 0 waits in a collective, ``SIGINT`` to the
   launching process.
3. torchrun, 2 ranks: the same with ``SIGTERM`` to torchrun's agent.

Expected positions are read from the scenario's source, exit statuses from the processes themselves. Every
rank of every launch ends through ``os._exit`` after aborting its communicators (a spy around the abort
writes ``aborted_rank<r>``).
"""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest
import torch

from lit_parallel.reliability.signals import exit_status
from lit_parallel.reliability.stall import STALL_EXIT_CODE
from tests.harness import launch_failing
from tests.scenarios import reliability_stall as sc

pytestmark = pytest.mark.multiprocess
SC = "tests.scenarios.reliability_stall"
BATCHES = sc.N_SAMPLES // (2 * sc.BATCH)  # training batches per fit and rank
# How long the processes may outlive a stall report's deadline or a signal, counted from the stall's or the
# signal's own time stamp. Generous for a loaded machine (interpreters and Lightning shutting down), and
# still far below what a rank that does not exit would take: rank 1 sleeps for an hour, the launch times out
# after 400 s, a collective waits Lightning's 30 minutes.
SLACK_S = 30.0
# A stall is measured from the last training step any rank completed; rank 1 stamps ``stall_started`` at
# the start of the next one, after that step's end hooks and the next batch's fetch.
STEP_TO_STAMP_S = 2.0


def _stamp(path: Path) -> float:
    return float(path.read_text())


def _launch(tmp_path_factory, tag: str, scenarios: list[str], launcher: str, **args) -> tuple:
    return launch_failing(
        tmp_path_factory, tag, [f"{SC}:{s}" for s in scenarios], args=args, launcher=launcher, timeout=400
    )


def _assert_every_rank_aborted_its_communicators(data: Path) -> None:
    for rank in (0, 1):
        seen = json.loads((data / f"aborted_rank{rank}").read_text())
        assert seen["groups"] >= 1 and seen["initialized_after"] is False, (rank, seen)


def _line_of(marker: str) -> int:
    lines = Path(inspect.getsourcefile(sc)).read_text().splitlines()
    return next(i + 1 for i, line in enumerate(lines) if marker in line)


# --- launch 1: three fits, then a stall ------------------------------------------------------------------


@pytest.fixture(scope="module")
def stall(tmp_path_factory):
    return _launch(
        tmp_path_factory, "stall", ["three_fits_without_false_stalls", "stall_then_exit"], "lightning"
    )


@pytest.mark.timeout(460)
def test_repeated_fits_stop_every_thread_and_restore_the_environment(stall):
    _, data, _ = stall
    for rank in (0, 1):
        out = torch.load(data / f"fits_rank{rank}.pt", weights_only=True)
        watcher = "lit_parallel-launcher-watchdog" if rank == 0 else "lit_parallel-parent-watchdog"
        expected = sorted(
            [
                watcher,
                "lit_parallel-rank-watchdog",
                "lit_parallel-signal-watchdog",
                "lit_parallel-stall-watchdog",
            ]
        )
        assert out["before"] == []
        for fit in ("fit1", "fit2", "fit3"):
            # one of each while the strategy is set up (none accumulates), none after its teardown
            assert out[fit]["during"] == expected, (rank, fit, out[fit]["during"])
            assert out[fit]["after"] == [], (rank, fit, out[fit]["after"])
        if rank == 0:  # the launching process: the variable is for the ranks it starts, never left set here
            assert out["env_before"] is None
            assert [out[f]["env"] for f in ("fit1", "fit2", "fit3")] == [None, None, None]
        else:  # a started rank inherits it: its launching process's pid
            assert out["fit3"]["env"].isdigit()


@pytest.mark.timeout(460)
def test_slow_first_step_validation_save_and_data_loading_are_not_reported_as_stalls(stall):
    res, data, _ = stall
    for rank in (0, 1):
        out = torch.load(data / f"fits_rank{rank}.pt", weights_only=True)
        assert [out[f]["losses"] for f in ("fit1", "fit2", "fit3")] == [BATCHES] * 3
        # compiled in the first step, compiled again for the new shape in step 4 (slowly on rank 1, while
        # rank 0 waited for it in the gradient all-reduce): the clock paused while torch compiled
        assert out["fit1"]["compiled_shapes"] == [4, 3], out["fit1"]["compiled_shapes"]
    assert (data / "ckpt").is_dir()  # the slow saves happened
    assert res.output.count("lit_parallel: stall:") == 1  # the real stall at the end, nothing before


@pytest.mark.timeout(460)
def test_a_rank_stuck_in_training_step_is_reported_once_and_every_rank_exits(stall):
    res, data, end = stall
    assert res.returncode == STALL_EXIT_CODE and not res.timed_out  # every process of the session is gone
    assert res.output.count("lit_parallel: stall:") == 1
    report = res.output[res.output.index("lit_parallel: stall:") :]
    summary = report.splitlines()[1]
    line = _line_of("# STALL HERE")
    assert f"rank 1 in training_step at reliability_stall.py:{line}" in summary, summary
    assert "rank 0 in backward, waiting in the gradient all-reduce / reduce-scatter" in summary, summary
    assert "rank 1: training_step of training batch 3 (epoch 0)" in report
    assert f"reliability_stall.py:{line} in training_step: time.sleep(3600)" in report
    stalled_for = float(re.search(r"no rank completed a training step for ([0-9.]+) s", report).group(1))
    gone = end - _stamp(data / "stall_started")
    print(f"stall to report: {stalled_for:.1f} s; stall to every process gone: {gone:.1f} s")
    # reported after the stall timeout, not before; and no longer a stall than the wall clock allows: the
    # report came before every process was gone
    assert sc.STALL_S < stalled_for <= gone + STEP_TO_STAMP_S
    assert gone < sc.STALL_S + SLACK_S
    _assert_every_rank_aborted_its_communicators(data)


# --- launches 2 and 3: signals while a rank blocks in a collective ---------------------------------------


@pytest.fixture(scope="module")
def sigint_lightning(tmp_path_factory):
    return _launch(tmp_path_factory, "sigint", ["signal_while_blocked"], "lightning", signal="SIGINT")


@pytest.fixture(scope="module")
def sigterm_torchrun(tmp_path_factory):
    return _launch(tmp_path_factory, "sigterm", ["signal_while_blocked"], "torchrun", signal="SIGTERM")


@pytest.mark.timeout(460)
def test_sigint_to_lightnings_launching_process_ends_every_rank_with_status_130(sigint_lightning):
    res, data, end = sigint_lightning
    assert exit_status(2) == 130
    assert res.returncode == 130 and not res.timed_out and res.results == {}
    assert _stamp(data / "signal_sent") - _stamp(data / "stall_started") >= 1.0  # rank 0 was blocked
    # the launching process passed the signal on and reports how the rank it started ended
    assert (
        "received SIGINT: exiting with status 130; exit status of the ranks it started: rank 1: 130"
        in res.output
    )
    gone = end - _stamp(data / "signal_sent")
    print(f"SIGINT to every process gone: {gone:.2f} s")
    assert gone < SLACK_S
    _assert_every_rank_aborted_its_communicators(data)


@pytest.mark.timeout(460)
def test_sigterm_to_torchrun_ends_every_rank_with_status_143(sigterm_torchrun):
    res, data, end = sigterm_torchrun
    assert not res.timed_out and res.results == {}
    assert res.returncode != 0  # torchrun's agent itself raises SignalException (status 1)
    assert "Sending process" in res.output and "closing signal SIGTERM" in res.output  # torchrun passed it on
    for rank in (0, 1):
        assert re.search(rf"rank {rank} \(pid \d+\) received SIGTERM: exiting with status 143", res.output)
    gone = end - _stamp(data / "signal_sent")
    print(f"SIGTERM to torchrun to every process gone: {gone:.2f} s")
    assert gone < SLACK_S
    _assert_every_rank_aborted_its_communicators(data)
