"""`lit-parallel lab set-epoch`: what changes when ``sampler.set_epoch(epoch)`` is forgotten.

Two ranks read a dataset through ``DistributedSampler(shuffle=True)`` for several epochs, once calling
``set_epoch`` every epoch and once not. Per epoch and rank it records which sample indices the rank
read: the overlap with the other rank's indices (disjoint shards: 0), the share of samples the rank
already read in the previous epoch, and the share read in the same position as in the previous epoch.
Without ``set_epoch`` the sampler reshuffles with the same seed every epoch: each rank reads the same
half of the data in the same order, forever. The same runs train a small MLP (DDP) and record the
loss per epoch.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from lit_parallel.commands.lab.common import (
    classification_data,
    figure,
    launch,
    mlp,
    run_worker,
    save,
    write_csv,
)
from lit_parallel.commands.launch import add_worker_arguments

MODES = ("set_epoch called", "set_epoch forgotten")


def _epoch_order(sampler: Any, epoch: int, call: bool) -> list[int]:
    if call:
        sampler.set_epoch(epoch)
    return list(iter(sampler))


def _train(
    call: bool, samples: int, epochs: int, rank: int, world: int
) -> tuple[list[list[int]], list[float]]:
    """One DDP run; per epoch this rank's index order and the mean training loss (averaged over ranks)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    data = classification_data(samples)
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(data, batch_size=8, sampler=sampler)
    model = DDP(mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    orders, losses = [], []
    for epoch in range(epochs):
        orders.append(_epoch_order(sampler, epoch, call))  # the order the loader below reads
        total = torch.zeros(2)
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += torch.tensor([loss.item() * len(y), len(y)])
        dist.all_reduce(total)
        losses.append(float(total[0] / total[1]))
    return orders, losses


def compute(args: argparse.Namespace) -> dict[str, Any]:
    """In every rank: both runs; every rank's index orders gathered."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    result: dict[str, Any] = {}
    for mode in MODES:
        orders, losses = _train(mode == MODES[0], args.samples, args.epochs, rank, world)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, orders)
        result[mode] = {"orders": gathered, "losses": losses}
    return result


def worker_args(quick: bool) -> list[str]:
    samples, epochs = (64, 3) if quick else (512, 8)
    return [f"--samples={samples}", f"--epochs={epochs}"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lit_parallel.commands.lab.set_epoch")
    add_worker_arguments(p)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--epochs", type=int, default=3)
    return p


def order_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per mode, epoch and rank: cross-rank overlap, samples and positions repeated from the last epoch."""
    rows = []
    for mode in MODES:
        orders = result[mode]["orders"]  # [rank][epoch] -> indices
        for rank, per_epoch in enumerate(orders):
            for epoch, order in enumerate(per_epoch):
                others = set().union(*(set(o[epoch]) for r, o in enumerate(orders) if r != rank))
                prev = per_epoch[epoch - 1] if epoch else None
                rows.append(
                    {
                        "mode": mode,
                        "epoch": epoch,
                        "rank": rank,
                        "overlap_with_other_ranks": len(set(order) & others) / len(order),
                        "same_samples_as_previous_epoch": ""
                        if prev is None
                        else len(set(order) & set(prev)) / len(order),
                        "same_positions_as_previous_epoch": ""
                        if prev is None
                        else sum(a == b for a, b in zip(order, prev)) / len(order),
                    }
                )
    return rows


def run(out: Path, quick: bool = False, result: dict[str, Any] | None = None) -> list[Path]:
    """Launch the ranks (unless ``result`` already holds what they computed), write CSV and PNG."""
    args = parser().parse_args(worker_args(quick))
    samples, epochs = args.samples, args.epochs
    if result is None:
        result = launch("lit_parallel.commands.lab.set_epoch", 2, worker_args(quick))
    rows = order_rows(result)
    losses = [{"mode": m, "epoch": e, "loss": v} for m in MODES for e, v in enumerate(result[m]["losses"])]
    files = [write_csv(out / "set_epoch_order.csv", rows), write_csv(out / "set_epoch_loss.csv", losses)]
    fig, (ax_order, ax_loss) = figure(2)
    for mode, style in zip(MODES, ("o-", "s--")):
        pts = [
            (r["epoch"], r["same_samples_as_previous_epoch"])
            for r in rows
            if r["mode"] == mode and r["rank"] == 0 and r["epoch"]
        ]
        ax_order.plot(*zip(*pts), style, label=mode)
        ax_loss.plot(
            [e for e, _ in enumerate(result[mode]["losses"])], result[mode]["losses"], style, label=mode
        )
    ax_order.set(
        title="rank 0: samples it already read last epoch", xlabel="epoch", ylabel="share", ylim=(-0.05, 1.05)
    )
    ax_loss.set(title="training loss (DDP, 2 ranks)", xlabel="epoch", ylabel="mean cross-entropy")
    for ax in (ax_order, ax_loss):
        ax.legend()
    files.append(save(fig, out / "set_epoch.png"))
    (out / "set_epoch.json").write_text(json.dumps({"samples": samples, "epochs": epochs}))
    return files


if __name__ == "__main__":
    raise SystemExit(run_worker(compute, parser().parse_args()))
