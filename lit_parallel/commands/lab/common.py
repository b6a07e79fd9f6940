"""What every lab experiment shares: tiny synthetic data and models, the launch, CSV and PNG output.

Every experiment runs on CPU processes with the gloo backend (``torchrun`` through
:func:`lit_parallel.commands.launch.run_ranks`), with models small enough that a laptop finishes in minutes.
"""

from __future__ import annotations

import csv
import os
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

FEATURES, CLASSES = 32, 4


def classification_data(n: int, seed: int = 0) -> torch.utils.data.TensorDataset:
    """``n`` samples of a 4-class problem a small MLP learns in a few epochs: Gaussian inputs, labels from a
    fixed random teacher (the same for every seed of the inputs)."""
    teacher = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(1234))
    x = torch.randn(n, FEATURES, generator=torch.Generator().manual_seed(seed))
    return torch.utils.data.TensorDataset(x, (x @ teacher).argmax(dim=1))


def mlp(hidden: int = 64, depth: int = 2, features: int = FEATURES, classes: int = CLASSES) -> nn.Sequential:
    """A plain MLP: ``depth`` hidden layers of ``hidden`` units."""
    layers: list[nn.Module] = []
    width = features
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    return nn.Sequential(*layers, nn.Linear(width, classes))


def accuracy(model: nn.Module, data: torch.utils.data.TensorDataset) -> float:
    x, y = data.tensors
    with torch.no_grad():
        return float((model(x).argmax(dim=1) == y).float().mean())


def launch(module: str, ranks: int, args: Iterable[str] = (), timeout: float = 600) -> dict[str, Any]:
    """Run ``python -m module --worker ...`` on ``ranks`` CPU processes; rank 0's JSON result."""
    from lit_parallel.commands.launch import run_ranks

    return run_ranks(module, ranks, list(args), timeout=timeout)


def timed(fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after one warm-up (ranks synchronised around each)."""
    import torch.distributed as dist

    fn()
    times = []
    for _ in range(repeats):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        fn()
        if dist.is_initialized():
            dist.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def write_csv(path: Path, rows: list[dict[str, Any]]) -> Path:
    """Rows (dicts with the same keys) as CSV."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def figure(ncols: int = 1, width: float = 5.0) -> tuple[Any, Any]:
    """A matplotlib figure on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, 3.6), squeeze=False)
    return fig, list(axes[0])


def save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def run_worker(compute: Callable[[Any], dict[str, Any]], args: Any) -> int:
    """The body of every experiment's ``--worker``: join the ranks, compute, rank 0 writes the result."""
    import torch.distributed as dist

    from lit_parallel.commands.launch import init_ranks, write_result

    threads()
    init_ranks()
    result = compute(args)
    if dist.get_rank() == 0:
        write_result(args.result, result)
    dist.barrier()
    return 0


def threads() -> None:
    """One intra-op thread per rank: N ranks on N cores, the usual CPU setup (and fair comparisons)."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
