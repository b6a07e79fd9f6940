"""Single-process plain-PyTorch reference for parity tests.

N data-parallel ranks that each take 1/N of a global batch must match one process that takes the
whole global batch. Lightning's training sampler is a shuffling ``DistributedSampler`` (seed
``PL_GLOBAL_SEED`` or 0, ``set_epoch`` each epoch): the reference rebuilds the same order per rank and
concatenates the ranks' micro-batches in rank order. Lightning divides each micro-batch loss by
``accumulate_grad_batches`` and also steps on an epoch's last batch when the accumulation is partial;
the reference does the same, then clips and steps.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch.utils.data import Dataset, DistributedSampler


def rank_orders(dataset_len: int, world_size: int, epoch: int, *, seed: int = 0, shuffle: bool = True):
    """The index list each data-parallel rank reads in ``epoch`` (DistributedSampler, no drop_last)."""

    class _Len:
        def __len__(self):
            return dataset_len

    orders = []
    for rank in range(world_size):
        sampler = DistributedSampler(_Len(), num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed)
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
    return orders


def global_micro_batches(
    dataset_len: int, world_size: int, per_rank_batch: int, epochs: int, *, seed: int = 0
) -> list[list[list[int]]]:
    """Per epoch, the indices of each global micro-batch: rank 0's part, then rank 1's, ..."""
    out = []
    for epoch in range(epochs):
        orders = rank_orders(dataset_len, world_size, epoch, seed=seed)
        n = len(orders[0])
        out.append(
            [
                [i for order in orders for i in order[s : s + per_rank_batch]]
                for s in range(0, n, per_rank_batch)
            ]
        )
    return out


def collate(dataset: Dataset, indices: Sequence[int]):
    items = [dataset[i] for i in indices]
    return tuple(torch.stack([item[k] for item in items]) for k in range(len(items[0])))


def reference_training(
    model: torch.nn.Module,
    dataset: Dataset,
    loss_fn: Callable[[torch.nn.Module, tuple], torch.Tensor],
    *,
    world_size: int,
    per_rank_batch: int,
    max_steps: int,
    lr: float,
    accumulate_grad_batches: int = 1,
    gradient_clip_val: float | None = None,
    gradient_clip_algorithm: str = "norm",
    epochs: int = 100,
    seed: int = 0,
    momentum: float = 0.0,
) -> dict:
    """Train a copy of ``model`` with SGD on global batches; return micro-batch losses and parameters.

    ``loss_fn(model, batch)`` returns the mean loss of ``batch``. ``max_steps`` counts optimizer steps.
    """
    model = copy.deepcopy(model)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    epochs_of_batches = global_micro_batches(len(dataset), world_size, per_rank_batch, epochs, seed=seed)
    losses: list[float] = []
    steps = 0
    for batches in epochs_of_batches:
        for i, indices in enumerate(batches):
            loss = loss_fn(model, collate(dataset, indices))
            losses.append(loss.item())
            (loss / accumulate_grad_batches).backward()
            # Lightning also steps on the last batch of an epoch, with a partial accumulation
            if (i + 1) % accumulate_grad_batches == 0 or i + 1 == len(batches):
                if gradient_clip_val is not None:
                    if gradient_clip_algorithm == "norm":
                        torch.nn.utils.clip_grad_norm_(model.parameters(), gradient_clip_val)
                    else:
                        torch.nn.utils.clip_grad_value_(model.parameters(), gradient_clip_val)
                opt.step()
                opt.zero_grad(set_to_none=True)
                steps += 1
                if steps == max_steps:
                    return {"losses": losses, "params": _params(model)}
    raise ValueError(f"{epochs} epochs hold fewer than max_steps={max_steps} optimizer steps")


def _params(model: torch.nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-5, what: str = "") -> None:
    """``|actual - expected| / max(|expected|, tiny) < rel`` in the max norm, with a readable message."""
    actual = torch.as_tensor(actual, dtype=torch.float64)
    expected = torch.as_tensor(expected, dtype=torch.float64)
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = (actual - expected).abs().max().item()
    scale = max(expected.abs().max().item(), 1e-12)
    assert err / scale < rel, f"{what}: relative error {err / scale:.3e} >= {rel:g} (max abs err {err:.3e})"


def assert_bitwise(got, expected, what: str) -> None:
    """``got`` equals ``expected`` bit for bit: tensors with ``torch.equal``, through dicts, lists and tuples."""
    if isinstance(expected, torch.Tensor):
        assert torch.equal(got, expected), f"{what}: not bitwise equal"
    elif isinstance(expected, dict):
        assert set(got) == set(expected), f"{what}: keys differ: {sorted(set(got) ^ set(expected))[:6]}"
        for k in expected:
            assert_bitwise(got[k], expected[k], f"{what}/{k}")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), what
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_bitwise(g, e, f"{what}[{i}]")
    else:
        assert got == expected, f"{what}: {got!r} != {expected!r}"
