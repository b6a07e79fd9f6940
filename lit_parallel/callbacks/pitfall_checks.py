"""The measurements and helpers behind :class:`~lit_parallel.callbacks.PitfallReport` (no Callback here):
its findings, learning-rate scaling rules, per-rank seeds, cross-rank tensor comparison, augmentation
probing."""

from __future__ import annotations

import hashlib
import math
import os
import random
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset

from lit_parallel.callbacks.data_parallel import (
    DataParallelGroup,
    all_reduce_max_min,
    data_parallel_group,
)
from lit_parallel.callbacks.fingerprints import tensor_leaves


@dataclass
class Finding:
    """One row of the report."""

    check: str
    status: Literal["ok", "problem", "info", "n/a"]
    evidence: str
    fix: str = ""

    def message(self) -> str:
        return f"PitfallReport: {self.check}: {self.evidence}" + (f" Fix: {self.fix}" if self.fix else "")


# Optimizers whose step is normalized per coordinate: their learning rate scales with the square root
# of the batch size (Malladi et al., 2022); plain SGD-like ones scale linearly (Goyal et al., 2017).
_ADAPTIVE = (
    "Adam",
    "AdamW",
    "Adamax",
    "NAdam",
    "RAdam",
    "SparseAdam",
    "Adagrad",
    "Adadelta",
    "RMSprop",
    "Adafactor",
    "LAMB",
    "Lamb",
    "Lion",
    "Muon",
)


def learning_rate_rule(optimizer: Any) -> Literal["linear", "sqrt"]:
    """``"sqrt"`` for adaptive (Adam-like) optimizers, ``"linear"`` for SGD-like ones."""
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    names = {c.__name__ for c in cls.__mro__}
    return "sqrt" if names & set(_ADAPTIVE) else "linear"


def scaled_learning_rate(
    base_lr: float, base_batch_size: int, global_batch_size: int, rule: Any = "linear"
) -> float:
    """The learning rate for ``global_batch_size`` given one tuned for ``base_batch_size``.

    Args:
        rule: ``"linear"`` (SGD, momentum SGD, LARS), ``"sqrt"`` (Adam, AdamW, RMSprop, ...), or an
            optimizer (instance or class) to pick the rule from. For scale factors of 4 or more use a
            warm-up from ``base_lr`` over the first few percent of steps.

    Example: ``scaled_learning_rate(0.1, 256, 8 * 512)`` is 1.6.
    """
    if base_batch_size <= 0 or global_batch_size <= 0:
        raise ValueError(
            f"scaled_learning_rate: base_batch_size={base_batch_size} and global_batch_size={global_batch_size}"
            " must be positive"
        )
    if not isinstance(rule, str):
        rule = learning_rate_rule(rule)
    if rule not in ("linear", "sqrt"):
        raise ValueError(
            f"scaled_learning_rate(rule={rule!r}): rule must be 'linear', 'sqrt' or an optimizer"
        )
    k = global_batch_size / base_batch_size
    return base_lr * (k if rule == "linear" else math.sqrt(k))


def per_rank_seed(base_seed: int, trainer: Any = None) -> int:
    """``base_seed + rank``: a different random stream (augmentations, dropout) on every data-parallel rank.

    With ``trainer`` the rank is the data-parallel rank (ranks of one tensor-parallel group, which must
    draw the same augmentation, get the same seed); without it, the global rank from
    ``torch.distributed`` or the ``RANK``/``LOCAL_RANK`` environment variables (0 when not distributed).
    Typical use: ``torch.manual_seed(lp.per_rank_seed(42, self.trainer))`` in ``on_train_start``, or
    ``L.seed_everything(lp.per_rank_seed(42))`` in a script launched with torchrun.
    """
    if trainer is not None:
        return base_seed + data_parallel_group(trainer.strategy).rank
    if dist.is_available() and dist.is_initialized():
        return base_seed + dist.get_rank()
    return base_seed + int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))


def scheduled_peak_lrs(trainer: Any) -> list[float]:
    """The peak learning rates the optimizers' schedulers declared (``initial_lr``, ``max_lr``)."""
    peaks = []
    for optimizer in trainer.optimizers or []:
        group = optimizer.param_groups[0]
        for key in ("initial_lr", "max_lr"):
            value = group.get(key)
            if isinstance(value, (int, float)):
                peaks.append(float(value))
    return peaks


def tensors_diverging(module: torch.nn.Module, dp: DataParallelGroup) -> dict[str, float]:
    """Parameters and buffers whose values differ across ranks, with their relative difference.

    Plain tensors are compared over the data-parallel group; a ``DTensor`` is compared over the mesh
    dimensions it is replicated on (shards of FSDP differ by design and are skipped).
    """
    plain: list[tuple[str, torch.Tensor]] = []
    replicated: dict[tuple[int, int], list[tuple[str, torch.Tensor, Any]]] = {}
    for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        if hasattr(tensor, "placements") and hasattr(tensor, "to_local"):
            mesh = tensor.device_mesh
            for dim, placement in enumerate(tensor.placements):
                if placement.is_replicate() and mesh.size(dim) > 1:
                    replicated.setdefault((id(mesh), dim), []).append((name, tensor.to_local(), mesh))
        else:
            plain.append((name, tensor))
    out: dict[str, float] = {}
    if plain:
        out.update(_compare(plain, lambda sums: all_reduce_max_min(sums, dp)))
    for (_, dim), items in replicated.items():
        group = items[0][2].get_group(dim)
        sub = DataParallelGroup(group, 0, dist.get_world_size(group), True, dp.device)
        out.update(
            _compare([(n, t) for n, t, _ in items], lambda sums, sub=sub: all_reduce_max_min(sums, sub))
        )
    return out


def _compare(items: list[tuple[str, torch.Tensor]], max_min: Any) -> dict[str, float]:
    sums = torch.stack(
        [torch.stack([t.detach().double().sum(), t.detach().double().square().sum()]) for _, t in items]
    ).cpu()
    high, low = max_min(sums)
    scale = torch.maximum(high.abs(), low.abs()).clamp(min=1e-30)
    rel = ((high - low) / scale).max(dim=1).values
    return {name: float(r) for (name, _), r in zip(items, rel) if r > 0}


def rng_fingerprint(generator: Any = None) -> str:
    """A digest of the random states a dataset or the DataLoader's worker seeds draw from."""
    h = hashlib.sha1()
    h.update(torch.get_rng_state().numpy().tobytes())
    h.update(repr(random.getstate()).encode())
    try:
        import numpy as np

        h.update(repr(np.random.get_state()[1][:8].tolist()).encode())
        h.update(str(np.random.get_state()[2]).encode())
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    if generator is not None:
        h.update(generator.get_state().numpy().tobytes())
    return h.hexdigest()


def draws_random_numbers(dataset: Any) -> bool | None:
    """Whether ``dataset[0]`` differs between two reads (random augmentation); random states restored."""
    if dataset is None or isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__"):
        return None
    try:
        if len(dataset) == 0:
            return None
    except TypeError:
        return None
    torch_state = torch.get_rng_state()
    py_state = random.getstate()
    try:
        import numpy as np

        np_state = np.random.get_state()
    except ImportError:  # pragma: no cover
        np, np_state = None, None
    try:
        first, second = dataset[0], dataset[0]
    except Exception:  # a dataset that cannot be read twice here: unknown
        return None
    finally:
        torch.set_rng_state(torch_state)
        random.setstate(py_state)
        if np is not None:
            np.random.set_state(np_state)
    return not _same_sample(first, second)


def _same_sample(a: Any, b: Any) -> bool:
    ta, tb = tensor_leaves(a), tensor_leaves(b)
    if ta or tb:
        return len(ta) == len(tb) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(ta, tb))
    try:
        return bool(a == b)
    except Exception:
        return True
