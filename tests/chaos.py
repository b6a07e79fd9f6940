"""Chaos runs, checked by hand: one random fault per run, at a random step, and nothing may be lost.

Not collected by pytest (its name does not start with ``test_``); it takes minutes. Run from the repository
root (the disk-full fault mounts a small tmpfs, so it needs root; without root that fault is left out)::

    OMP_NUM_THREADS=1 python tests/chaos.py --runs 40 --seed 3
    OMP_NUM_THREADS=1 python tests/chaos.py --runs 20 --seed 2 --faults async_kill9   # only this fault

Each run trains a tiny Llama for ``--steps`` optimizer steps on 2 gloo ranks under one strategy (``ddp_tuned``,
``fsdp_blocks``, ``hsdp``, ``tp_dp``, ``pp_dp``: built by ``tests/scenarios/reliability.py``'s ``make_strategy``;
``pp_dp`` trains ``tests/scenarios/recovery.py``'s ``PipelinedLlama``, 2 stages) and one launcher (torchrun, or
Lightning's own launcher: ``python this_file.py --worker`` with ``devices=2``), with
``ModelCheckpoint(every_n_train_steps=2, save_last=True, save_top_k=-1)`` and ``async_checkpoint`` on or off
(drawn per run; always on for ``async_kill9``), and injects one fault:

- ``kill9``: ``kill -9`` of one rank. Under torchrun (``--max-restarts=1``) the restarted attempt resumes from
  ``last.ckpt`` by itself; under Lightning's launcher the run must fail naming the dead rank.
- ``async_kill9``: ``kill -9`` of one rank while the background write of the fault step's checkpoint is in
  progress (the worker makes that write leave a marker and pause :data:`WRITE_PAUSE_S` with its partial save
  on disk; the driver kills when it sees the marker). Judged as ``kill9``, and the attempt after the kill (torchrun's restart, or the resume)
  must find the interrupted checkpoint absent under its name (unless only ``ddp_tuned``'s rank 1 was killed:
  rank 0 writes that file alone and may commit it) and resume from the newest committed checkpoint.
- ``sigterm``: SIGTERM to the launching process. Every rank must be gone within 15 s: under Lightning's
  launcher with exit status 143; under torchrun every rank exits 143 and torchrun itself exits 1 (its own
  ``SignalException``).
- ``disk_full``: the checkpoint folder is a small tmpfs; one rank fills it at the fault step, so the next save
  meets a real ``ENOSPC``. The error must say that the disk is full.
- ``stall``: one rank sleeps in ``training_step`` (``pp_dp``: in ``on_train_batch_start``, as the strategy runs
  its own step; from step 2 on: the first two steps are left to the collective timeout). The stall watchdog
  (``stall_timeout``) must name the rank and where it is, and the job must end non-zero.

A run that failed is then resumed once, as a user (or SLURM's requeue) would: the same command without a
fault, ``fit(ckpt_path="last")``. Every run must end completed, with final parameters bitwise equal to an
uninterrupted run of the same strategy (with synchronous saves: a save in the background must not change
training). Counted over all runs, each must be 0: leftover processes (any process of the run alive 5 s after
its launcher ended), corrupt checkpoints (a checkpoint under its final name that
:func:`lit_parallel.checkpoint.load.verify_checkpoint` refuses, at the end or when an attempt starts) and lost
checkpoints (one the run logged as saved that is gone or refused, at the end or when an attempt starts). A
checkpoint is logged as saved (``saved.log``, by rank 0) once its save returned (synchronous) or its
background write committed (the writer's ``completed``). The summary prints the counts, per fault, strategy,
launcher and ``async_checkpoint``; the exit code is the number of bad runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

STRATEGIES = ("ddp_tuned", "fsdp_blocks", "hsdp", "tp_dp", "pp_dp")
LAUNCHERS = ("torchrun", "lightning")
FAULTS = ("kill9", "sigterm", "disk_full", "stall", "async_kill9")
KILLS = ("kill9", "async_kill9")
_KILLED_TEXT = (
    "exited with code -9",
    "Signal 9",
    "SIGKILL",
    "signal 9",
    "launching process (local rank 0, pid",
)
# what the output of a faulted attempt must contain: the fault, named
EXPECTED_TEXT = {
    "kill9": _KILLED_TEXT,
    "async_kill9": _KILLED_TEXT,
    "sigterm": (),  # judged by the exit status (128 + 15) and the time to exit
    "disk_full": ("disk is full",),
    "stall": ("stall",),
}
TMPFS_BYTES = 24 * 2**20
WRITE_PAUSE_S = 4.0  # async_kill9: the fault step's background write waits this long after its marker
WRITER_THREAD = "lit_parallel-checkpoint-writer"
_ALIVE: list = []


# --- the training program (each rank) -------------------------------------------------------------------


def _logged(run_dir: Path) -> set[str]:
    """The checkpoints logged as saved so far (``saved.log``)."""
    path = run_dir / "saved.log"
    return set(path.read_text().split()) if path.exists() else set()


def _log_saved(run_dir: Path, trainer, steps_below: int) -> None:
    """Rank 0: log the ``step=N.ckpt`` checkpoints saved so far. Asynchronous: those whose background write
    committed (the writer's ``completed``); synchronous: those whose save returned (``ModelCheckpoint`` saves
    after the other callbacks' ``on_train_batch_end``, so every step below ``steps_below``)."""
    checkpoints = trainer.strategy.reliability.checkpoints
    if checkpoints is not None:
        names = {Path(destination).name for destination, _ in checkpoints.writer.completed}
    else:
        names = {f"step={k}.ckpt" for k in range(2, steps_below, 2)}
    new = sorted(n for n in names - _logged(run_dir) if n.startswith("step="))
    if new:
        with open(run_dir / "saved.log", "a") as f:
            f.write("".join(f"{n}\n" for n in new))


def _log_attempt_start(run_dir: Path, trainer) -> None:
    """Rank 0, once the checkpoint is restored: what this attempt resumed from and what it found (each
    checkpoint verified, the partial saves left by an interrupted write, logged checkpoints now missing)."""
    from lit_parallel.checkpoint.load import PARTIAL_PREFIX, verify_checkpoint

    folder = run_dir / "ckpt"
    found = {}
    for path in sorted(folder.glob("*.ckpt")):
        try:
            verify_checkpoint(path)
            found[path.name] = "complete"
        except Exception as err:  # noqa: BLE001 (any refusal counts)
            found[path.name] = f"{type(err).__name__}: {err}"
    record = {
        "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "resumed": (run_dir / "resumed").exists(),
        "ckpt_path": str(trainer.ckpt_path) if trainer.ckpt_path else None,
        "step": trainer.global_step,
        "checkpoints": found,
        "partials": sorted(p.name for p in folder.glob(f"{PARTIAL_PREFIX}*")),
        "lost": sorted(n for n in _logged(run_dir) if found.get(n) != "complete"),
    }
    with open(run_dir / "attempts.log", "a") as f:
        f.write(json.dumps(record) + "\n")


def _progress_callback(run_dir: Path, fault: str, fault_step: int, fault_rank: int):
    from lightning.pytorch.callbacks import Callback

    class Progress(Callback):
        """Logs each finished step, what each attempt found at its start and the checkpoints saved so far, and
        injects the disk-full fault on its rank."""

        def on_train_start(self, trainer, pl_module):
            if trainer.global_rank == 0:
                _log_attempt_start(run_dir, trainer)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            step, rank = trainer.global_step, trainer.global_rank
            with open(run_dir / f"progress.{rank}", "a") as f:
                f.write(json.dumps({"step": step, "pid": os.getpid(), "t": time.time()}) + "\n")
            if rank == 0:
                _log_saved(run_dir, trainer, step)
            if fault == "disk_full" and step == fault_step and rank == fault_rank and _first_attempt(run_dir):
                _fill(run_dir / "ckpt" / "ballast")

    return Progress()


def _first_attempt(run_dir: Path) -> bool:
    return not (run_dir / "resumed").exists() and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def _fill(path: Path) -> None:
    with contextlib.suppress(OSError), open(path, "wb") as f:
        block = b"\0" * 2**16
        while True:
            f.write(block)
            f.flush()


def _pause_background_write(run_dir: Path, name: str) -> None:
    """async_kill9: the background write of checkpoint ``name`` pauses :data:`WRITE_PAUSE_S` in its middle, with
    its partial save on disk and nothing committed, after leaving a marker for the driver
    (``write_started.<rank>``), so that the kill lands while the write is in progress. Where it pauses: a
    sharded checkpoint in DCP's ``save`` (rank 0 has written ``meta.pt`` into the partial folder, no rank its
    shards); a single file (``ddp_tuned``, rank 0) in the commit, the partial file written, not yet renamed.
    Fault injection: the write each save hands to the writer thread arms the pause for itself alone."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from lit_parallel.checkpoint import write as write_module
    from lit_parallel.reliability.async_checkpoints import AsyncCheckpoints

    armed = {"write": False}

    def pause() -> None:
        if armed["write"] and threading.current_thread().name == WRITER_THREAD:
            armed["write"] = False
            (run_dir / f"write_started.{dist.get_rank()}").touch()
            time.sleep(WRITE_PAUSE_S)

    def paused(function):
        def call(*args, **kwargs):
            pause()
            return function(*args, **kwargs)

        return call

    submit = AsyncCheckpoints.submit

    def armed_submit(self, write, destination):
        if Path(str(destination)).name == name:
            unarmed = write

            def write():
                armed["write"] = True
                try:
                    unarmed()
                finally:
                    armed["write"] = False

        submit(self, write, destination)

    AsyncCheckpoints.submit = armed_submit
    dcp.save = paused(dcp.save)
    write_module.commit = paused(write_module.commit)


def worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader

    from lit_parallel.parallel import full_state_dict
    from tests.scenarios.expert_parallel import _full_params
    from tests.scenarios.fsdp import LitModel, lm_dataset
    from tests.scenarios.recovery import PipelinedLlama
    from tests.scenarios.reliability import make_strategy

    run_dir = Path(args.run_dir)

    def stall_if_due(module) -> None:
        trainer = module.trainer
        if args.fault == "stall" and trainer.global_step == args.fault_step:
            if trainer.global_rank == args.fault_rank and _first_attempt(run_dir):
                time.sleep(3600)

    class ChaosModel(LitModel):
        def training_step(self, batch, batch_idx):
            stall_if_due(self)
            return super().training_step(batch, batch_idx)

    class ChaosPipelinedLlama(PipelinedLlama):
        # pp_dp runs the strategy's training_step (the schedule), not the module's: the stall goes in the
        # hook just before it, inside the step the watchdog times
        def on_train_batch_start(self, batch, batch_idx):
            stall_if_due(self)

    if args.fault == "async_kill9" and _first_attempt(run_dir):
        _pause_background_write(run_dir, f"step={args.fault_step}.ckpt")
    strategy = make_strategy(
        args.strategy, stall_timeout=args.stall_timeout, async_checkpoint=args.async_checkpoint == "on"
    )
    torch.manual_seed(0)
    checkpoint = ModelCheckpoint(
        dirpath=run_dir / "ckpt", every_n_train_steps=2, save_last=True, save_top_k=-1, filename="{step}"
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[checkpoint, _progress_callback(run_dir, args.fault, args.fault_step, args.fault_rank)],
    )
    model = ChaosPipelinedLlama() if args.strategy == "pp_dp" else ChaosModel(name="llama")
    _ALIVE.extend([trainer, model])
    last = run_dir / "ckpt" / "last.ckpt"
    trainer.fit(model, DataLoader(lm_dataset(), batch_size=2), ckpt_path="last" if last.exists() else None)
    # collectives: every rank calls them. Under pp_dp each rank holds only its stages' layers
    params = _full_params(strategy, model.model) if args.strategy == "pp_dp" else full_state_dict(model.model)
    if trainer.global_rank == 0:
        _log_saved(run_dir, trainer, args.steps + 1)  # fit returned: every background write committed
        torch.save({k: v.detach().clone() for k, v in params.items()}, run_dir / "final.pt")


# --- the driver -------------------------------------------------------------------------------------------


def _command(launcher: str, strategy: str, port: int, run_dir: Path, fault: str, spec: dict, restarts: int):
    me = str(Path(__file__).resolve())
    worker_args = ["--worker", "--strategy", strategy, "--run-dir", str(run_dir), "--fault", fault]
    worker_args += ["--fault-step", str(spec["step"]), "--fault-rank", str(spec["rank"])]
    worker_args += ["--steps", str(spec["steps"]), "--stall-timeout", str(spec["stall_timeout"])]
    worker_args += ["--async-checkpoint", "on" if spec["async"] else "off"]
    if launcher == "torchrun":
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=2",
            f"--master-port={port}",
            "--master-addr=127.0.0.1",
            f"--max-restarts={restarts}",
            "--monitor-interval=0.1",
            me,
            *worker_args,
        ]
    return [sys.executable, me, *worker_args]


def _steps(run_dir: Path) -> dict[int, dict]:
    """Each rank's last logged step (and pid)."""
    out = {}
    for path in run_dir.glob("progress.*"):
        lines = path.read_text().splitlines()
        if lines:
            out[int(path.suffix[1:])] = json.loads(lines[-1])
    return out


def _processes_of(run_dir: Path) -> list[int]:
    """Pids of live processes whose command line names this run's folder."""
    token = str(run_dir).encode()
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if token in (proc / "cmdline").read_bytes():
                stat = (proc / "stat").read_text()
                if stat.rsplit(")", 1)[1].split()[0] != "Z":
                    pids.append(int(proc.name))
    return pids


def _attempt(cmd: list[str], env: dict, run_dir: Path, fault: str | None, spec: dict, timeout: float) -> dict:
    """Run one launch, inject ``fault`` when the ranks reach the fault step; the outcome."""
    start = time.monotonic()
    log = open(run_dir / "output.log", "a")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    injected_at = None
    while proc.poll() is None and time.monotonic() - start < timeout:
        time.sleep(0.05)
        if fault in ("kill9", "sigterm", "async_kill9") and injected_at is None:
            steps = _steps(run_dir)
            if fault == "async_kill9":
                # the fault step's background write has begun (and pauses): kill the rank now
                due = (run_dir / f"write_started.{spec['writer']}").exists() and spec["rank"] in steps
            else:
                due = spec["rank"] in steps and steps[spec["rank"]]["step"] >= spec["step"]
            if due:
                if fault in KILLS:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(steps[spec["rank"]]["pid"], signal.SIGKILL)
                else:
                    proc.send_signal(signal.SIGTERM)
                injected_at = time.monotonic()
    timed_out = proc.poll() is None
    if timed_out:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    log.close()
    end = time.monotonic()
    time.sleep(5)
    leftovers = _processes_of(run_dir)
    for pid in leftovers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return {
        "code": proc.returncode,
        "timed_out": timed_out,
        "seconds": end - start,
        "exit_after_fault_s": None if injected_at is None else end - injected_at,
        "leftovers": len(leftovers),
    }


def _attempt_records(run_dir: Path) -> list[dict]:
    """What each attempt found when it started (``_log_attempt_start``), in order."""
    path = run_dir / "attempts.log"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _check_checkpoints(run_dir: Path) -> tuple[int, int, list[str]]:
    """(corrupt, lost, problems): the run's checkpoint folder at its end, and as each attempt found it when it
    started (before the attempt saved anything: a resume rewrites the checkpoints after the one it loads)."""
    from lit_parallel.checkpoint.load import verify_checkpoint

    folder = run_dir / "ckpt"
    problems = []
    corrupt = lost = 0
    for n, record in enumerate(_attempt_records(run_dir)):
        for name, state in record["checkpoints"].items():
            if state != "complete":
                corrupt += 1
                problems.append(f"attempt {n} found {name} refused: {state}")
        for name in record["lost"]:
            lost += 1
            problems.append(f"attempt {n} found {name} (logged as saved) gone or refused")
    for path in sorted(folder.glob("*.ckpt")):
        try:
            verify_checkpoint(path)
        except Exception as err:  # noqa: BLE001 (any refusal counts)
            corrupt += 1
            problems.append(f"corrupt {path.name}: {type(err).__name__}: {err}")
    for name in sorted(_logged(run_dir)):
        if not (folder / name).exists():
            lost += 1
            problems.append(f"lost {name} (logged as saved)")
    return corrupt, lost, problems


def _step_of(name: str) -> int | None:
    """N for ``step=N.ckpt``."""
    if name.startswith("step=") and name.endswith(".ckpt"):
        return int(name[len("step=") : -len(".ckpt")])
    return None


def _judge_resume(strategy: str, spec: dict, run_dir: Path) -> tuple[bool, str]:
    """async_kill9: the attempt after the kill (torchrun's restart or the resume) found the interrupted
    checkpoint absent under its name and resumed from the newest checkpoint committed before it."""
    records = _attempt_records(run_dir)
    if len(records) < 2:
        return False, f"{len(records)} attempt(s) started: none resumed after the kill"
    found = records[1]
    interrupted = f"step={spec['step']}.ckpt"
    # ddp_tuned's file is written by rank 0 alone: with rank 1 killed, rank 0 may finish and commit it (and
    # then fail in the collective of the next save, last.ckpt's: last.ckpt stays at the save before)
    killed_the_writer = strategy != "ddp_tuned" or spec["rank"] == 0
    if killed_the_writer and interrupted in found["checkpoints"]:
        return False, f"{interrupted}, whose write was killed, appeared under its name"
    # rank 0 removes the partial save of a write that failed on another rank: a killed rank 0 leaves it
    if spec["rank"] == 0 and not found["partials"]:
        return False, f"no partial save left: the kill of rank 0 did not interrupt the write of {interrupted}"
    committed = [
        _step_of(name)
        for name, state in found["checkpoints"].items()
        if state == "complete" and name != interrupted
    ]
    newest = max((step for step in committed if step is not None), default=0)
    if found["step"] != newest:
        return False, f"resumed at step {found['step']}, but the newest committed checkpoint is step {newest}"
    state = "committed by rank 0" if interrupted in found["checkpoints"] else "not committed"
    return True, (
        f"resumed at step {found['step']} (the newest committed before it); {interrupted} {state};"
        f" {len(found['partials'])} partial save(s) left"
    )


def _mount_tmpfs(folder: Path) -> bool:
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    cmd = ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs", str(folder)]
    return subprocess.run(cmd, capture_output=True).returncode == 0


def _unmount(folder: Path) -> None:
    subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def _same_params(a: Path, b: Path) -> tuple[bool, str]:
    import torch

    if not a.exists():
        return False, "no final parameters were written"
    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    if x.keys() != y.keys():
        return False, f"parameter names differ: {sorted(set(x) ^ set(y))[:4]}"
    diff = [k for k in x if not torch.equal(x[k], y[k])]
    return (
        not diff,
        f"{len(diff)} of {len(x)} tensors differ (first: {diff[:2]})" if diff else "bitwise equal",
    )


def _judge_fault(fault: str, launcher: str, outcome: dict, output: str) -> tuple[bool, str]:
    """Did the faulted attempt end the way the fault requires?"""
    if outcome["timed_out"]:
        return False, "the faulted attempt hung until the chaos timeout"
    if fault in KILLS and outcome["exit_after_fault_s"] is None:
        return False, f"the rank was never killed (exit {outcome['code']})"
    if fault in KILLS and launcher == "torchrun":
        return outcome["code"] == 0, f"torchrun's restart ended with {outcome['code']}"
    if outcome["code"] == 0:
        return False, "the faulted attempt exited 0"
    if fault == "sigterm":
        # Lightning's launcher: the launching process exits 143. torchrun: its agent exits 1 (its own
        # SignalException, not ours to change) and every worker reports its 143
        workers = output.count("received SIGTERM: exiting with status 143")
        code_ok = (
            outcome["code"] in (143, -15)
            if launcher == "lightning"
            else outcome["code"] != 0 and workers >= 2
        )
        ok = code_ok and (outcome["exit_after_fault_s"] or 0) < 15
        return ok, (
            f"exit {outcome['code']} {outcome['exit_after_fault_s'] or 0:.1f}s after SIGTERM,"
            f" {workers} rank(s) exited 143"
        )
    named = any(text in output for text in EXPECTED_TEXT[fault])
    return named, "the error names the fault" if named else f"the fault is not named (exit {outcome['code']})"


def one_run(i: int, rng: random.Random, args: argparse.Namespace, refs: dict[str, Path], root: Path) -> dict:
    from tests.harness import free_port

    strategy, launcher = rng.choice(args.strategies), rng.choice(args.launchers)
    faults = [f for f in args.faults if f != "disk_full" or os.geteuid() == 0]
    fault = rng.choice(faults)
    # the stall watchdog leaves a training run's first two steps (compilation, DDP's wrapping) to the
    # collective timeout (docs/reference/reliability.md): a stall is injected from step 2 on
    earliest = 2 if fault == "stall" else 1
    # a fault at the last step could land after the run ended
    step = rng.randint(earliest, args.steps - 2)
    if fault == "async_kill9":  # a step that saves (every 2 steps)
        step = 2 * rng.randint(1, (args.steps - 2) // 2)
    rank = rng.randint(0, 1)
    # async_kill9 kills a rank during a background write: the checkpoints must be asynchronous
    background = rng.random() < 0.5 or fault == "async_kill9"
    spec = {
        "step": step,
        "rank": rank,
        "steps": args.steps,
        "stall_timeout": args.stall_timeout,
        "async": background,
        # whose marker says the write began: ddp_tuned's single file is written by rank 0 alone
        "writer": 0 if strategy == "ddp_tuned" else rank,
    }
    run_dir = root / f"run{i:03d}"
    run_dir.mkdir(parents=True)
    mounted = fault == "disk_full" and _mount_tmpfs(run_dir / "ckpt")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), MASTER_ADDR="127.0.0.1")
    env["MASTER_PORT"] = str(free_port())
    restarts = 1 if fault in KILLS else 0
    cmd = _command(launcher, strategy, int(env["MASTER_PORT"]), run_dir, fault, spec, restarts)
    try:
        first = _attempt(cmd, env, run_dir, fault, spec, args.timeout)
        output = (run_dir / "output.log").read_text(errors="replace")
        fault_ok, fault_detail = _judge_fault(fault, launcher, first, output)
        attempts = [first]
        if first["code"] != 0:
            (run_dir / "resumed").touch()
            with contextlib.suppress(FileNotFoundError):
                (run_dir / "ckpt" / "ballast").unlink()
            env["MASTER_PORT"] = str(free_port())
            cmd = _command(launcher, strategy, int(env["MASTER_PORT"]), run_dir, "none", spec, 0)
            attempts.append(_attempt(cmd, env, run_dir, None, spec, args.timeout))
        if fault == "async_kill9":
            resume_ok, resume_detail = _judge_resume(strategy, spec, run_dir)
            fault_ok, fault_detail = fault_ok and resume_ok, f"{fault_detail}; {resume_detail}"
        corrupt, lost, problems = _check_checkpoints(run_dir)
        same, same_detail = _same_params(run_dir / "final.pt", refs[strategy])
    finally:
        if mounted:
            _unmount(run_dir / "ckpt")
    leftovers = sum(a["leftovers"] for a in attempts)
    ok = fault_ok and same and attempts[-1]["code"] == 0 and not (leftovers or corrupt or lost)
    return {
        "run": i,
        "strategy": strategy,
        "launcher": launcher,
        "fault": fault,
        "step": spec["step"],
        "rank": spec["rank"],
        "async": spec["async"],
        "ok": ok,
        "fault_detail": fault_detail,
        "params": same_detail,
        "attempts": attempts,
        "leftovers": leftovers,
        "corrupt": corrupt,
        "lost": lost,
        "problems": problems,
    }


def rejudge(root: Path) -> int:
    """Judge the faulted attempts of a finished chaos run again with :func:`_judge_fault` (from each run's
    recorded outcome and output); the rest of each verdict (parameters, leftovers, checkpoints) is kept."""
    record = json.loads((root / "summary.json").read_text())
    bad = 0
    for run in record["runs"]:
        output = (root / f"run{run['run']:03d}" / "output.log").read_text(errors="replace")
        fault_ok, detail = _judge_fault(run["fault"], run["launcher"], run["attempts"][0], output)
        if run["fault"] == "async_kill9":
            spec = {"step": run["step"], "rank": run["rank"]}
            resume_ok, resume_detail = _judge_resume(run["strategy"], spec, root / f"run{run['run']:03d}")
            fault_ok, detail = fault_ok and resume_ok, f"{detail}; {resume_detail}"
        rest_ok = run["params"] == "bitwise equal" and run["attempts"][-1]["code"] == 0
        rest_ok = rest_ok and not (run["leftovers"] or run["corrupt"] or run["lost"])
        ok = fault_ok and rest_ok
        bad += not ok
        if ok != run["ok"]:
            print(
                f"run {run['run']:3d} {run['strategy']} {run['launcher']} {run['fault']}: now {ok}: {detail}"
            )
    print(f"{len(record['runs']) - bad} of {len(record['runs'])} runs good after judging again")
    return bad


def _reference(strategy: str, args: argparse.Namespace, root: Path) -> Path:
    from tests.harness import free_port

    run_dir = root / f"reference-{strategy}"
    run_dir.mkdir(parents=True)
    # synchronous saves: a save in the background must not change training
    spec = {"step": -1, "rank": 0, "steps": args.steps, "stall_timeout": args.stall_timeout, "async": False}
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), MASTER_ADDR="127.0.0.1")
    env["MASTER_PORT"] = str(free_port())
    cmd = _command("torchrun", strategy, int(env["MASTER_PORT"]), run_dir, "none", spec, 0)
    outcome = _attempt(cmd, env, run_dir, None, spec, args.timeout)
    if outcome["code"] != 0:
        tail = (run_dir / "output.log").read_text(errors="replace")[-3000:]
        raise SystemExit(f"the uninterrupted {strategy} run failed ({outcome}):\n{tail}")
    return run_dir / "final.pt"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per run")
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    parser.add_argument("--launchers", nargs="+", default=list(LAUNCHERS), choices=LAUNCHERS)
    parser.add_argument("--faults", nargs="+", default=list(FAULTS), choices=FAULTS)
    parser.add_argument("--stall-timeout", type=float, default=5.0, help="the strategies' stall_timeout (s)")
    parser.add_argument("--timeout", type=float, default=240.0, help="per attempt (s)")
    parser.add_argument("--out", default="chaos-results", help="folder for the runs and summary.json")
    parser.add_argument("--rejudge", help="a finished run's folder: judge its faulted attempts again, no run")
    for name in ("--run-dir", "--fault", "--fault-step", "--fault-rank", "--strategy", "--async-checkpoint"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser


def main() -> int:
    args = _parser().parse_args()
    if args.worker:
        args.fault_step, args.fault_rank = int(args.fault_step), int(args.fault_rank)
        worker(args)
        return 0
    if args.rejudge:
        return rejudge(Path(args.rejudge))
    root = Path(args.out).resolve() / time.strftime("%Y%m%d-%H%M%S")
    started = time.monotonic()
    refs = {s: _reference(s, args, root) for s in args.strategies}
    rng = random.Random(args.seed)
    runs = []
    for i in range(args.runs):
        run = one_run(i, rng, args, refs, root)
        runs.append(run)
        verdict = "ok" if run["ok"] else "BAD"
        print(
            f"run {i:3d} {run['strategy']:11s} {run['launcher']:9s} {run['fault']:11s} step {run['step']}"
            f" rank {run['rank']} async {'on ' if run['async'] else 'off'}: {verdict}; {run['fault_detail']};"
            f" params {run['params']}" + (f"; {run['problems']}" if run["problems"] else ""),
            flush=True,
        )
    totals = {k: sum(r[k] for r in runs) for k in ("leftovers", "corrupt", "lost")}
    bad = sum(not r["ok"] for r in runs)
    counts: dict[str, dict[str, list[int]]] = {}  # what -> value -> [good, bad]
    for r in runs:
        for what in ("fault", "strategy", "launcher", "async"):
            counts.setdefault(what, {}).setdefault(str(r[what]), [0, 0])[0 if r["ok"] else 1] += 1
    minutes = (time.monotonic() - started) / 60
    summary = {"runs": len(runs), "bad": bad, **totals, "good_bad": counts, "seed": args.seed}
    summary["minutes"] = round(minutes, 1)
    (root / "summary.json").write_text(json.dumps({"summary": summary, "runs": runs}, indent=1, default=str))
    print(f"{len(runs) - bad} of {len(runs)} runs good in {minutes:.1f} minutes; {totals}")
    for what, by_value in counts.items():
        print(f"  per {what} [good, bad]: {by_value}")
    return bad


if __name__ == "__main__":
    sys.exit(main())
