"""Chaos runs, checked by hand: one random fault per run, at a random step, and nothing may be lost.

Not collected by pytest (its name does not start with ``test_``); it takes minutes. Run from the repository
root (the disk-full fault mounts a small tmpfs, so it needs root; without root that fault is left out)::

    OMP_NUM_THREADS=1 python tests/chaos.py --runs 40 --seed 0

Each run trains a tiny Llama for ``--steps`` optimizer steps on 2 gloo ranks under one strategy and one
launcher (torchrun, or Lightning's own launcher: ``python this_file.py --worker`` with ``devices=2``), with
``ModelCheckpoint(every_n_train_steps=2, save_last=True, save_top_k=-1)``, and injects one fault:

- ``kill9``: ``kill -9`` of one rank. Under torchrun (``--max-restarts=1``) the restarted attempt resumes from
  ``last.ckpt`` by itself; under Lightning's launcher the run must fail naming the dead rank.
- ``sigterm``: SIGTERM to the launching process. Every rank must be gone within 15 s: under Lightning's
  launcher with exit status 143; under torchrun every rank exits 143 and torchrun itself exits 1 (its own
  ``SignalException``).
- ``disk_full``: the checkpoint folder is a small tmpfs; one rank fills it at the fault step, so the next save
  meets a real ``ENOSPC``. The error must say that the disk is full.
- ``stall``: one rank sleeps in ``training_step`` (from step 2 on: the first two steps are left to the
  collective timeout). The stall watchdog (``stall_timeout``) must name the rank and where it is, and the
  job must end non-zero.

A run that failed is then resumed once, as a user (or SLURM's requeue) would: the same command without a
fault, ``fit(ckpt_path="last")``. Every run must end completed, with final parameters bitwise equal to an
uninterrupted run of the same strategy. Counted over all runs, each must be 0: leftover processes (any process
of the run alive 5 s after its launcher ended), corrupt checkpoints (any checkpoint in the folder that
:func:`lit_parallel.checkpoint.load.verify_checkpoint` refuses) and lost checkpoints (a checkpoint the run logged as
saved that is gone or refused). The summary prints the counts; the exit code is the number of bad runs.
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
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

STRATEGIES = ("ddp_tuned", "fsdp_blocks", "hsdp", "tp_dp")
LAUNCHERS = ("torchrun", "lightning")
FAULTS = ("kill9", "sigterm", "disk_full", "stall")
# what the output of a faulted attempt must contain: the fault, named
EXPECTED_TEXT = {
    "kill9": (
        "exited with code -9",
        "Signal 9",
        "SIGKILL",
        "signal 9",
        "launching process (local rank 0, pid",
    ),
    "sigterm": (),  # judged by the exit status (128 + 15) and the time to exit
    "disk_full": ("disk is full",),
    "stall": ("stall",),
}
TMPFS_BYTES = 24 * 2**20
_ALIVE: list = []


# --- the training program (each rank) -------------------------------------------------------------------


def _progress_callback(run_dir: Path, fault: str, fault_step: int, fault_rank: int):
    from lightning.pytorch.callbacks import Callback

    class Progress(Callback):
        """Logs each finished step (after ModelCheckpoint's save) and injects the run's fault on its rank."""

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            step, rank = trainer.global_step, trainer.global_rank
            with open(run_dir / f"progress.{rank}", "a") as f:
                f.write(json.dumps({"step": step, "pid": os.getpid(), "t": time.time()}) + "\n")
            if rank == 0 and step % 2 == 0:
                with open(run_dir / "saved.log", "a") as f:
                    f.write(f"step={step}\n")
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


def worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader

    import lit_parallel as lp
    from lit_parallel.parallel import full_state_dict
    from tests.scenarios.fsdp import LitModel, lm_dataset

    run_dir = Path(args.run_dir)
    stall_step = args.fault_step if args.fault == "stall" else -1

    class ChaosModel(LitModel):
        def training_step(self, batch, batch_idx):
            trainer = self.trainer
            if trainer.global_step == stall_step and trainer.global_rank == args.fault_rank:
                if _first_attempt(run_dir):
                    time.sleep(3600)
            return super().training_step(batch, batch_idx)

    classes = {
        "ddp_tuned": lp.TunedDDPStrategy,
        "fsdp_blocks": lp.TransformerFSDPStrategy,
        "hsdp": lp.HybridShardStrategy,
        "tp_dp": lp.TensorParallelStrategy,
    }
    strategy = classes[args.strategy](stall_timeout=args.stall_timeout)
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
    model = ChaosModel(name="llama")
    _ALIVE.extend([trainer, model])
    last = run_dir / "ckpt" / "last.ckpt"
    trainer.fit(model, DataLoader(lm_dataset(), batch_size=2), ckpt_path="last" if last.exists() else None)
    params = full_state_dict(model.model)  # a collective under the sharded strategies: every rank calls it
    if trainer.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in params.items()}, run_dir / "final.pt")


# --- the driver -------------------------------------------------------------------------------------------


def _command(launcher: str, strategy: str, port: int, run_dir: Path, fault: str, spec: dict, restarts: int):
    me = str(Path(__file__).resolve())
    worker_args = ["--worker", "--strategy", strategy, "--run-dir", str(run_dir), "--fault", fault]
    worker_args += ["--fault-step", str(spec["step"]), "--fault-rank", str(spec["rank"])]
    worker_args += ["--steps", str(spec["steps"]), "--stall-timeout", str(spec["stall_timeout"])]
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
        if fault in ("kill9", "sigterm") and injected_at is None:
            steps = _steps(run_dir)
            if spec["rank"] in steps and steps[spec["rank"]]["step"] >= spec["step"]:
                if fault == "kill9":
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


def _check_checkpoints(run_dir: Path) -> tuple[int, int, list[str]]:
    """(corrupt, lost, problems) for the run's checkpoint folder."""
    from lit_parallel.checkpoint.load import verify_checkpoint

    folder = run_dir / "ckpt"
    problems = []
    corrupt = 0
    for path in sorted(folder.glob("*.ckpt")):
        try:
            verify_checkpoint(path)
        except Exception as err:  # noqa: BLE001 (any refusal counts)
            corrupt += 1
            problems.append(f"corrupt {path.name}: {type(err).__name__}: {err}")
    logged = set()
    if (run_dir / "saved.log").exists():
        logged = set((run_dir / "saved.log").read_text().split())
    lost = 0
    for name in sorted(logged):
        if not (folder / f"{name}.ckpt").exists():
            lost += 1
            problems.append(f"lost {name}.ckpt (logged as saved)")
    return corrupt, lost, problems


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
    if fault == "kill9" and launcher == "torchrun":
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
    first = 2 if fault == "stall" else 1
    spec = {
        "step": rng.randint(first, args.steps - 2),  # a fault at the last step could land after the run ended
        "rank": rng.randint(0, 1),
        "steps": args.steps,
        "stall_timeout": args.stall_timeout,
    }
    run_dir = root / f"run{i:03d}"
    run_dir.mkdir(parents=True)
    mounted = fault == "disk_full" and _mount_tmpfs(run_dir / "ckpt")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), MASTER_ADDR="127.0.0.1")
    env["MASTER_PORT"] = str(free_port())
    restarts = 1 if fault == "kill9" else 0
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
    spec = {"step": -1, "rank": 0, "steps": args.steps, "stall_timeout": args.stall_timeout}
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
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    parser.add_argument("--launchers", nargs="+", default=list(LAUNCHERS), choices=LAUNCHERS)
    parser.add_argument("--faults", nargs="+", default=list(FAULTS), choices=FAULTS)
    parser.add_argument("--stall-timeout", type=float, default=5.0, help="the strategies' stall_timeout (s)")
    parser.add_argument("--timeout", type=float, default=240.0, help="per attempt (s)")
    parser.add_argument("--out", default="chaos-results", help="folder for the runs and summary.json")
    parser.add_argument("--rejudge", help="a finished run's folder: judge its faulted attempts again, no run")
    for name in ("--run-dir", "--fault", "--fault-step", "--fault-rank", "--strategy"):
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
    refs = {s: _reference(s, args, root) for s in args.strategies}
    rng = random.Random(args.seed)
    runs = []
    for i in range(args.runs):
        run = one_run(i, rng, args, refs, root)
        runs.append(run)
        verdict = "ok" if run["ok"] else "BAD"
        print(
            f"run {i:3d} {run['strategy']:11s} {run['launcher']:9s} {run['fault']:9s} step {run['step']}"
            f" rank {run['rank']}: {verdict}; {run['fault_detail']}; params {run['params']}"
            + (f"; {run['problems']}" if run["problems"] else ""),
            flush=True,
        )
    totals = {k: sum(r[k] for r in runs) for k in ("leftovers", "corrupt", "lost")}
    bad = sum(not r["ok"] for r in runs)
    by_fault: dict[str, list[int]] = {}
    for r in runs:
        by_fault.setdefault(r["fault"], [0, 0])[0 if r["ok"] else 1] += 1
    summary = {"runs": len(runs), "bad": bad, **totals, "by_fault_ok_bad": by_fault, "seed": args.seed}
    (root / "summary.json").write_text(json.dumps({"summary": summary, "runs": runs}, indent=1, default=str))
    print(f"{len(runs) - bad} of {len(runs)} runs good; {totals}; per fault [good, bad]: {by_fault}")
    return bad


if __name__ == "__main__":
    sys.exit(main())
