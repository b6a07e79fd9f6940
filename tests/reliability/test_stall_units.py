"""Stall reports and signals without launching ranks: the argument, the deadline arithmetic, the step clock,
the report's wording, and the signal handling in a real child process."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import lit_parallel as lp
from lit_parallel import _compat
from lit_parallel.reliability import groups, stall
from lit_parallel.reliability.options import (
    AUTO_FACTOR,
    AUTO_FLOOR_S,
    REPORT_WAIT_S,
    check_stall_timeout,
    check_stall_timeout_fits,
    limit_before_timeout_s,
)
from lit_parallel.reliability.signals import CHILD_WAIT_S, SignalExit
from lit_parallel.reliability.stall import (
    CHECK_S,
    COMPILING,
    StallClock,
    compose_stall_report,
    short_position,
    step_deadline_s,
)

REPO = Path(__file__).resolve().parents[2]


# --- the argument ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, expected", [("auto", "auto"), (5, 5.0), (0.5, 0.5), (None, None), (False, None)]
)
def test_stall_timeout_values(value, expected):
    assert check_stall_timeout(value) == expected


@pytest.mark.parametrize("value", [0, -3, float("inf"), float("nan"), True, "fast", "5", [5]])
def test_stall_timeout_refused_with_the_rule(value):
    with pytest.raises(ValueError, match=r"stall_timeout=.* must be 'auto' .* a positive number of seconds"):
        check_stall_timeout(value)


@pytest.mark.parametrize(
    "make",
    [
        lambda v: lp.TunedDDPStrategy(stall_timeout=v),
        lambda v: lp.TransformerFSDPStrategy(stall_timeout=v),
        lambda v: lp.HybridShardStrategy(stall_timeout=v),
        lambda v: lp.TensorParallelStrategy(stall_timeout=v),
        lambda v: lp.AutoStrategy(stall_timeout=v),
    ],
)
def test_every_strategy_takes_stall_timeout_and_checks_it_when_built(make):
    assert make(7).reliability.options.stall_timeout == 7.0
    assert make(None).reliability.options.stall_timeout is None
    with pytest.raises(ValueError, match="stall_timeout='soon'"):
        make("soon")


def test_stall_reports_are_on_by_default_in_every_strategy():
    for cls in (
        lp.TunedDDPStrategy,
        lp.TransformerFSDPStrategy,
        lp.HybridShardStrategy,
        lp.TensorParallelStrategy,
    ):
        assert cls().reliability.options.stall_timeout == "auto"
    assert lp.AutoStrategy()._common_kwargs["stall_timeout"] == "auto"  # passed on to the chosen strategy


# --- the deadline ---------------------------------------------------------------------------------------


LIMIT_30_MIN = limit_before_timeout_s(1800.0)  # under Lightning's default collective timeout


def test_auto_deadline_is_ten_times_the_slowest_step_between_floor_and_the_limit():
    assert (AUTO_FACTOR, AUTO_FLOOR_S) == (10.0, 120.0)
    assert LIMIT_30_MIN == 1800.0 - 180.0  # 10 % of the timeout
    assert step_deadline_s("auto", 0.01, LIMIT_30_MIN) == 120.0
    assert step_deadline_s("auto", 30.0, LIMIT_30_MIN) == 300.0
    assert step_deadline_s("auto", 90.0, LIMIT_30_MIN) == 900.0
    assert step_deadline_s("auto", 500.0, LIMIT_30_MIN) == 1620.0
    assert step_deadline_s(7.5, 500.0, LIMIT_30_MIN) == step_deadline_s(7.5, None, 10.0) == 7.5  # as given
    assert step_deadline_s("auto", None, LIMIT_30_MIN) is None  # nothing measured yet: not timed
    assert step_deadline_s(None, 1.0, LIMIT_30_MIN) is None
    # a collective timeout too short for the floor: "auto" does not time steps (the timeout's report does)
    assert step_deadline_s("auto", 0.01, limit_before_timeout_s(120.0)) is None


def test_a_job_with_sub_second_steps_is_reported_within_five_minutes():
    # the deadline, plus one look at the clock, plus the time to collect every rank's answer
    worst = step_deadline_s("auto", 0.999, LIMIT_30_MIN) + CHECK_S + REPORT_WAIT_S
    assert worst <= 300.0


# What a stall report needs from the deadline to the exit of every process, added up from the waits of the
# report's path (a look at the clock, collecting the answers, the acknowledgements, stopping the ranks the
# launching process started, aborting the communicators).
REPORT_PATH_S = CHECK_S + 2 * REPORT_WAIT_S + CHILD_WAIT_S + groups.ABORT_WAIT_S


@pytest.mark.parametrize(
    "timeout_s",
    [
        1800.0,  # Lightning's and every strategy's default timeout (also under SLURM: nothing changes it)
        600.0,  # torch's NCCL default, when timeout=None reaches init_process_group
        150.0,  # the shortest with "auto" on
        120.0,  # the test harness's torchrun group (tests/_worker.py)
        3600.0,
        86400.0,
    ],
)
def test_every_stall_limit_ends_before_the_collective_timeout_with_time_for_the_report(timeout_s):
    limit = limit_before_timeout_s(timeout_s)
    # the time a rank may stay in data loading, validation, a save or a compilation
    assert limit + REPORT_PATH_S < timeout_s
    for slowest in (0.001, 1.0, 12.0, 100.0, 1e4):
        deadline = step_deadline_s("auto", slowest, limit)
        assert deadline is None or deadline + REPORT_PATH_S < timeout_s, (slowest, deadline)


def test_a_stall_timeout_that_would_end_after_the_collective_timeout_is_refused_naming_the_fix():
    check_stall_timeout_fits(1620.0, timedelta(minutes=30))
    check_stall_timeout_fits("auto", timedelta(seconds=10))  # "auto" adapts (or is off)
    check_stall_timeout_fits(5000.0, None)  # unknown until the group exists: checked at set-up
    with pytest.raises(ValueError) as caught:
        check_stall_timeout_fits(1800.0, timedelta(minutes=30))
    message = str(caught.value)
    assert "stall_timeout=1800 s does not end before the collective timeout (1800 s)" in message
    assert "Pass stall_timeout=1620 or less, or timeout=timedelta(seconds=2000) or more" in message
    with pytest.raises(ValueError, match=r"\(20 s\).* Pass timeout=timedelta\(seconds=35\) or more"):
        check_stall_timeout_fits(5.0, timedelta(seconds=20))


@pytest.mark.parametrize(
    "make",
    [
        lambda **kw: lp.TunedDDPStrategy(**kw),
        lambda **kw: lp.TransformerFSDPStrategy(**kw),
        lambda **kw: lp.TensorParallelStrategy(**kw),
        lambda **kw: lp.AutoStrategy(**kw),
    ],
)
def test_every_strategy_refuses_a_stall_timeout_beyond_its_collective_timeout_when_built(make):
    with pytest.raises(ValueError, match=r"stall_timeout=1800 s does not end before the collective timeout"):
        make(stall_timeout=1800)  # the default timeout: 30 minutes
    with pytest.raises(ValueError, match=r"stall_timeout=280 s .* timeout \(300 s\)"):
        make(stall_timeout=280, timeout=timedelta(minutes=5))
    make(stall_timeout=270, timeout=timedelta(minutes=5))


def test_the_limits_follow_the_timeout_a_real_process_group_has(tmp_path):
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=400))
    try:
        sub = dist.new_group([0], timeout=timedelta(seconds=250))
        assert _compat.group_timeout(sub) == timedelta(seconds=250)
        # the shortest of the rank's groups, whatever the strategy was told
        assert groups.collective_timeout_s(timedelta(minutes=30)) == 250.0
        groups.set_timeout_on_all_groups(timedelta(seconds=900))
        assert groups.collective_timeout_s(None) == 900.0
    finally:
        dist.destroy_process_group()
    assert groups.collective_timeout_s(timedelta(seconds=77)) == 77.0  # no group: the configured one


class _FakeTime:
    def __init__(self):
        self.now = 1000.0

    def monotonic(self):
        return self.now


def test_the_clock_pauses_while_torch_compiles_also_a_recompile_late_in_training():
    clock = StallClock()
    clock.completed = stall.WARMUP_STEPS  # past warm-up: steps are timed
    during: list[tuple[bool, str]] = []

    def backend(gm, example_inputs):  # a real dynamo compilation; the backend runs inside it
        during.append((clock.in_step, clock.phase))
        return gm.forward

    double = torch.compile(lambda x: x * 2, backend=backend, dynamic=False)
    _compat.watch_compiles(clock.compile_begins, clock.compile_ends)
    try:
        clock.step_begins()
        double(torch.ones(4))  # first compile
        assert clock.in_step and clock.phase == "training step"
        clock.step_ends()
        clock.step_begins()
        double(torch.ones(4))  # cached: no compile, the step is timed throughout
        clock.step_ends()
        clock.step_begins()
        before = clock.since
        double(torch.ones(3))  # a new shape (a smaller last batch): a recompile inside a timed step
        assert clock.in_step and clock.phase == "training step" and clock.since > before  # timed afresh
        clock.step_ends()
    finally:
        _compat.unwatch_compiles(clock.compile_begins, clock.compile_ends)
    assert during == [(False, COMPILING), (False, COMPILING)]
    assert len(clock.durations) == 1  # the steps that compiled are no step times ("auto" ignores them)


def test_the_clock_times_only_steps_after_warm_up_and_without_a_save_or_validation(monkeypatch):
    fake = _FakeTime()
    monkeypatch.setattr(stall, "time", fake)
    clock = StallClock()
    for duration in (50.0, 20.0):  # two warm-up steps (ddp_tuned's wrap): never timed
        clock.step_begins()
        assert not clock.in_step and "not timed" in clock.phase
        fake.now += duration
        clock.step_ends()
    assert clock.slowest() is None
    clock.step_begins()
    assert clock.in_step and clock.since == fake.now
    fake.now += 0.5
    clock.step_ends()
    assert clock.slowest() == 0.5 and not clock.in_step
    assert clock.phase == "between training steps (callbacks, data loading)"
    clock.step_begins()
    fake.now += 2.0
    clock.pause("saving a checkpoint")  # a save inside the step: this step's time is not a step time
    fake.now += 100.0
    clock.step_ends()
    assert clock.slowest() == 0.5
    clock.step_begins()
    fake.now += 0.25
    clock.step_ends()
    assert clock.slowest() == 0.5 and list(clock.durations) == [0.5, 0.25]


# --- the report -----------------------------------------------------------------------------------------

SITE = "/venv/lib/python3.11/site-packages"


def _answer(stage, batch, frames, elapsed=6.0, slowest=0.04):
    return {
        "stage": stage,
        "where": f"{stage} of training batch {batch} (epoch 0)",
        "frames": frames,
        "elapsed": elapsed,
        "phase": "training step",
        "slowest": slowest,
        "in_step": True,
    }


FIT = ["/home/me/train.py", 88, "main", "trainer.fit(model, data)"]
BACKWARD = [f"{SITE}/torch/autograd/graph.py", 829, "_engine_run_backward", "return Variable..."]
STEP = ["/home/me/model.py", 42, "training_step", "batch = self.fetch_remote(batch)"]
ALL_GATHER = [
    f"{SITE}/torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py",
    200,
    "foreach_all_gather",
    "",
]


def test_short_positions_name_the_stage_the_users_line_and_the_collective():
    assert short_position(_answer("training_step", 3, [FIT, STEP])) == "training_step at model.py:42"
    assert (
        short_position(_answer("backward", 3, [FIT, BACKWARD]))
        == "backward, waiting in the gradient all-reduce / reduce-scatter (from main at train.py:88)"
    )
    assert (
        short_position(_answer("training_step", 3, [FIT, STEP, ALL_GATHER]))
        == "training_step at model.py:42, waiting in FSDP2's foreach_all_gather"
    )


def test_the_report_groups_ranks_by_position_and_lists_each_ranks_frames():
    answers = {r: _answer("backward", 3, [FIT, BACKWARD]) for r in (0, 2, 3)}
    answers[1] = _answer("training_step", 3, [FIT, STEP], slowest=0.07)
    text = compose_stall_report(answers, 4, deadline_s=120.0, setting="auto", stalled_s=121.3)
    lines = text.splitlines()
    assert lines[0] == (
        "lit_parallel: stall: no rank completed a training step for 121.3 s (stall_timeout='auto': 120 s);"
        " ending the run with exit status 124"
    )
    assert lines[1] == (
        "  ranks 0, 2, 3 in backward, waiting in the gradient all-reduce / reduce-scatter (from main at train.py:88);"
        " rank 1 in training_step at model.py:42"
    )
    assert "    rank 1: training_step of training batch 3 (epoch 0), 6.0 s in training step" in lines
    assert "      /home/me/model.py:42 in training_step: batch = self.fetch_remote(batch)" in lines
    assert lines[-1].startswith("  The slowest recent step took 0.07 s.")
    assert "stall_timeout=<seconds>" in lines[-1] and "None to turn stall reports off" in lines[-1]


def test_the_report_names_ranks_that_did_not_answer():
    text = compose_stall_report({0: _answer("backward", 5, [FIT, BACKWARD])}, 2, 4.0, 4.0, 4.2)
    assert "(stall_timeout=4 s)" in text.splitlines()[0]
    assert "; rank 1 did not answer" in text.splitlines()[1]


# --- signals, in a real child process -------------------------------------------------------------------

_CHILD = textwrap.dedent(
    """
    import importlib.util, signal, subprocess, sys, threading
    # the module alone (standard library only): importing the package would load torch and Lightning
    spec = importlib.util.spec_from_file_location("signals", {path!r})
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    SignalExit = module.SignalExit
    grandchild = subprocess.Popen(
        # SIGINT's default action even when this runs with it ignored (a shell's background job): Python
        # leaves an inherited "ignored" in place, and the grandchild would outlive the signal
        [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGINT, signal.SIG_DFL);"
         " print('up', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )
    assert grandchild.stdout.readline().strip() == b"up"  # past its start-up: the signal finds it sleeping
    def stop_children(signum, wait_s):
        grandchild.send_signal(signum)
        grandchild.wait(wait_s)
        return f"grandchild: {{grandchild.returncode}}"
    handler = SignalExit(0, stop_children)
    assert handler.install()
    if {retire}:
        handler.uninstall()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        assert signal.set_wakeup_fd(-1) == -1  # the previous wakeup descriptor (none) is back
        assert not [t for t in threading.enumerate() if t.name.startswith("lit_parallel")]
    print("ready", flush=True)
    threading.Event().wait(60)  # the main thread blocks, as in a collective
    """
)


def _child(retire: bool) -> subprocess.Popen:
    code = _CHILD.format(path=str(REPO / "lit_parallel" / "reliability" / "signals.py"), retire=retire)
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.mark.timeout(60)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_ends_a_blocked_process_with_128_plus_the_signal_after_its_children(signum):
    proc = _child(retire=False)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signum
    name = signal.Signals(signum).name
    # the grandchild got the same signal (default action: killed by it)
    assert (
        f"rank 0 (pid {proc.pid}) received {name}: exiting with status {128 + signum}; grandchild: {-signum}"
        in err
    )


@pytest.mark.timeout(60)
def test_after_uninstall_the_previous_handlers_are_back():
    proc = _child(retire=True)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGTERM  # SIG_DFL again: no lit_parallel handling left


def test_the_preemption_signal_is_not_taken_over():
    # preemption_signal="SIGTERM" keeps SIGTERM for save-and-requeue; SLURM's SIGUSR1 is never ours
    assert SignalExit(0, lambda s, w: "", skip=signal.SIGTERM).signals == (signal.SIGINT,)
    assert SignalExit(0, lambda s, w: "", skip=signal.SIGUSR1).signals == (signal.SIGINT, signal.SIGTERM)


# --- the decision, on a real key-value store (torch's in-process HashStore), two ranks, no threads --------


def _watchdogs(monkeypatch, setting=3.0):
    import torch.distributed as dist

    fake = _FakeTime()
    monkeypatch.setattr(stall, "time", fake)
    monkeypatch.setattr(stall, "REPORT_WAIT_S", 0.0)  # every answer is in the store before anyone asks
    store = dist.HashStore()
    ended: list[tuple[int, int]] = []
    dogs = []
    for rank in (0, 1):
        clock = StallClock()
        clock.completed = stall.WARMUP_STEPS  # warm-up done
        dog = stall.StallWatchdog(
            store,
            "run0/stall",
            rank,
            2,
            clock,
            setting,
            lambda r=rank: {"stage": "training_step", "rank": r},
            lambda c: None,
            limit_s=LIMIT_30_MIN,
        )
        dog.exit = lambda code, r=rank: ended.append((r, code))
        dogs.append(dog)
    return fake, store, dogs, ended


def test_a_rank_loading_data_holds_the_report_back(monkeypatch, capsys):
    fake, _, (r0, r1), ended = _watchdogs(monkeypatch)
    r0.clock.step_begins()
    r1.clock.pause("between training steps (callbacks, data loading)")
    fake.now += 10.0  # rank 0 waited 10 s > stall_timeout=3 in its step: it asks
    r1._answer(1)  # rank 1's answer to the question to come (its thread would write it while rank 0 waits)
    r0.poll()
    assert ended == [] and "stall" not in capsys.readouterr().err
    assert r0._next_check == fake.now + 5.0  # asks again in 5 s, not at every look


def test_a_rank_paused_near_the_limit_is_asked_again_when_it_reaches_it(monkeypatch, capsys):
    # rank 1 has loaded data for nearly the limit: the next question comes when it reaches it (and the
    # report before the collective timeout), not a quarter of a long deadline later
    fake, _, (r0, r1), ended = _watchdogs(monkeypatch, setting=1000.0)
    r1.clock.pause("between training steps (callbacks, data loading)")
    fake.now += LIMIT_30_MIN - 2.0 - 1001.0
    r0.clock.step_begins()
    fake.now += 1001.0  # rank 0 past its deadline, rank 1 2 s short of the limit
    r1._answer(1)
    r0.poll()
    assert ended == [] and r0._next_check == fake.now + 3.0  # the 2 s left, plus one look
    fake.now += 3.0
    r1._answer(2)  # now 1 s past the limit: stalled too
    r0.poll()
    assert ended == [(0, 124)] and capsys.readouterr().err.count("lit_parallel: stall:") == 1


def test_every_rank_in_a_step_past_the_deadline_is_a_stall_reported_once(monkeypatch, capsys):
    fake, store, (r0, r1), ended = _watchdogs(monkeypatch)
    r0.clock.step_begins()
    r1.clock.step_begins()
    fake.now += 4.0
    r1._answer(1)
    r0.poll()  # rank 0 reports and ends
    err = capsys.readouterr().err
    assert err.count("lit_parallel: stall:") == 1
    assert "no rank completed a training step for 4.0 s (stall_timeout=3 s)" in err
    assert "ranks 0, 1 in training_step" in err
    assert ended == [(0, 124)]
    r1._next_check = 0.0
    r1.poll()  # rank 1 sees the end at its next look, without a report of its own
    assert ended == [(0, 124), (1, 124)]
    assert capsys.readouterr().err == ""
    assert store.add("run0/stall/reporter", 0) == 1 and store.add("run0/stall/acks", 0) == 2


def test_no_report_before_the_deadline_or_during_warm_up(monkeypatch, capsys):
    fake, store, (r0, _), ended = _watchdogs(monkeypatch)
    r0.clock.step_begins()
    fake.now += 2.9
    r0.poll()
    r0.clock.completed = 0
    r0.clock.step_begins()  # a warm-up step: not timed however long it takes
    fake.now += 1000.0
    r0.poll()
    assert ended == [] and store.add("run0/stall/query", 0) == 0


def test_a_rank_that_does_not_answer_is_reported_only_when_silent_twice(monkeypatch, capsys):
    fake, _, (r0, r1), ended = _watchdogs(monkeypatch)
    r0.clock.step_begins()
    fake.now += 4.0
    r0.poll()  # rank 1 never answers: maybe only busy, ask again later
    assert ended == [] and r0._silent == {1}
    fake.now += 5.0
    r0.poll()
    assert ended == [(0, 124)]
    err = capsys.readouterr().err
    assert err.count("lit_parallel: stall:") == 1
    assert "  rank 0 in training_step; rank 1 did not answer" in err


@pytest.mark.timeout(60)
def test_the_signal_message_is_printed_even_when_stopping_the_children_fails():
    code = _CHILD.replace(
        "grandchild.send_signal(signum)", "grandchild.kill(); raise TimeoutError('the ranks did not stop')"
    )
    code = code.format(path=str(REPO / "lit_parallel" / "reliability" / "signals.py"), retire=False)
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM
    assert (
        f"rank 0 (pid {proc.pid}) received SIGTERM: exiting with status 143; stopping the processes it started"
        " failed: TimeoutError: the ranks did not stop" in err
    )
