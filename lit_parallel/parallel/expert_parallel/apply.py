"""Splitting MoE layers over the ``expert_parallel`` ranks and routing their tokens there.

:func:`apply_expert_parallel` runs before FSDP (inside :func:`~lit_parallel.parallel.parallelize`):

- **stacked experts** (``[E, ...]`` weights): every expert weight becomes a DTensor ``Shard(0)`` over the
  expert-parallel mesh, so each rank keeps ``E / ep`` experts and checkpoints see the whole tensor (DCP
  saves, reshards to another ``ep`` and consolidates it like any sharded weight). The module's forward is
  wrapped: the (token, expert) pairs go to their experts' ranks (:func:`dispatch_combine`), the module's own
  forward runs there on its local experts (so every family's expert math is its own), and the weighted sum
  over the top-k happens back on the token's rank.
- **module lists** (an ``nn.ModuleList`` of experts and a router, hand-written code): the list keeps the
  local experts at their indices (state-dict keys ``experts.{i}...`` unchanged, each key on the ranks that
  hold expert ``i``) and a parameterless :class:`RemoteExpert` elsewhere. The layer's routing is its own
  code, so its forward runs twice on the same input and random state: first with stand-ins that record
  which rows each expert receives (and return zeros), then, after the exchange, with stand-ins that return
  the experts' real outputs. Everything the layer computes (its top-k, weights, auxiliary losses) comes
  from the second run, with gradients, exactly as in one process; the routing runs twice.

:func:`shard_experts` FSDP-shards the experts over ``expert_data_parallel`` (the ranks holding the same
experts). An expert's gradient sums the tokens of its ``expert_parallel`` ranks (through the all-to-all's
backward) and FSDP's reduce-scatter averages over ``expert_data_parallel``; the loss is the mean over all
``expert_data_parallel x expert_parallel`` data-parallel ranks, so the experts' weight gradients are scaled by
``1 / expert_parallel`` on the way (:class:`_GradScale` around the local experts: the rows' own gradients,
which travel back to the tokens, keep their size). FSDP's gradient divide factor would do it in the
reduce-scatter, but needs ``PREMUL_SUM``, which gloo lacks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from lit_parallel.parallel.expert_parallel.discovery import MoELayer, find_moe_layers
from lit_parallel.parallel.expert_parallel.dispatch import ExchangeStats, dispatch_combine
from lit_parallel.parallel.expert_parallel.families import NUM_EXPERTS_ATTRIBUTES

if TYPE_CHECKING:
    from lit_parallel.parallel.mesh import ParallelDims
    from lit_parallel.parallel.tensor_parallel import TPPlan

__all__ = [
    "ExpertParallelPlan",
    "RemoteExpert",
    "apply_expert_parallel",
    "expert_norm_group",
    "experts_sharded_first",
    "outside_experts",
    "without_expert_modules",
    "plan_expert_parallel",
    "shard_experts",
]

# The meshes module-list experts are FSDP-sharded over, by (dimension names, ranks), and the expert-parallel
# group their gradient norms are also summed over: the expert-parallel ranks hold different experts under
# meshes of the same shape (read by grad_norm through expert_norm_group; FSDP may replace the parameter
# objects, e.g. in module.to(), so nothing is attached to them).
_NORM_GROUPS: dict[tuple, dist.ProcessGroup] = {}


def _mesh_key(mesh: Any) -> tuple:
    from lit_parallel.parallel.mesh import mesh_group_ranks

    return (tuple(mesh.mesh_dim_names or ()), mesh_group_ranks(mesh))


def expert_norm_group(mesh: Any) -> dist.ProcessGroup | None:
    """For a gradient on ``mesh``: the expert-parallel group its norm must also be summed over (module-list
    experts), or ``None``."""
    if not _NORM_GROUPS:
        return None
    return _NORM_GROUPS.get(_mesh_key(mesh))


@dataclass
class ExpertParallelPlan:
    """The MoE layers of a model and how they are split: ``layers`` in module order, ``size`` ranks each,
    ``stats`` what this rank's layers exchanged (see :class:`ExchangeStats`)."""

    layers: list[MoELayer]
    size: int
    capacity_factor: float | None = None
    stats: ExchangeStats = field(default_factory=ExchangeStats)

    def describe(self) -> str:
        cap = (
            "no token dropped" if self.capacity_factor is None else f"capacity factor {self.capacity_factor}"
        )
        lines = [f"expert parallel over {self.size} ranks ({cap}): {len(self.layers)} MoE layer(s)"]
        lines += [f"  {layer.describe()}" for layer in self.layers]
        return "\n".join(lines)

    def summary(self) -> str:
        n = {layer.num_experts for layer in self.layers}
        each = f"{next(iter(n))} experts" if len(n) == 1 else "experts"
        return f"{len(self.layers)} MoE layers ({each} each) split over {self.size} expert-parallel ranks"


def plan_expert_parallel(
    module: nn.Module, size: int, *, capacity_factor: float | None = None, require_layers: bool = True
) -> ExpertParallelPlan:
    """Find the MoE layers and check ``size`` against them (before any process group): every layer's
    number of experts must be a multiple of ``size``, and ``size > 1`` needs at least one MoE layer (unless
    ``require_layers=False``: a pipeline stage of a model that has them elsewhere)."""
    if capacity_factor is not None and (
        isinstance(capacity_factor, bool)
        or not isinstance(capacity_factor, (int, float))
        or capacity_factor <= 0
    ):
        raise ValueError(
            f"expert_capacity_factor={capacity_factor!r} must be a positive number (each expert takes at most"
            " ceil(factor * pairs / experts) of a rank's pairs) or None (no pair is dropped: exact)"
        )
    layers = find_moe_layers(module)
    if size > 1 and not layers and require_layers:
        raise ValueError(
            f"expert_parallel_size={size}, but {type(module).__name__} has no MoE layer: none holds stacked"
            " expert weights ([num_experts, ...] tensors with a forward(hidden_states, top_k_index,"
            " top_k_weights), as transformers 5's *Experts modules) nor an nn.ModuleList of identical experts"
            " next to a router (a child named gate/router with one output per expert); use"
            " expert_parallel_size=1"
        )
    for layer in layers:
        if layer.num_experts % size:
            ok = [d for d in range(1, layer.num_experts + 1) if layer.num_experts % d == 0]
            raise ValueError(
                f"expert_parallel_size={size} does not divide the {layer.num_experts} experts of MoE layer"
                f" {layer.path!r}: every expert-parallel rank holds the same number of experts; choose one of"
                f" {ok} that also divides the data-parallel size"
            )
    return ExpertParallelPlan(layers, size, capacity_factor)


# --- stacked experts ------------------------------------------------------------------------------------


class _GradScale(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def _experts_grad_scaled(run: Any, rows: torch.Tensor, local: torch.Tensor, ep: int) -> torch.Tensor:
    """``run(rows, local)`` whose weight gradients are scaled by ``1 / ep`` and whose input gradients are not."""
    if ep == 1:
        return run(rows, local)
    return _GradScale.apply(run(_GradScale.apply(rows, float(ep)), local), 1.0 / ep)


class _StackedForward:
    """The forward of a stacked-experts module under expert parallelism (see the module docstring)."""

    def __init__(self, layer: MoELayer, group: dist.ProcessGroup, plan: ExpertParallelPlan):
        self.module = layer.module
        self.own = layer.module.forward  # the family's forward (bound method), run on the local experts
        self.num_experts = layer.num_experts
        self.group = group
        self.plan = plan
        self.ep = dist.get_world_size(group)
        self.names = [n for n, _ in layer.module.named_parameters(recurse=False)]
        self.count_attribute = next(a for a in NUM_EXPERTS_ATTRIBUTES if hasattr(layer.module, a))

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        tokens, k = top_k_index.shape
        y = dispatch_combine(
            hidden_states,
            top_k_index,
            self.num_experts,
            self.group,
            lambda got, local: _experts_grad_scaled(self._run_local, got, local, self.ep),
            pairs_per_row=k,
            capacity_factor=self.plan.capacity_factor,
            stats=self.plan.stats,
        )
        out = (y.view(tokens, k, -1) * top_k_weights.unsqueeze(-1).to(y.dtype)).sum(1)
        return out.to(hidden_states.dtype)

    def _run_local(self, rows: torch.Tensor, local_expert: torch.Tensor) -> torch.Tensor:
        """The family's own forward on the local experts: each received row to its expert, weight 1."""
        from torch.distributed.tensor import DTensor

        module = self.module
        saved = {n: module._parameters[n] for n in self.names}
        local = {n: p.to_local() if isinstance(p, DTensor) else p for n, p in saved.items()}
        saved_count = getattr(module, self.count_attribute)
        try:
            for n, t in local.items():
                module._parameters[n] = t  # type: ignore[assignment]  (a view; restored below)
            setattr(module, self.count_attribute, next(iter(local.values())).shape[0])
            ones = torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)
            y = self.own(rows, local_expert.unsqueeze(1), ones)
        finally:
            for n, p in saved.items():
                module._parameters[n] = p
            setattr(module, self.count_attribute, saved_count)
        # every local weight takes part in the graph (a zero term), so each has a gradient even when this
        # rank received no row for some expert: FSDP then reduce-scatters the same tensors on every rank
        return y + sum(t.sum() for t in local.values()) * 0


def _shard_stacked(layer: MoELayer, mesh: Any) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    module = layer.module
    for name, param in list(module.named_parameters(recurse=False)):
        dt = distribute_tensor(param.detach(), mesh, [Shard(0)], src_data_rank=None)
        module.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))


# --- module lists ---------------------------------------------------------------------------------------


class RemoteExpert(nn.Module):
    """Stands in a module list for an expert held by another expert-parallel rank (no parameters)."""

    def __init__(self, index: int, owner: int):
        super().__init__()
        self.index, self.owner = index, owner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"expert {self.index} lives on expert-parallel rank {self.owner}; under expert parallelism the MoE"
            " layer's forward reaches its experts only through the strategy's dispatch"
        )

    def extra_repr(self) -> str:
        return f"index={self.index}, owner=expert-parallel rank {self.owner}"


class _Stand(nn.Module):
    """What ``experts[i]`` is while the layer's own forward runs: records or replays expert ``i``'s calls."""

    def __init__(self, index: int, calls: _Calls):
        super().__init__()
        self.index = index
        object.__setattr__(self, "_calls", calls)  # not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._calls.call(self.index, x)


class _Calls:
    """Expert calls of one layer forward: recorded (inputs kept, zeros returned), then replayed (results)."""

    def __init__(self) -> None:
        self.replay = False
        self.inputs: list[tuple[int, torch.Tensor]] = []
        self.results: list[torch.Tensor] = []
        self.cursor = 0

    def call(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if not self.replay:
            self.inputs.append((index, x))
            return torch.zeros_like(x)
        if self.cursor >= len(self.inputs) or self.inputs[self.cursor][0] != index:
            raise RuntimeError(
                "an MoE layer called its experts differently in two runs of its forward on the same input and"
                " random state; expert parallelism runs a module-list layer's forward twice (routing, then"
                " the experts' results) and needs the same calls both times"
            )
        expected = self.inputs[self.cursor][1].shape
        if x.shape != expected:
            raise RuntimeError(
                f"expert {index} got an input of shape {tuple(x.shape)} where the routing run gave {tuple(expected)};"
                " the MoE layer's forward must call its experts alike on the same input and random state"
            )
        self.cursor += 1
        return self.results[self.cursor - 1]

    def rows(self, hidden: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every recorded input as rows ``[N, hidden]``, and each row's expert."""
        flat = [x.reshape(-1, hidden) for _, x in self.inputs] or [like.new_zeros(0, hidden)]
        experts = [
            torch.full((f.shape[0],), i, dtype=torch.long, device=like.device)
            for (i, _), f in zip(self.inputs, flat)
        ] or [torch.zeros(0, dtype=torch.long, device=like.device)]
        return torch.cat(flat), torch.cat(experts)

    def replay_with(self, y: torch.Tensor) -> None:
        """From now on, return the experts' outputs ``y`` (rows in recorded order), shaped as each call's input."""
        sizes = [x.reshape(-1, x.shape[-1]).shape[0] for _, x in self.inputs]
        parts = y.split(sizes) if self.inputs else []
        self.results = [p.reshape(*x.shape[:-1], p.shape[-1]) for p, (_, x) in zip(parts, self.inputs)]
        self.replay = True

    def check_all_replayed(self) -> None:
        if self.cursor != len(self.inputs):
            raise RuntimeError(
                f"an MoE layer called its experts {self.cursor} times in its second run and {len(self.inputs)}"
                " times in its first, on the same input and random state; expert parallelism needs the same"
                " calls both times"
            )


def _rng_states(device: torch.device) -> tuple:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_states(states: tuple, device: torch.device) -> None:
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state(states[1], device)


def _first_tensor(args: Iterable[Any]) -> torch.Tensor | None:
    """The layer's input (its first tensor argument): where the random state and new rows live."""
    return next((a for a in args if isinstance(a, torch.Tensor)), None)


class _ListForward:
    """The forward of a module-list MoE layer under expert parallelism (see the module docstring)."""

    def __init__(self, layer: MoELayer, group: dist.ProcessGroup, plan: ExpertParallelPlan):
        self.module = layer.module
        self.own = layer.module.forward
        self.name = layer.experts_name or ""
        self.num_experts = layer.num_experts
        self.group = group
        self.plan = plan
        self.ep = dist.get_world_size(group)
        self.per_rank = layer.num_experts // self.ep
        self.first = dist.get_rank(group) * self.per_rank

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        real = self.module._modules[self.name]
        x = _first_tensor([*args, *kwargs.values()])
        if x is None:
            raise TypeError(
                f"{type(self.module).__name__}.forward got no tensor: an MoE layer routes its input"
            )
        calls = _Calls()
        start = _rng_states(x.device)
        self.module._modules[self.name] = nn.ModuleList([_Stand(i, calls) for i in range(self.num_experts)])
        try:
            self.own(*args, **kwargs)  # the routing run: records each expert's rows
            after = _rng_states(x.device)
            rows, expert = calls.rows(x.shape[-1], x)
            y = dispatch_combine(
                rows,
                expert,
                self.num_experts,
                self.group,
                lambda got, local: _experts_grad_scaled(
                    lambda g, j: self._run_local(real, g, j), got, local, self.ep
                ),
                capacity_factor=self.plan.capacity_factor,
                stats=self.plan.stats,
            )
            calls.replay_with(y)
            _set_rng_states(start, x.device)
            out = self.own(*args, **kwargs)  # the computing run: the experts' outputs, with gradients
            calls.check_all_replayed()
            _set_rng_states(after, x.device)
        finally:
            self.module._modules[self.name] = real
        return out

    def _run_local(self, real: nn.ModuleList, rows: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """Every local expert runs on its received rows (also on none: each takes part in every backward, so
        FSDP reduces the same gradients on every rank)."""
        out: torch.Tensor | None = None
        for j in range(self.per_rank):
            index = torch.nonzero(local == j).squeeze(1)
            y = real[self.first + j](rows[index])
            if out is None:
                out = rows.new_zeros((rows.shape[0], *y.shape[1:]), dtype=y.dtype)
            out = out.index_copy(0, index, y)
        assert out is not None
        return out


def _split_list(layer: MoELayer, group: dist.ProcessGroup) -> None:
    experts = getattr(layer.module, layer.experts_name or "")
    ep, me = dist.get_world_size(group), dist.get_rank(group)
    per_rank = layer.num_experts // ep
    for i in range(layer.num_experts):
        owner = i // per_rank
        if owner != me:
            experts[i] = RemoteExpert(i, owner)


# --- the steps parallelize runs -------------------------------------------------------------------------


def apply_expert_parallel(plan: ExpertParallelPlan, mesh: Any) -> None:
    """Split every layer of ``plan`` over the 1-D expert-parallel ``mesh`` and route its tokens there.

    Every rank must hold the same weights beforehand (rank 0's, or the meta device): each keeps its
    experts without communicating."""
    group = mesh.get_group()
    for layer in plan.layers:
        if layer.kind == "stacked":
            forward = _StackedForward(layer, group, plan)
            _shard_stacked(layer, mesh)
        else:
            forward = _ListForward(layer, group, plan)
            _split_list(layer, group)
        layer.module.forward = forward  # an instance attribute: nn.Module.__call__ (and FSDP's hooks) use it


def local_expert_modules(layer: MoELayer) -> list[nn.Module]:
    """The modules FSDP shards for ``layer`` on this rank: the stacked module, or the local experts."""
    if layer.kind == "stacked":
        return [layer.module]
    experts = getattr(layer.module, layer.experts_name or "")
    return [e for e in experts if not isinstance(e, RemoteExpert)]


def shard_experts(
    plan: ExpertParallelPlan,
    block: nn.Module,
    fsdp_mesh: Any,
    expert_group: dist.ProcessGroup,
    data_parallel_size: int,
    **fsdp_kwargs: Any,
) -> None:
    """FSDP-shard the experts inside ``block`` over ``fsdp_mesh`` (``expert_data_parallel``), before
    ``block`` itself is sharded (``data_parallel_size``: checked against the meshes)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    ep = dist.get_world_size(expert_group)
    if fsdp_mesh.size() * ep != data_parallel_size:
        raise ValueError(
            f"expert_data_parallel ({fsdp_mesh.size()}) x expert_parallel ({ep}) != data-parallel size"
            f" ({data_parallel_size}): the expert meshes must split the data-parallel ranks"
        )
    inside = {id(m) for m in block.modules()}
    for layer in plan.layers:
        if id(layer.module) not in inside:
            continue
        for module in local_expert_modules(layer):
            if isinstance(module, FSDPModule):
                continue
            fully_shard(module, mesh=fsdp_mesh, **fsdp_kwargs)
            if layer.kind == "module_list":
                _NORM_GROUPS[_mesh_key(fsdp_mesh)] = expert_group


def experts_sharded_first(
    root: nn.Module,
    blocks: Iterable[nn.Module],
    plan: ExpertParallelPlan,
    dims: ParallelDims,
    fsdp_kwargs: dict[str, Any],
) -> Iterator[nn.Module]:
    """Yield ``blocks`` (FSDP shards each next) with their experts FSDP-sharded over ``expert_data_parallel``
    first; experts outside every block are sharded after the last block, before ``root``'s own group."""
    group = dims.expert_mesh().get_group()
    edp = dims.expert_fsdp_mesh()
    for block in blocks:
        shard_experts(plan, block, edp, group, dims.data_parallel, **fsdp_kwargs)
        yield block
    shard_experts(plan, root, edp, group, dims.data_parallel, **fsdp_kwargs)


def outside_experts(plan: ExpertParallelPlan, blocks: Iterable[nn.Module]) -> list[nn.Module]:
    """``blocks`` without the expert modules (and modules inside them): FSDP groups of their own already
    (:func:`shard_experts`), over the ranks that hold them."""
    inner: set[int] = set()
    for layer in plan.layers:
        if layer.kind == "stacked":
            inner.update(id(m) for m in layer.module.modules())
        else:
            inner.update(id(m) for m in getattr(layer.module, layer.experts_name or "").modules())
    return [b for b in blocks if id(b) not in inner]


def without_expert_modules(tp_plan: TPPlan, plan: ExpertParallelPlan) -> TPPlan:
    """``tp_plan`` without styles inside experts: expert parallelism splits those (attention and shared
    experts stay tensor-parallel)."""
    inside = []
    for layer in plan.layers:
        path = (
            layer.path
            if layer.kind == "stacked"
            else ".".join(p for p in (layer.path, layer.experts_name) if p)
        )
        inside.append(path)

    def kept(path: str) -> bool:
        return not any(path == p or path.startswith(p + ".") for p in inside)

    return dataclasses.replace(tp_plan, styles={p: s for p, s in tp_plan.styles.items() if kept(p)})
