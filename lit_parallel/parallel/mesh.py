"""Parallel degrees and the one device mesh built from them.

:class:`ParallelDims` holds the sizes of every parallel dimension, checks them together (the error shows
the arithmetic), and is the only place that calls ``init_device_mesh``. Dimension names are Lightning's
(``ModelParallelStrategy``), so user code written for it keeps working:

- ``data_parallel_replicate``: replicas of the model (across nodes in HSDP)
- ``data_parallel_shard``: ranks a parameter is sharded over (FSDP)
- ``tensor_parallel``: ranks a block's weights are split over
- ``data_parallel``: all ranks that see different data (samplers and metric reductions use it); a
  mesh dimension of its own unless data parallelism is split, then the replicate and shard dimensions
  flattened into one
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

DP_REPLICATE = "data_parallel_replicate"
DP_SHARD = "data_parallel_shard"
TP = "tensor_parallel"
DP = "data_parallel"

# (shape, split, device type) -> (default process group it was built on, mesh)
_MESHES: dict[tuple, tuple[Any, DeviceMesh]] = {}


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n`` in increasing order (for "choose 1, 2 or 4" in error messages)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def _choices(values: list[int]) -> str:
    text = [str(v) for v in values]
    return text[0] if len(text) == 1 else ", ".join(text[:-1]) + " or " + text[-1]


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the parallel dimensions; validated together when created.

    Args:
        world_size: number of ranks in the job.
        data_parallel_replicate: number of model replicas (HSDP replicate degree; 1 = no replication).
        data_parallel_shard: number of ranks a parameter is sharded over; ``-1`` = whatever the other
            dimensions leave (``world_size // (data_parallel_replicate * tensor_parallel)``).
        tensor_parallel: tensor-parallel degree (1 = off).
    """

    world_size: int
    data_parallel_replicate: int = 1
    data_parallel_shard: int = -1
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "data_parallel_replicate", "tensor_parallel"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        shard = self.data_parallel_shard
        if not isinstance(shard, int) or isinstance(shard, bool) or (shard < 1 and shard != -1):
            raise ValueError(
                f"data_parallel_shard={shard!r} must be a positive integer or -1 (use the ranks left over)"
            )
        rep, tp, world = self.data_parallel_replicate, self.tensor_parallel, self.world_size
        if shard == -1:
            if world % (rep * tp) != 0:
                raise ValueError(
                    f"data_parallel_replicate({rep}) * tensor_parallel({tp}) = {rep * tp} does not divide"
                    f" world size ({world}); choose sizes whose product divides {world}"
                    f" (divisors: {_choices(divisors(world))})"
                )
            object.__setattr__(self, "data_parallel_shard", world // (rep * tp))
            shard = self.data_parallel_shard
        if rep * shard * tp != world:
            raise ValueError(
                f"data_parallel_replicate({rep}) * data_parallel_shard({shard}) * tensor_parallel({tp})"
                f" = {rep * shard * tp} != world size ({world}); the product of the parallel sizes must equal"
                f" the number of ranks"
            )

    @classmethod
    def for_hybrid_shard(cls, world_size: int, shard_size: int, tensor_parallel: int = 1) -> ParallelDims:
        """Dims for HSDP: shard over ``shard_size`` ranks, replicate over the rest (clear error if it can't)."""
        if not isinstance(shard_size, int) or isinstance(shard_size, bool) or shard_size < 1:
            raise ValueError(f"shard_size={shard_size!r} must be a positive integer or 'auto'")
        dp = world_size // tensor_parallel if world_size % tensor_parallel == 0 else None
        if dp is None or dp % shard_size != 0:
            ok = divisors(dp if dp is not None else world_size)
            raise ValueError(
                f"shard_size={shard_size} does not divide world size {world_size}"
                + (f" (data-parallel size {dp})" if tensor_parallel > 1 and dp is not None else "")
                + f"; choose {_choices(ok)}"
            )
        return cls(
            world_size=world_size,
            data_parallel_replicate=dp // shard_size,
            data_parallel_shard=shard_size,
            tensor_parallel=tensor_parallel,
        )

    @property
    def data_parallel(self) -> int:
        """All data-parallel ranks: replicate x shard."""
        return self.data_parallel_replicate * self.data_parallel_shard

    @property
    def replicate_enabled(self) -> bool:
        return self.data_parallel_replicate > 1

    @property
    def shard_enabled(self) -> bool:
        return self.data_parallel_shard > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tensor_parallel > 1

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.data_parallel_replicate, self.data_parallel_shard, self.tensor_parallel)

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        """Dimensions of the mesh :meth:`build_mesh` creates: ``(data_parallel, tensor_parallel)`` (as
        Lightning's ModelParallelStrategy) unless data parallelism is split into replicate x shard."""
        return (DP_REPLICATE, DP_SHARD, TP) if self.replicate_enabled else (DP, TP)

    @property
    def fsdp_dim_names(self) -> tuple[str, ...]:
        """Mesh dimensions FSDP runs over: (replicate, shard) for HSDP, otherwise ``data_parallel``."""
        return (DP_REPLICATE, DP_SHARD) if self.replicate_enabled else (DP,)

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Build the device mesh (the only ``init_device_mesh`` call in the package).

        Without replication: 2-D ``(data_parallel, tensor_parallel)``. With replication: 3-D
        ``(data_parallel_replicate, data_parallel_shard, tensor_parallel)`` plus ``data_parallel``, the
        replicate and shard dimensions flattened. Unused dimensions have size 1, so lookups by name work.
        Needs an initialised default process group of ``world_size`` ranks. Several Trainers in one process
        share the mesh (and its process groups) as long as the default process group is the same.
        """
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if dist.is_initialized() and dist.get_world_size() != self.world_size:
            raise RuntimeError(
                f"ParallelDims(world_size={self.world_size}) does not match the process group's world size"
                f" {dist.get_world_size()}"
            )
        default_group = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
        key = (self.shape, self.replicate_enabled, device_type)
        cached = _MESHES.get(key)
        if cached is not None and default_group is not None and cached[0] is default_group:
            return cached[1]
        if not self.replicate_enabled:
            mesh = init_device_mesh(
                device_type, (self.data_parallel, self.tensor_parallel), mesh_dim_names=(DP, TP)
            )
        else:
            mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=(DP_REPLICATE, DP_SHARD, TP))
            mesh[(DP_REPLICATE, DP_SHARD)]._flatten(DP)
        if default_group is not None:
            _MESHES[key] = (default_group, mesh)
        return mesh

    def data_parallel_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The 1-D mesh of all data-parallel ranks (the flattened dimension when data parallelism is split)."""
        if self.replicate_enabled:
            # _flatten returns the mesh flattened in build_mesh (slicing it from the root is deprecated)
            return mesh[(DP_REPLICATE, DP_SHARD)]._flatten(DP)
        return mesh[DP]

    def fsdp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The sub-mesh FSDP shards (1-D) or hybrid-shards (2-D: Replicate, Shard) over."""
        names = self.fsdp_dim_names
        return mesh[names[0]] if len(names) == 1 else mesh[names]

    def sampler_kwargs(self, mesh: DeviceMesh) -> dict[str, Any]:
        """``DistributedSampler`` arguments: every data-parallel rank reads different samples."""
        return {"num_replicas": self.data_parallel, "rank": self.data_parallel_mesh(mesh).get_local_rank()}

    def describe(self) -> str:
        return (
            f"data_parallel_replicate={self.data_parallel_replicate} x data_parallel_shard="
            f"{self.data_parallel_shard} x tensor_parallel={self.tensor_parallel} (world size {self.world_size})"
        )
