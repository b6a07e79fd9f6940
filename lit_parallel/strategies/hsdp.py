"""HybridShardStrategy ("hsdp"): per-block FSDP2 sharded inside a node, replicated across nodes."""

from __future__ import annotations

import inspect
from typing import Any, Literal

from typing_extensions import override

from lit_parallel.parallel.mesh import ParallelDims
from lit_parallel.strategies.arguments import unknown_argument
from lit_parallel.strategies.fsdp import TransformerFSDPStrategy


class HybridShardStrategy(TransformerFSDPStrategy):
    """Per-block FSDP2 over a 2-D mesh ``(data_parallel_replicate, data_parallel_shard)``: parameters are
    sharded inside a node and replicated across nodes (HSDP); gradients are reduce-scattered inside the
    node and all-reduced across nodes. Every rank reads different data.

    Args:
        shard_size: ranks a parameter is sharded over. ``"auto"`` (default) = devices per node. An explicit
            size must divide the world size. With one replica (``shard_size`` = world size) this is
            ``fsdp_blocks``.
        **kwargs: as :class:`TransformerFSDPStrategy`.
    """

    strategy_name = "hsdp"

    def __init__(self, shard_size: Literal["auto"] | int = "auto", **kwargs: Any) -> None:
        if shard_size != "auto" and (
            not isinstance(shard_size, int) or isinstance(shard_size, bool) or shard_size < 1
        ):
            raise ValueError(
                f"shard_size={shard_size!r} must be 'auto' (devices per node) or a positive integer"
            )
        own = inspect.signature(TransformerFSDPStrategy.__init__).parameters
        for name, value in kwargs.items():
            if name not in own or name == "self":
                raise unknown_argument(type(self).__name__, name, value, [*own, "shard_size"][1:])
        if kwargs.get("expert_parallel_size", 1) != 1:
            raise ValueError(
                f"HybridShardStrategy(expert_parallel_size={kwargs['expert_parallel_size']!r}): expert parallelism"
                " borrows its ranks from one FSDP group and does not combine with replication across nodes yet;"
                " use fsdp_blocks (or tp_dp / pp_dp) with expert_parallel_size, or hsdp without it"
            )
        super().__init__(**kwargs)
        self._shard_size = shard_size

    @override
    def _parallel_dims(self) -> ParallelDims:
        shard = self.num_processes if self._shard_size == "auto" else self._shard_size
        return ParallelDims.for_hybrid_shard(self.num_nodes * self.num_processes, shard)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="Hybrid sharding: FSDP2 per block inside a node, replicated across nodes",
        )
