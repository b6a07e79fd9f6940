"""Rank entry point for tests/harness.py: runs the named scenarios and stores this rank's results.

Launched by torchrun (one process per rank, process group created here) or as a single ``python``
process whose scenario builds a ``Trainer(devices=N)`` (Lightning's launcher re-runs this file for the
other ranks with ``LOCAL_RANK`` set).
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    outdir = Path(spec["outdir"])
    import torch
    import torch.distributed as dist

    torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    if torchrun and spec.get("worker_group", True):
        dist.init_process_group(
            "gloo", timeout=timedelta(seconds=float(os.environ.get("LP_PG_TIMEOUT", 120)))
        )
    ctx = SimpleNamespace(
        args=spec["args"],
        outdir=outdir,
        nprocs=spec["nprocs"],
        torchrun=torchrun,
        rank=_rank(),
        world_size=int(os.environ.get("WORLD_SIZE", spec["nprocs"])),
    )
    results = {}
    try:
        for target in spec["scenarios"]:
            module_name, fn_name = target.split(":")
            fn = getattr(importlib.import_module(module_name), fn_name)
            results[fn_name] = fn(ctx) or {}
    except BaseException:
        # The first line orders the failures: the earliest is the cause, the rest are its echoes.
        (outdir / f"rank{_rank()}.err").write_text(f"{time.time():.6f}\n{traceback.format_exc()}")
        raise
    rank = _rank()
    torch.save(results, outdir / f"rank{rank}.pt")
    if torchrun and dist.is_initialized():
        # drop the scenarios' DDP/FSDP objects before their process group goes: destroying it under live
        # wrappers occasionally aborts at exit ("terminate called without an active exception")
        results.clear()
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
