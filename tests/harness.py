"""Launch real ranks on gloo, run scenarios in them, and collect every rank's result.

A launch costs seconds of start-up, so a test names several scenarios and they run one after the
other inside the same processes. Each scenario is a function ``fn(ctx) -> dict`` in an importable
module (``"tests.scenarios.ddp:parity"``); its dict (tensors, numbers, strings, lists) comes back per
rank. When any rank raises, torchrun stops the others, and :class:`DistributedFailure` shows every
rank's traceback plus the tail of the launcher's output.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "_worker.py"


class DistributedFailure(AssertionError):
    """A multi-process run failed or timed out; the message holds every rank's traceback."""


@dataclass
class LaunchResult:
    """Per-rank results of one launch: ``results[rank][scenario_name]`` is the scenario's dict."""

    results: dict[int, dict[str, Any]]
    output: str
    wall_s: float
    returncode: int
    errors: dict[int, str] = field(default_factory=dict)
    error_times: dict[int, float] = field(default_factory=dict)
    timed_out: bool = False
    expected_ranks: int = 0
    launcher: str = "torchrun"

    @property
    def failed(self) -> bool:
        return self.timed_out or self.returncode != 0 or len(self.results) != self.expected_ranks

    def describe_failure(self) -> str:
        """Every rank's traceback, the first failure first, then the launcher's output tail."""
        how = f"timed out after {self.wall_s:.0f}s" if self.timed_out else f"exited with {self.returncode}"
        parts = [
            f"{self.launcher} launch of {self.expected_ranks} ranks {how} ({self.wall_s:.1f}s);"
            f" ranks with results: {sorted(self.results)}"
            + (f"; first failing rank: {self.first_failed_rank}" if self.errors else "")
        ]
        for rank in sorted(self.errors, key=self.error_times.get):
            parts.append(f"----- rank {rank} traceback -----\n{self.errors[rank]}")
        parts.append("----- launcher output (tail) -----\n" + self.output[-6000:])
        return "\n".join(parts)

    @property
    def first_failed_rank(self) -> int | None:
        """The rank that raised first (the cause; later errors are usually lost connections)."""
        return min(self.error_times, key=self.error_times.get) if self.error_times else None

    def scenario(self, name: str) -> list[dict[str, Any]]:
        """The named scenario's dicts, one per rank, in rank order."""
        return [self.results[r][name] for r in sorted(self.results)]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What a launcher or an in-process Trainer of an earlier test leaves in this process's environment (Lightning
# sets MASTER_PORT, NODE_RANK, LOCAL_RANK, WORLD_SIZE, PL_GLOBAL_SEED, ... in the process it runs in): a launch
# starts from none of it, as a fresh shell would, and gets what it needs from the harness and its launcher.
_INHERITED_DISTRIBUTED = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "NODE_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "PL_GLOBAL_SEED",
    "PL_SEED_WORKERS",
    "LIT_PARALLEL_LAUNCHER_PID",
)


def _base_env(extra: dict[str, str] | None) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _INHERITED_DISTRIBUTED and not k.startswith("TORCHELASTIC_")
    }
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("PYTHONUNBUFFERED", "1")
    # Lightning prints tips and progress bars to every rank's stdout; keep logs readable.
    env.setdefault("PL_DISABLE_FORK", "1")
    if extra:
        env.update(extra)
    return env


PORT_CLASH = ("Address already in use", "EADDRINUSE", "address already in use")


def launch(scenarios: list[str] | str, nprocs: int, tmp_path: Path, **kwargs: Any) -> LaunchResult:
    """Run ``scenarios`` on ``nprocs`` real ranks (per node) and return their results.

    See :func:`_launch_once` for the arguments. A free port is picked by binding and releasing it; if
    another process grabs it before the ranks bind it (several test runs on one machine), the launch
    is retried once on a new port. ``expect_failure=True`` returns a failing run's result instead of
    raising :class:`DistributedFailure`.
    """
    expect_failure = kwargs.pop("expect_failure", False)
    result = _launch_once(scenarios, nprocs, tmp_path, **kwargs)
    if result.failed and any(m in result.output for m in PORT_CLASH):
        result = _launch_once(scenarios, nprocs, tmp_path, **kwargs)
    if result.failed and not expect_failure:
        raise DistributedFailure(result.describe_failure())
    return result


def launch_failing(
    tmp_path_factory: Any, tag: str, scenarios: list[str] | str, nprocs: int = 2, **kwargs: Any
) -> tuple[LaunchResult, Path, float]:
    """A launch that fails on purpose (``expect_failure``): its scenarios write time stamps into a fresh folder
    given to them as ``args["dir"]`` (with ``kwargs["args"]``, if any). Returns the result, that folder and
    the moment the launch ended (``time.time()``), for the tests to measure how long ranks outlived a failure."""
    root = tmp_path_factory.mktemp(tag)
    data = root / "data"
    data.mkdir()
    args = {"dir": str(data), **kwargs.pop("args", {})}
    res = launch(scenarios, nprocs, root, args=args, expect_failure=True, **kwargs)
    # now, not the start plus the launch's wall time: a launch retried on a port clash has run twice
    return res, data, time.time()


def _launch_once(
    scenarios: list[str] | str,
    nprocs: int,
    tmp_path: Path,
    *,
    args: dict[str, Any] | None = None,
    launcher: str = "torchrun",
    timeout: float = 240.0,
    env: dict[str, str] | None = None,
    nnodes: int = 1,
    max_restarts: int = 0,
    worker_group: bool = True,
) -> LaunchResult:
    """One launch of ``scenarios`` on ``nprocs`` real ranks (per node).

    Args:
        scenarios: ``"module:function"`` targets, run in order in the same processes.
        launcher: ``"torchrun"`` (elastic agent, one process per rank; the harness initialises a gloo
            process group before the scenarios run) or ``"lightning"`` (one ``python`` process; the
            scenario builds a ``Trainer(devices=nprocs)`` and Lightning's launcher starts the others).
        nnodes: with torchrun, run that many agents on loopback as separate "nodes" (c10d rendezvous).
        max_restarts: torchrun's ``--max-restarts`` (restart every rank when one fails); the results are the
            last attempt's.
        worker_group: with torchrun, the harness creates the process group before the scenarios; ``False``
            leaves it to the strategies (as in a user's script).
    """
    if isinstance(scenarios, str):
        scenarios = [scenarios]
    outdir = Path(tmp_path) / f"launch-{time.monotonic_ns()}"
    outdir.mkdir(parents=True)
    spec = {
        "scenarios": scenarios,
        "args": args or {},
        "outdir": str(outdir),
        "nprocs": nprocs,
        "worker_group": worker_group,
    }
    spec_file = outdir / "spec.json"
    spec_file.write_text(json.dumps(spec))
    port = free_port()
    run_env = _base_env(env)
    commands: list[list[str]] = []
    if launcher == "torchrun":
        for node_rank in range(nnodes):
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nprocs}"]
            if nnodes == 1:
                cmd += [f"--master-port={port}", "--master-addr=127.0.0.1"]
            else:
                cmd += [
                    f"--nnodes={nnodes}",
                    f"--node-rank={node_rank}",
                    "--rdzv-backend=c10d",
                    f"--rdzv-endpoint=127.0.0.1:{port}",
                    f"--rdzv-id=lp{port}",
                ]
            cmd += [f"--max-restarts={max_restarts}", "--monitor-interval=0.1", str(WORKER), str(spec_file)]
            commands.append(cmd)
    elif launcher == "lightning":
        if nnodes != 1:
            raise ValueError("launcher='lightning' runs one node; use torchrun for nnodes > 1")
        run_env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        commands.append([sys.executable, str(WORKER), str(spec_file)])
    else:
        raise ValueError(f"launcher={launcher!r} is not one of 'torchrun', 'lightning'")

    start = time.monotonic()
    logs = [open(outdir / f"launcher{i}.log", "w+") for i in range(len(commands))]  # noqa: SIM115
    procs = [
        subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=run_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        for cmd, log in zip(commands, logs)
    ]
    timed_out = False
    deadline = start + timeout
    try:
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
        if launcher == "lightning" and not timed_out:
            # Lightning's launcher does not wait for its children: let them write their results.
            timed_out = not _wait_group_empty(procs[0].pid, deadline)
    finally:
        for p in procs:
            _kill_tree(p)
    wall = time.monotonic() - start
    output = ""
    for log in logs:
        log.seek(0)
        output += log.read()
        log.close()
    returncode = next((p.returncode for p in procs if p.returncode), 0)

    results: dict[int, dict[str, Any]] = {}
    errors: dict[int, str] = {}
    for f in sorted(outdir.glob("rank*.pt")):
        results[int(f.stem[4:])] = torch.load(f, weights_only=True)
    error_times: dict[int, float] = {}
    for f in sorted(outdir.glob("rank*.err")):
        stamp, _, text = f.read_text().partition("\n")
        errors[int(f.stem[4:])] = text
        error_times[int(f.stem[4:])] = float(stamp)
    result = LaunchResult(
        results=results,
        output=output,
        wall_s=wall,
        returncode=returncode,
        errors=errors,
        error_times=error_times,
        timed_out=timed_out,
        expected_ranks=nprocs * nnodes,
        launcher=launcher,
    )
    return result


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_group_empty(pgid: int, deadline: float) -> bool:
    while _group_alive(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _kill_tree(p: subprocess.Popen) -> None:
    """Stop every process of the launch's session (ranks started by the launcher included)."""
    if not _group_alive(p.pid):
        if p.poll() is None:
            p.wait()
        return
    try:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(timeout=5)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def run_script(script: Path, cwd: Path, *, env: dict[str, str] | None = None, timeout: float = 240.0) -> str:
    """Run ``python script`` in ``cwd`` as a user would: a script whose Trainer has ``devices=N`` starts the
    other ranks through Lightning's own launcher (each runs the script again). ``env`` adds variables (a
    ``PYTHONPATH`` given here goes before the repository's). Returns the output; a failure or a timeout raises
    :class:`DistributedFailure` with the output's tail."""
    extra = dict(env or {})
    run_env = _base_env(None)
    if "PYTHONPATH" in extra:
        run_env["PYTHONPATH"] = os.pathsep.join([extra.pop("PYTHONPATH"), run_env["PYTHONPATH"]])
    run_env.update(extra)
    run_env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    start = time.monotonic()
    with open(Path(cwd) / f"{Path(script).stem}.log", "w+") as log:
        proc = subprocess.Popen(
            [sys.executable, str(script)],
            cwd=cwd,
            env=run_env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        timed_out = False
        try:
            proc.wait(timeout=timeout)
            # the launching rank may end before the ranks it started
            timed_out = not _wait_group_empty(proc.pid, start + timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_tree(proc)
        log.seek(0)
        output = log.read()
    if timed_out or proc.returncode != 0:
        how = f"timed out after {timeout:.0f}s" if timed_out else f"exited with {proc.returncode}"
        raise DistributedFailure(f"python {script} {how}\n----- output (tail) -----\n{output[-6000:]}")
    return output
