"""The docs' complete Python examples, run as written inside launched ranks (tests/test_doc_examples.py).

Every Python block of docs/ without a marker (tests/doc_blocks.py) is a whole program whose Trainer asks for
``accelerator="cpu", devices=N``. The ranks of one torchrun launch run them one after the other, each as
``__main__`` in a fresh working folder of its own (its logs, checkpoints and files land there); under
torchrun's environment Lightning takes the ranks' places from the launcher instead of starting processes.
The 2-rank examples run in their own launch, the 4-rank ones (``pp_dp``) in the shared 4-rank launch of
tests/conftest.py.
"""

from __future__ import annotations

import gc
import io
import os
import re
import runpy
import warnings
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tests.doc_blocks import PYTHON, Block, all_blocks

# examples whose Trainer asks for more than 2 devices; every other one runs on 2 ranks
RANKS = {"docs/reference/strategies/pp_dp.md": 4}


def complete_examples() -> dict[str, Block]:
    """The Python blocks of docs/ without a marker, by key: the page's path, ``path#2`` for a second one."""
    found: dict[str, Block] = {}
    for block in all_blocks():
        if block.language in PYTHON and block.marker is None and block.path.startswith("docs/"):
            key = block.path
            n = 1
            while key in found:
                n += 1
                key = f"{block.path}#{n}"
            found[key] = block
    return found


def examples_for(ranks: int) -> dict[str, Block]:
    return {key: block for key, block in complete_examples().items() if RANKS.get(key, 2) == ranks}


def _summary(namespace: dict[str, Any]) -> dict[str, Any]:
    """What the tests check of a finished example: its Trainer's state, if it made one named ``trainer``."""
    trainer = namespace.get("trainer")
    if trainer is None:
        return {}
    return {
        "status": trainer.state.status.value,
        "strategy": type(trainer.strategy).__name__,
        "global_step": trainer.global_step,
        "current_epoch": trainer.current_epoch,
        "world_size": trainer.world_size,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
    }


def run_examples(ctx, examples: dict[str, Block]) -> dict[str, dict[str, Any]]:
    """Runs each example as ``__main__`` in ``<outdir>/examples/<name>/``; returns per example what it printed
    and warned on this rank, its Trainer's state and the files it left in its folder."""
    out: dict[str, dict[str, Any]] = {}
    for key, block in examples.items():
        folder = Path(ctx.outdir) / "examples" / re.sub(r"[^\w]+", "_", key.removeprefix("docs/"))
        script = folder / "example.py"
        if ctx.rank == 0:
            folder.mkdir(parents=True)
            script.write_text(block.text)
        dist.barrier()
        printed = io.StringIO()
        previous = os.getcwd()
        os.chdir(folder)
        try:
            with redirect_stdout(printed), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                namespace = runpy.run_path(str(script), run_name="__main__")
        except BaseException as error:
            raise RuntimeError(
                f"the example of {block.where} failed on rank {ctx.rank}; it printed:\n{printed.getvalue()[-3000:]}"
            ) from error
        finally:
            os.chdir(previous)
        summary = _summary(namespace)
        del namespace
        gc.collect()
        dist.barrier()  # every rank has finished this example (rank 0 may write files after the others)
        out[key] = {
            "where": block.where,
            "stdout": printed.getvalue(),
            "warnings": sorted({f"{w.category.__name__}: {w.message}" for w in caught}),
            "folder": str(folder),
            "files": sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()),
            **summary,
        }
    return out


def two_rank_examples(ctx) -> dict[str, dict[str, Any]]:
    return run_examples(ctx, examples_for(2))


def four_rank_examples(ctx) -> dict[str, dict[str, Any]]:
    return run_examples(ctx, examples_for(4))
