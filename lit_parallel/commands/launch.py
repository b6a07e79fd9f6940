"""Run a module's worker function on N local ranks with torchrun (used by `lit-parallel` commands).

The parent picks a free port, starts ``torch.distributed.run`` with ``python -m MODULE --worker``,
lets the ranks' output through, and returns what rank 0 wrote as JSON. A failing rank ends every
rank (torchrun's agent stops the others) and the parent raises with the exit code.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    module: str, nprocs: int, worker_args: list[str], *, timeout: float | None = None, partial: bool = False
) -> dict[str, Any]:
    """Start ``python -m module --worker --result FILE *worker_args`` on ``nprocs`` ranks; return rank 0's JSON.
    ``partial``: when the launch fails after rank 0 wrote a result, return it with ``launch_errors`` (the
    texts the ranks wrote to ``FILE.error.<rank>``) instead of raising."""
    if nprocs < 1:
        raise ValueError(f"--devices={nprocs} must be at least 1")
    with tempfile.TemporaryDirectory(prefix="lit-parallel-") as tmp:
        result = Path(tmp) / "result.json"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nprocs}",
            "--master-addr=127.0.0.1",
            f"--master-port={free_port()}",
            "--max-restarts=0",
            "--monitor-interval=0.1",
            "-m",
            module,
            "--worker",
            "--result",
            str(result),
            *worker_args,
        ]
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("PYTHONUNBUFFERED", "1")
        proc = subprocess.run(cmd, env=env, timeout=timeout, check=False)
        if proc.returncode != 0 and partial and result.exists():
            data = json.loads(result.read_text())
            data["launch_errors"] = [p.read_text() for p in sorted(Path(tmp).glob("result.json.error.*"))]
            return data
        if proc.returncode != 0:
            raise RuntimeError(
                f"{module} failed on {nprocs} ranks (exit code {proc.returncode}); see the output above"
            )
        return json.loads(result.read_text())


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments :func:`run_ranks` gives every rank, ``--worker`` and ``--result FILE`` (left out of
    ``--help``)."""
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)


def write_result(path: str | os.PathLike, payload: dict[str, Any]) -> None:
    """Rank 0 writes its result for :func:`run_ranks` (atomically: temp file, then rename)."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(payload, indent=2))
    tmp.replace(path)


def init_ranks(accelerator: str = "cpu") -> torch.device:
    """In a rank :func:`run_ranks` started: join the process group torchrun set up (NCCL for ``"gpu"``, gloo
    otherwise; one already joined is kept) and return this rank's device (``gpu``: made current before NCCL
    starts, :func:`lit_parallel.devices.init_process_group_on_device`)."""
    from lit_parallel.devices import init_process_group_on_device

    return init_process_group_on_device("nccl" if accelerator == "gpu" else "gloo")
