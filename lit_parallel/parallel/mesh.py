"""Parallel degrees and the one device mesh built from them.

:class:`ParallelDims` holds the sizes of every parallel dimension, checks them together (the error shows
the arithmetic), builds the device mesh once and keeps it (``dims.mesh``); it is the only place that calls
``init_device_mesh``. One constructor per layout: :meth:`ParallelDims.for_ddp`, :meth:`~ParallelDims.for_fsdp`,
:meth:`~ParallelDims.for_hybrid_shard` and :meth:`~ParallelDims.for_tensor_parallel` (2-D, and 3-D with
replication). Dimension names are Lightning's (``ModelParallelStrategy``), so user code written for it keeps
working:

- ``data_parallel_replicate``: replicas of the model (across nodes in HSDP)
- ``data_parallel_shard``: ranks a parameter is sharded over (FSDP)
- ``tensor_parallel``: ranks a block's weights are split over
- ``data_parallel``: all ranks that see different data (samplers and metric reductions use it); a
  mesh dimension of its own unless data parallelism is split, then the replicate and shard dimensions
  flattened into one
- ``expert_parallel`` (``expert_parallel > 1`` only): the ranks an MoE layer's experts are split over. They are
  borrowed from the data-parallel ranks (as torchtitan does): ``data_parallel`` becomes
  ``expert_data_parallel x expert_parallel`` flattened, so attention and every non-expert weight stay
  data-parallel over all of them, while each expert lives on one ``expert_parallel`` coordinate and is
  FSDP-sharded over ``expert_data_parallel``, the ranks that hold the same experts. Borrowing costs no
  extra ranks: tokens are already spread over the data-parallel ranks, so each expert sees the tokens of
  ``expert_parallel`` ranks' batches with one all-to-all each way, where a separate dimension would
  multiply the world size or idle ranks outside MoE layers.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from lit_parallel._compat import flatten_mesh
from lit_parallel.formatting import divisors, format_choices

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

DP_REPLICATE = "data_parallel_replicate"
DP_SHARD = "data_parallel_shard"
TP = "tensor_parallel"
DP = "data_parallel"
PP = "pipeline_parallel"
EP = "expert_parallel"
EDP = "expert_data_parallel"
# every name a data-parallel mesh dimension can have (metric reductions look for any of them)
DATA_PARALLEL_DIMS = (DP, DP_REPLICATE, DP_SHARD)

Size = Literal["auto"] | int

# Meshes of every shape built on a default process group, held only as long as that group lives: a second
# ParallelDims of the same shape in the same process (a second Trainer, a notebook re-run) reuses the mesh and
# its sub-groups instead of creating new process groups each time.
_MESHES_BY_GROUP: weakref.WeakKeyDictionary[Any, dict[tuple, DeviceMesh]] = weakref.WeakKeyDictionary()

__all__ = [
    "DATA_PARALLEL_DIMS",
    "DP",
    "DP_REPLICATE",
    "DP_SHARD",
    "EDP",
    "EP",
    "PP",
    "TP",
    "ParallelDims",
    "check_size",
    "divisors",
    "mesh_group_ranks",
]


def mesh_group_ranks(mesh: DeviceMesh) -> tuple[tuple[int, ...], ...]:
    """Per dimension of ``mesh``, the global ranks of this rank's group: read from the process groups, not from
    ``DeviceMesh.mesh`` (a sub-mesh builds that tensor from the full mesh with ``.item()`` calls, host reads)."""
    import torch.distributed as dist

    return tuple(tuple(dist.get_process_group_ranks(mesh.get_group(d))) for d in range(mesh.ndim))


def check_size(name: str, value: Any, *, auto: bool = False) -> None:
    """A parallel size must be a positive integer (or ``"auto"`` where ``auto``)."""
    if auto and value == "auto":
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be {'auto or ' if auto else ''}a positive integer")


@dataclass
class ParallelDims:
    """Sizes of the parallel dimensions, validated together when created, and the mesh built from them.

    Args:
        world_size: number of ranks in the job.
        data_parallel_replicate: number of model replicas (HSDP replicate degree; 1 = no replication).
        data_parallel_shard: number of ranks a parameter is sharded over; ``-1`` = whatever the other
            dimensions leave (``world_size // (data_parallel_replicate * tensor_parallel)``).
        tensor_parallel: tensor-parallel degree (1 = off).
        pipeline_parallel: pipeline stages' ranks (1 = off); the outermost mesh dimension.
        expert_parallel: ranks an MoE layer's experts are split over (1 = off), borrowed from the
            data-parallel ranks: it must divide ``data_parallel_shard``; data parallelism may not be
            replicated (HSDP) with it.
    """

    world_size: int
    data_parallel_replicate: int = 1
    data_parallel_shard: int = -1
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    pipeline_dim: bool = (
        False  # a pipeline_parallel mesh dimension even of size 1 (pp_dp with one stage rank)
    )
    expert_parallel: int = 1
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in (
            "world_size",
            "data_parallel_replicate",
            "tensor_parallel",
            "pipeline_parallel",
            "expert_parallel",
        ):
            check_size(name, getattr(self, name))
        shard = self.data_parallel_shard
        if not isinstance(shard, int) or isinstance(shard, bool) or (shard < 1 and shard != -1):
            raise ValueError(
                f"data_parallel_shard={shard!r} must be a positive integer or -1 (use the ranks left over)"
            )
        if self.pp_enabled:
            self._check_with_pipeline(shard)
        else:
            self._check_without_pipeline(shard)
        self._check_expert_parallel()

    def _check_without_pipeline(self, shard: int) -> None:
        rep, tp, world = self.data_parallel_replicate, self.tensor_parallel, self.world_size
        if shard == -1:
            if world % (rep * tp) != 0:
                raise ValueError(
                    f"data_parallel_replicate({rep}) * tensor_parallel({tp}) = {rep * tp} does not divide"
                    f" world size ({world}); choose sizes whose product divides {world}"
                    f" (divisors: {format_choices(divisors(world))})"
                )
            shard = self.data_parallel_shard = world // (rep * tp)
        if rep * shard * tp != world:
            raise ValueError(
                f"data_parallel_replicate({rep}) * data_parallel_shard({shard}) * tensor_parallel({tp})"
                f" = {rep * shard * tp} != world size ({world}); the product of the parallel sizes must equal"
                f" the number of ranks"
            )

    def _check_expert_parallel(self) -> None:
        ep, shard, rep = self.expert_parallel, self.data_parallel_shard, self.data_parallel_replicate
        if ep == 1:
            return
        if rep > 1:
            raise ValueError(
                f"expert_parallel={ep} with data_parallel_replicate={rep}: expert parallelism borrows its ranks"
                " from the data-parallel ranks of one FSDP group and does not combine with replication (HSDP)"
                " yet; use data_parallel_replicate_size=1 (plain FSDP over all data-parallel ranks) or"
                " expert_parallel_size=1"
            )
        if shard % ep:
            raise ValueError(
                f"expert_parallel={ep} does not divide the data-parallel size {shard}: expert-parallel ranks"
                f" are borrowed from the data-parallel ranks; choose {format_choices(divisors(shard))}"
            )

    # --- one constructor per layout ----------------------------------------------------------------------

    @classmethod
    def for_ddp(cls, world_size: int) -> ParallelDims:
        """DDP: every rank holds the whole model and reads different data (one ``data_parallel`` dimension)."""
        return cls(world_size=world_size)

    @classmethod
    def for_fsdp(cls, world_size: int, expert_parallel: int = 1) -> ParallelDims:
        """FSDP: every rank holds 1/world_size of the model and reads different data; with
        ``expert_parallel > 1`` an MoE layer's experts are split over that many of them."""
        return cls(world_size=world_size, expert_parallel=expert_parallel)

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
                + f"; choose {format_choices(ok)}"
            )
        return cls(
            world_size=world_size,
            data_parallel_replicate=dp // shard_size,
            data_parallel_shard=shard_size,
            tensor_parallel=tensor_parallel,
        )

    @classmethod
    def for_tensor_parallel(
        cls,
        *,
        num_nodes: int,
        devices_per_node: int,
        data_parallel: Size = "auto",
        tensor_parallel: Size = "auto",
        data_parallel_replicate: int = 1,
        expert_parallel: int = 1,
    ) -> ParallelDims:
        """Dims for TP + FSDP (2-D) or TP + HSDP (3-D, ``data_parallel_replicate > 1``).

        ``"auto"`` sizes: tensor parallelism stays inside a node (``tensor_parallel = devices_per_node``)
        unless ``data_parallel`` is given, then it takes what data parallelism leaves.
        """
        world = num_nodes * devices_per_node
        layout = f"num_nodes({num_nodes}) * devices({devices_per_node})"
        tp, dp, rep = tensor_parallel, data_parallel, data_parallel_replicate
        if tp == "auto" and dp == "auto":
            tp = devices_per_node
        elif tp == "auto":
            if world % dp:
                raise ValueError(
                    f"data_parallel_size={dp} does not divide the world size {world} = {layout}; choose"
                    f" {format_choices(divisors(world))}"
                )
            tp = world // dp
        if dp == "auto":
            if world % (tp * rep):
                raise ValueError(
                    f"tensor_parallel_size({tp}) * data_parallel_replicate_size({rep}) = {tp * rep} does not"
                    f" divide the world size {world} = {layout}; choose sizes whose product divides {world}"
                )
            dp = world // tp
        if dp % rep:
            raise ValueError(
                f"data_parallel_replicate_size={rep} does not divide data_parallel_size={dp} (the data-parallel"
                f" ranks are replicate x shard); choose {format_choices(divisors(dp))}"
            )
        try:
            return cls(
                world_size=world,
                data_parallel_replicate=rep,
                data_parallel_shard=dp // rep,
                tensor_parallel=tp,
                expert_parallel=expert_parallel,
            )
        except ValueError as err:
            raise ValueError(
                f"{err} (tp_dp: data_parallel_size={dp} = data_parallel_replicate({rep}) *"
                f" data_parallel_shard({dp // rep}), tensor_parallel_size={tp}, world size = {layout})"
            ) from None

    def _check_with_pipeline(self, shard: int) -> None:
        pp, rep, tp, world = (
            self.pipeline_parallel,
            self.data_parallel_replicate,
            self.tensor_parallel,
            self.world_size,
        )
        if shard == -1:
            if world % (pp * rep * tp):
                raise ValueError(
                    f"pipeline_parallel({pp}) * data_parallel_replicate({rep}) * tensor_parallel({tp}) ="
                    f" {pp * rep * tp} does not divide world size ({world}); choose sizes whose product divides"
                    f" {world} (divisors: {format_choices(divisors(world))})"
                )
            shard = self.data_parallel_shard = world // (pp * rep * tp)
        if pp * rep * shard * tp != world:
            raise ValueError(
                f"pipeline_parallel({pp}) * data_parallel_replicate({rep}) * data_parallel_shard({shard}) *"
                f" tensor_parallel({tp}) = {pp * rep * shard * tp} != world size ({world}); the product of the"
                " parallel sizes must equal the number of ranks"
            )

    @classmethod
    def for_pipeline(
        cls,
        *,
        world_size: int,
        pipeline_parallel: int,
        data_parallel: Size = "auto",
        data_parallel_replicate: int = 1,
        tensor_parallel: int = 1,
        expert_parallel: int = 1,
    ) -> ParallelDims:
        """Dims for pipeline parallelism (outermost) x data parallelism (FSDP/HSDP) x tensor parallelism."""
        pp, tp, rep = pipeline_parallel, tensor_parallel, data_parallel_replicate
        if world_size % (pp * tp):
            raise ValueError(
                f"pipeline_parallel_size({pp}) * tensor_parallel_size({tp}) = {pp * tp} does not divide the world"
                f" size {world_size}; choose sizes whose product divides {world_size}"
                f" (divisors: {format_choices(divisors(world_size))})"
            )
        dp = world_size // (pp * tp) if data_parallel == "auto" else data_parallel
        if pp * dp * tp != world_size:
            raise ValueError(
                f"pipeline_parallel_size({pp}) * data_parallel_size({dp}) * tensor_parallel_size({tp}) ="
                f" {pp * dp * tp} != world size {world_size}; use data_parallel_size='auto' or"
                f" {world_size // (pp * tp)}"
            )
        if dp % rep:
            raise ValueError(
                f"data_parallel_replicate_size={rep} does not divide data_parallel_size={dp} (the data-parallel"
                f" ranks are replicate x shard); choose {format_choices(divisors(dp))}"
            )
        return cls(
            world_size=world_size,
            data_parallel_replicate=rep,
            data_parallel_shard=dp // rep,
            tensor_parallel=tp,
            pipeline_parallel=pp,
            pipeline_dim=True,
            expert_parallel=expert_parallel,
        )

    # --- sizes --------------------------------------------------------------------------------------------

    @property
    def data_parallel(self) -> int:
        """All data-parallel ranks: replicate x shard."""
        return self.data_parallel_replicate * self.data_parallel_shard

    @property
    def replicate_enabled(self) -> bool:
        return self.data_parallel_replicate > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tensor_parallel > 1

    @property
    def ep_enabled(self) -> bool:
        """MoE experts are split over an ``expert_parallel`` mesh dimension."""
        return self.expert_parallel > 1

    @property
    def expert_data_parallel(self) -> int:
        """Ranks that hold the same experts (FSDP shards them over these): data-parallel size / expert_parallel."""
        return self.data_parallel // self.expert_parallel

    @property
    def pp_enabled(self) -> bool:
        """The mesh has a ``pipeline_parallel`` dimension."""
        return self.pipeline_parallel > 1 or self.pipeline_dim

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.data_parallel_replicate, self.data_parallel_shard, self.tensor_parallel)

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        """Dimensions of the mesh :meth:`build_mesh` creates: ``(data_parallel, tensor_parallel)`` (as
        Lightning's ModelParallelStrategy) unless data parallelism is split into replicate x shard."""
        if self.ep_enabled:
            names: tuple[str, ...] = (EDP, EP, TP)
        else:
            names = (DP_REPLICATE, DP_SHARD, TP) if self.replicate_enabled else (DP, TP)
        return (PP, *names) if self.pp_enabled else names

    @property
    def fsdp_dim_names(self) -> tuple[str, ...]:
        """Mesh dimensions FSDP runs over: (replicate, shard) for HSDP, otherwise ``data_parallel``."""
        return (DP_REPLICATE, DP_SHARD) if self.replicate_enabled else (DP,)

    # --- the mesh -----------------------------------------------------------------------------------------

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Build the device mesh once and keep it (the only ``init_device_mesh`` call in the package).

        Without replication: 2-D ``(data_parallel, tensor_parallel)``. With replication: 3-D
        ``(data_parallel_replicate, data_parallel_shard, tensor_parallel)`` plus ``data_parallel``, the
        replicate and shard dimensions flattened. Unused dimensions have size 1, so lookups by name work.
        Needs an initialised default process group of ``world_size`` ranks. An equal mesh built earlier on the
        same default process group is reused (its sub-groups too) rather than built again.
        """
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if dist.is_initialized() and dist.get_world_size() != self.world_size:
            raise RuntimeError(
                f"ParallelDims(world_size={self.world_size}) does not match the process group's world size"
                f" {dist.get_world_size()}"
            )
        shared = _MESHES_BY_GROUP.setdefault(dist.group.WORLD, {}) if dist.is_initialized() else {}
        key = (
            self.shape,
            self.replicate_enabled,
            device_type,
            self.pipeline_parallel,
            self.pp_enabled,
            self.expert_parallel,
        )
        if key in shared:
            self._mesh = shared[key]
            return self._mesh
        if self.ep_enabled:
            mesh = self._build_expert_mesh(device_type)
        elif self.pp_enabled:
            mesh = self._build_pipeline_mesh(device_type)
        elif not self.replicate_enabled:
            mesh = init_device_mesh(
                device_type, (self.data_parallel, self.tensor_parallel), mesh_dim_names=(DP, TP)
            )
        else:
            mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=(DP_REPLICATE, DP_SHARD, TP))
            flatten_mesh(mesh[(DP_REPLICATE, DP_SHARD)], DP)
        self._mesh = shared[key] = mesh
        return mesh

    def _build_pipeline_mesh(self, device_type: str) -> DeviceMesh:
        from torch.distributed.device_mesh import init_device_mesh

        if not self.replicate_enabled:
            shape = (self.pipeline_parallel, self.data_parallel, self.tensor_parallel)
            return init_device_mesh(device_type, shape, mesh_dim_names=(PP, DP, TP))
        mesh = init_device_mesh(
            device_type,
            (self.pipeline_parallel, *self.shape),
            mesh_dim_names=(PP, DP_REPLICATE, DP_SHARD, TP),
        )
        flatten_mesh(mesh[(DP_REPLICATE, DP_SHARD)], DP)
        return mesh

    def _build_expert_mesh(self, device_type: str) -> DeviceMesh:
        """``([pipeline_parallel,] expert_data_parallel, expert_parallel, tensor_parallel)`` with
        ``data_parallel`` = (expert_data_parallel, expert_parallel) flattened: consecutive data-parallel ranks
        share experts' tokens (one all-to-all group), and data-parallel rank order is the plain one."""
        from torch.distributed.device_mesh import init_device_mesh

        names = self.mesh_dim_names
        sizes = {PP: self.pipeline_parallel, EDP: self.expert_data_parallel, EP: self.expert_parallel}
        shape = tuple(sizes.get(n, self.tensor_parallel) for n in names)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        flatten_mesh(mesh[(EDP, EP)], DP)
        return mesh

    @property
    def mesh(self) -> DeviceMesh:
        """The mesh :meth:`build_mesh` built."""
        if self._mesh is None:
            raise RuntimeError(
                "ParallelDims.mesh is not built yet: call build_mesh(device_type) once the process group exists"
            )
        return self._mesh

    def data_parallel_mesh(self) -> DeviceMesh:
        """The 1-D mesh of all data-parallel ranks (the flattened dimension when data parallelism is split)."""
        if self.ep_enabled:
            return flatten_mesh(self.mesh[(EDP, EP)], DP)
        if self.replicate_enabled:
            # flattening again returns the mesh flattened in build_mesh (slicing it from the root is deprecated)
            return flatten_mesh(self.mesh[(DP_REPLICATE, DP_SHARD)], DP)
        return self.mesh[DP]

    def fsdp_mesh(self) -> DeviceMesh:
        """The sub-mesh FSDP shards (1-D) or hybrid-shards (2-D: Replicate, Shard) over."""
        if self.ep_enabled:
            return self.data_parallel_mesh()
        names = self.fsdp_dim_names
        return self.mesh[names[0]] if len(names) == 1 else self.mesh[names]

    def expert_mesh(self) -> DeviceMesh:
        """The 1-D ``expert_parallel`` sub-mesh: the ranks one MoE layer's experts are split over (its
        all-to-all group)."""
        if not self.ep_enabled:
            raise RuntimeError(
                "expert_mesh(): expert_parallel is 1, the mesh has no expert_parallel dimension"
            )
        return self.mesh[EP]

    def expert_fsdp_mesh(self) -> DeviceMesh:
        """The 1-D ``expert_data_parallel`` sub-mesh FSDP shards the experts over (the ranks holding the same
        experts)."""
        if not self.ep_enabled:
            raise RuntimeError(
                "expert_fsdp_mesh(): expert_parallel is 1, the mesh has no expert_data_parallel dimension"
            )
        return self.mesh[EDP]

    def tp_mesh(self) -> DeviceMesh:
        """The 1-D tensor-parallel sub-mesh."""
        return self.mesh[TP]

    def sampler_kwargs(self) -> dict[str, Any]:
        """``DistributedSampler`` arguments: every data-parallel rank reads different samples."""
        return {"num_replicas": self.data_parallel, "rank": self.data_parallel_mesh().get_local_rank()}

    def describe(self) -> str:
        pp = f"pipeline_parallel={self.pipeline_parallel} x " if self.pp_enabled else ""
        ep = (
            f" (expert_parallel={self.expert_parallel} of them: expert_data_parallel={self.expert_data_parallel}"
            f" x expert_parallel={self.expert_parallel})"
            if self.ep_enabled
            else ""
        )
        return pp + (
            f"data_parallel_replicate={self.data_parallel_replicate} x data_parallel_shard="
            f"{self.data_parallel_shard}{ep} x tensor_parallel={self.tensor_parallel} (world size {self.world_size})"
        )
