"""Clean shutdown, checked by hand: N successful runs in a row must all exit 0 on every rank.

Not collected by pytest (its name does not start with ``test_``); it takes minutes. Run from the repository root::

    OMP_NUM_THREADS=1 python tests/stress_shutdown.py --runs 20
    OMP_NUM_THREADS=1 python tests/stress_shutdown.py --runs 20 --strategies fsdp_blocks --launchers torchrun

Each run trains a tiny Llama for two steps on 2 gloo ranks, either under torchrun (every rank's exit code
comes from torchrun's agent) or under Lightning's own launcher (``python this_file.py --worker`` with
``devices=2``; rank 0 reports the children's exit codes, since lit_parallel's launcher waits for them). A
run counts as clean when the launcher and every rank exit 0 and nothing was printed about an abort. The
summary line lists failures per strategy and launcher; the exit code is the number of unclean runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

STRATEGIES = ("ddp_tuned", "fsdp_blocks", "hsdp", "tp_dp")
# Like a training script's module-level variables: the Trainer and the model live until the process exits.
_ALIVE: list = []
LAUNCHERS = ("torchrun", "lightning")
_ABORT_MARKERS = ("terminate called", "Aborted", "core dumped", "SIGABRT", "Segmentation fault", "SIGSEGV")


def worker(strategy: str, result: str | None) -> None:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    import lit_parallel  # noqa: F401  (registers the strategy names)
    from tests.scenarios.fsdp import LitModel, lm_dataset

    torch.manual_seed(0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    model = LitModel(name="llama")  # separate q/k/v projections: every strategy, tp_dp included, can split it
    _ALIVE.extend([trainer, model])
    trainer.fit(model, DataLoader(lm_dataset(), batch_size=2))
    if result and trainer.global_rank == 0:
        Path(result).write_text(json.dumps({"losses": model.losses}))


def one_run(strategy: str, launcher: str, port: int, timeout: float) -> tuple[bool, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), MASTER_ADDR="127.0.0.1")
    env["MASTER_PORT"] = str(port)
    me = str(Path(__file__).resolve())
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2"]
        cmd += [
            f"--master-port={port}",
            "--master-addr=127.0.0.1",
            "--max-restarts=0",
            "--monitor-interval=0.1",
        ]
        cmd += [me, "--worker", "--strategy", strategy]
    else:
        cmd = [sys.executable, me, "--worker", "--strategy", strategy]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        return False, f"timed out after {timeout:.0f}s: {str(err.output)[-2000:]}"
    output = proc.stdout + proc.stderr
    aborted = [m for m in _ABORT_MARKERS if m in output]
    ok = proc.returncode == 0 and not aborted
    detail = f"exit {proc.returncode} in {time.monotonic() - start:.1f}s"
    if not ok:
        detail += f"; markers {aborted}; output tail:\n{output[-3000:]}"
    return ok, detail


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="runs per strategy and launcher")
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    parser.add_argument("--launchers", nargs="+", default=list(LAUNCHERS), choices=LAUNCHERS)
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.strategy, args.result)
        return 0
    from tests.harness import free_port

    failures: dict[str, int] = {}
    for i in range(args.runs):
        for strategy in args.strategies:
            for launcher in args.launchers:
                ok, detail = one_run(strategy, launcher, free_port(), args.timeout)
                key = f"{strategy}/{launcher}"
                failures.setdefault(key, 0)
                failures[key] += not ok
                print(f"run {i + 1:2d} {key:24s} {'ok' if ok else 'FAILED'}: {detail}", flush=True)
    total = sum(failures.values())
    runs = args.runs * len(args.strategies) * len(args.launchers)
    print(f"{runs - total} of {runs} runs exited cleanly; unclean per strategy/launcher: {failures}")
    return total


if __name__ == "__main__":
    sys.exit(main())
