"""The data-parallel group every lit_parallel callback works on, and the few collectives they use.

Ranks that read different samples form the data-parallel group: the whole world for DDP-like strategies,
``strategy.device_mesh["data_parallel"]`` for strategies with a device mesh (Lightning's
``ModelParallelStrategy`` and ours). With tensor parallelism there is one such group per
tensor-parallel coordinate, and they read the same samples: checks made inside the group see each
sample once; reductions over the whole world (torchmetrics, ``self.log(sync_dist=True)``) must let only
one member of each tensor-parallel group count (:attr:`DataParallelGroup.counts_samples`).

Every decision a callback takes from these collectives is taken from gathered data, so every rank
takes the same one: in ``mode="raise"`` all ranks raise together and none is left waiting.
"""

from __future__ import annotations

import pickle
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lit_parallel.parallel.mesh import DP, DP_REPLICATE, DP_SHARD

# Mesh dimensions whose ranks read different samples; any other dimension (tensor_parallel, ...) holds
# ranks that read the same samples.
DATA_PARALLEL_DIMS = (DP, DP_REPLICATE, DP_SHARD)


class ParallelTrainingWarning(UserWarning):
    """A multi-device training mistake found by a lit_parallel callback (``mode="warn"``)."""


class ParallelTrainingError(RuntimeError):
    """A multi-device training mistake found by a lit_parallel callback (``mode="raise"``)."""


@dataclass(frozen=True)
class DataParallelGroup:
    """The ranks that read different samples, seen from this rank.

    Attributes:
        group: the process group (``None`` when not running distributed).
        rank: this rank's index in the group.
        size: number of ranks in the group.
        counts_samples: ``False`` on a rank that reads the same samples as a lower rank of its
            tensor-parallel group; in reductions over the whole world its samples are counted there.
        device: where collectives on ``group`` take their tensors (CPU for gloo, the GPU for NCCL).
    """

    group: Any
    rank: int
    size: int
    counts_samples: bool
    device: torch.device

    @property
    def distributed(self) -> bool:
        return self.group is not None and self.size > 1


def _device_mesh(strategy: Any) -> Any:
    try:
        return getattr(strategy, "device_mesh", None)
    except (RuntimeError, AttributeError):  # Lightning guards the mesh before processes are set up
        return None


def data_parallel_group(strategy: Any = None) -> DataParallelGroup:
    """The data-parallel group of ``strategy`` (or of the default process group when ``None``)."""
    if not (dist.is_available() and dist.is_initialized()):
        return DataParallelGroup(None, 0, 1, True, torch.device("cpu"))
    mesh = _device_mesh(strategy) if strategy is not None else None
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if mesh is not None and names:
        try:
            dp_mesh = mesh[DP]
        except (KeyError, RuntimeError, ValueError, IndexError) as err:
            if not set(names) <= set(DATA_PARALLEL_DIMS):
                raise RuntimeError(
                    f"device mesh with dimensions {names} of {type(strategy).__name__} has no"
                    f" '{DP}' dimension; flatten its data-parallel dimensions into one named '{DP}'"
                    f" (mesh[(...)]._flatten('{DP}')) so that callbacks can find the ranks that read"
                    " different samples"
                ) from err
            dp_mesh = mesh
        if dp_mesh.ndim == 1:
            group, rank, size = dp_mesh.get_group(), dp_mesh.get_local_rank(), dp_mesh.size()
        else:  # an unflattened mesh made only of data-parallel dimensions: every rank reads its own data
            group, rank, size = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
        others = [n for n in names if n not in DATA_PARALLEL_DIMS]
        counts = all(mesh.get_local_rank(n) == 0 for n in others)
    else:
        group, rank, size, counts = dist.group.WORLD, dist.get_rank(), dist.get_world_size(), True
    return DataParallelGroup(group, rank, size, counts, _collective_device(group, strategy))


def _collective_device(group: Any, strategy: Any) -> torch.device:
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "nccl" not in backend and "xccl" not in backend:
        return torch.device("cpu")
    root = getattr(strategy, "root_device", None)
    if isinstance(root, torch.device) and root.type != "cpu":
        return root
    return torch.device("cuda", torch.cuda.current_device())


def all_reduce(tensor: torch.Tensor, dp: DataParallelGroup, op: Any = None) -> torch.Tensor:
    """``tensor`` reduced over the group (sum by default), returned on the CPU."""
    if not dp.distributed:
        return tensor.detach().cpu().clone()
    t = tensor.detach().to(dp.device, copy=True)
    dist.all_reduce(t, op=op if op is not None else dist.ReduceOp.SUM, group=dp.group)
    return t.cpu()


def all_reduce_max_min(values: torch.Tensor, dp: DataParallelGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """Element-wise maximum and minimum of a float tensor over the group, in one collective."""
    both = torch.cat([values.reshape(-1), -values.reshape(-1)])
    both = all_reduce(both, dp, dist.ReduceOp.MAX)
    n = values.numel()
    return both[:n].view_as(values), -both[n:].view_as(values)


def all_gather_object(obj: Any, dp: DataParallelGroup) -> list[Any]:
    """Every rank's ``obj`` (small, picklable) in group-rank order."""
    if not dp.distributed:
        return [obj]
    # A byte tensor instead of dist.all_gather_object: the latter picks its device from the global
    # backend, which is wrong for a gloo subgroup inside an NCCL job.
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = all_gather_tensor(torch.tensor([data.numel()]), dp)
    padded = torch.zeros(int(sizes.max()), dtype=torch.uint8)
    padded[: data.numel()] = data
    gathered = all_gather_tensor(padded, dp).view(dp.size, -1)
    return [pickle.loads(gathered[r, : int(sizes[r])].numpy().tobytes()) for r in range(dp.size)]


def all_gather_tensor(tensor: torch.Tensor, dp: DataParallelGroup) -> torch.Tensor:
    """Same-shape tensors of every rank concatenated along dim 0, on the CPU."""
    if not dp.distributed:
        return tensor.detach().cpu().clone()
    t = tensor.detach().to(dp.device).contiguous()
    out = [torch.empty_like(t) for _ in range(dp.size)]
    dist.all_gather(out, t, group=dp.group)
    return torch.cat([o.cpu() for o in out])


def report(messages: list[str], *, mode: str, is_global_zero: bool, stacklevel: int = 2) -> None:
    """Warn on global rank 0 (``mode="warn"``) or raise on every rank (``mode="raise"``).

    Callers pass messages computed from gathered data, identical on every rank.
    """
    if not messages:
        return
    if mode == "raise":
        raise ParallelTrainingError("\n\n".join(messages))
    if is_global_zero:
        for message in messages:
            warnings.warn(message, ParallelTrainingWarning, stacklevel=stacklevel + 1)


def check_mode(mode: str, owner: str) -> str:
    if mode not in ("warn", "raise"):
        raise ValueError(f"{owner}(mode={mode!r}): mode must be 'warn' (warning on rank 0) or 'raise'")
    return mode
