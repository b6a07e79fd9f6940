"""Tracing a transformer block's data flow for tensor-parallel plan inference (see
:mod:`lit_parallel.parallel.tensor_parallel.infer`).

The model runs once on a tiny input (on the meta device when it lives there) while a ``TorchFunctionMode``
records which layer's output reaches which layer's input, how column outputs are reshaped into heads and
split into chunks; :func:`simulate` then runs one rank's forward with local shapes on the meta device.
"""

from __future__ import annotations

import inspect
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lit_parallel._compat import tree_flatten, tree_map
from lit_parallel.parallel.example_inputs import call_with, hidden_states, token_ids
from lit_parallel.parallel.tensor_parallel.plan import in_features, is_projection

_TRACE_BATCH, _TRACE_SEQ = 2, 5  # a tiny made-up input: (batch, sequence) tokens


def is_norm(module: nn.Module) -> bool:
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        return True
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__.lower().endswith("norm")
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 1
        and not any(True for _ in module.children())
    )


@dataclass
class Flow:
    """What one forward showed: for every node (Linear, norm, block input/output), the nodes whose
    outputs reached its input, plus the reshapes and splits applied to Linear outputs."""

    inputs: dict[str, set[str]] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    views: dict[str, list[tuple[int, tuple[int, ...]]]] = field(default_factory=dict)
    splits: dict[str, list[int]] = field(default_factory=dict)
    block_args: dict[str, tuple[tuple, dict]] = field(default_factory=dict)
    block_out: dict[str, Any] = field(default_factory=dict)
    output: set[str] = field(default_factory=set)

    def consumers(self, node: str) -> set[str]:
        return {n for n, srcs in self.inputs.items() if node in srcs}


_SRC = "_lp_tp_sources"
_VIEW_OPS = {"view", "reshape", "unflatten"}
_SPLIT_OPS = {"split", "chunk", "tensor_split", "unbind", "split_with_sizes"}
_INPLACE_DUNDERS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ipow__"}


def _sources(obj: Any) -> set[str]:
    out: set[str] = set()
    for leaf in tree_flatten(obj)[0]:
        if isinstance(leaf, torch.Tensor):
            out |= getattr(leaf, _SRC, set())
    return out


class _FlowMode(TorchFunctionMode):
    """Propagates 'which node produced this' through every torch operation."""

    def __init__(self, flow: Flow, linears: set[str], states: set[int]):
        super().__init__()
        self.flow, self.linears, self.states = flow, linears, states

    def _tag(self, t: Any, srcs: set[str]) -> None:
        if isinstance(t, torch.Tensor) and id(t) not in self.states:
            setattr(t, _SRC, srcs)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        srcs = _sources((args, kwargs))
        if not srcs:
            return out
        name = getattr(func, "__name__", "")
        if (name.endswith("_") and not name.startswith("_")) or name in _INPLACE_DUNDERS:
            if args and isinstance(args[0], torch.Tensor):
                self._tag(args[0], srcs)
        for leaf in tree_flatten(out)[0]:
            self._tag(leaf, srcs)
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        owner = next(iter(srcs)) if len(srcs) == 1 else None
        if src is not None and owner in self.linears and src.dim() >= 1:
            if name in _VIEW_OPS and isinstance(out, torch.Tensor):
                factors = _trailing_factors(tuple(src.shape), tuple(out.shape))
                if factors is not None:
                    self.flow.views.setdefault(owner, []).append((src.shape[-1], factors))
            elif name in _SPLIT_OPS and isinstance(out, (tuple, list)) and owner not in self.flow.splits:
                dim_pos = 1 if name == "unbind" else 2
                dim = kwargs.get("dim", args[dim_pos] if len(args) > dim_pos else 0)
                if isinstance(dim, int) and dim % src.dim() == src.dim() - 1 and len(out) > 1:
                    self.flow.splits[owner] = [o.shape[-1] for o in out if isinstance(o, torch.Tensor)]
        return out


def _trailing_factors(src: tuple[int, ...], out: tuple[int, ...]) -> tuple[int, ...] | None:
    """``(b, t, F) -> (b, t, a, b)``: the factors the last dimension was split into (None if it wasn't)."""
    features = src[-1]
    for k in range(2, len(out) + 1):
        if tuple(out[:-k]) == tuple(src[:-1]) and math.prod(out[-k:]) == features:
            return tuple(out[-k:])
    return None


def _meta_copy(obj: Any) -> Any:
    return tree_map(lambda t: torch.empty_like(t, device="meta") if isinstance(t, torch.Tensor) else t, obj)


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a nest of tuples, lists, dicts (and registered pytree nodes such as model outputs)."""
    return [leaf for leaf in tree_flatten(obj)[0] if isinstance(leaf, torch.Tensor)]


def first_tensor(args: tuple, kwargs: dict) -> tuple[Any, Any] | None:
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            return ("arg", i)
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor):
            return ("kw", k)
    return None


class _FlowHooks:
    """Forward hooks that record where each Linear's, norm's and block's input came from."""

    def __init__(self, flow: Flow, mode: _FlowMode):
        self.flow, self.mode = flow, mode

    def pre(self, name: str, module: nn.Module, args: tuple) -> None:
        if args and isinstance(args[0], torch.Tensor):
            self.flow.inputs.setdefault(name, set()).update(getattr(args[0], _SRC, set()))

    def post(self, name: str, module: nn.Module, args: tuple, out: Any) -> None:
        if name not in self.flow.order:
            self.flow.order.append(name)
        self.mode._tag(out, {name})

    def block_pre(self, name: str, module: nn.Module, args: tuple, kwargs: dict):
        # the block's input gets a fresh alias tagged "<block>:in", so reads of the stream are seen
        where = first_tensor(args, kwargs)
        if where is None:
            return None
        kind, key = where
        x = args[key] if kind == "arg" else kwargs[key]
        self.flow.inputs.setdefault(f"{name}:in", set()).update(getattr(x, _SRC, set()))
        if name not in self.flow.block_args:
            self.flow.block_args[name] = (_meta_copy(args), _meta_copy(kwargs))
        alias = x.view_as(x)
        setattr(alias, _SRC, {f"{name}:in"})
        if kind == "arg":
            return args[:key] + (alias,) + args[key + 1 :], kwargs
        return args, {**kwargs, key: alias}

    def block_post(self, name: str, module: nn.Module, args: tuple, out: Any) -> None:
        self.flow.inputs.setdefault(f"{name}:out", set()).update(_sources(out))
        self.flow.block_out.setdefault(name, _meta_copy(out))
        for leaf in tree_flatten(out)[0]:
            self.mode._tag(leaf, {f"{name}:out"})

    def register(
        self, named: dict[str, nn.Module], nodes: set[str], blocks: list[str], handles: list
    ) -> None:
        """Hook every node and block, appending the handles to ``handles`` (removed by the caller)."""
        for name in sorted(nodes):
            handles.append(named[name].register_forward_pre_hook(partial(self.pre, name)))
            handles.append(named[name].register_forward_hook(partial(self.post, name)))
        for name in blocks:
            handles.append(
                named[name].register_forward_pre_hook(partial(self.block_pre, name), with_kwargs=True)
            )
            handles.append(named[name].register_forward_hook(partial(self.block_post, name)))


def _trace(
    model: nn.Module,
    blocks: list[tuple[str, nn.Module]],
    drive: Callable[[], Any],
) -> Flow:
    """Run ``drive()`` once and record the data flow between the model's Linears, norms and blocks."""
    flow = Flow()
    named = dict(model.named_modules())
    linears = {n for n, m in named.items() if is_projection(m)}
    norms = {n for n, m in named.items() if is_norm(m)}
    states = {id(t) for t in itertools.chain(model.parameters(), model.buffers())}
    mode = _FlowMode(flow, linears, states)
    handles: list = []
    try:
        _FlowHooks(flow, mode).register(named, linears | norms, [n for n, _ in blocks], handles)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), mode:
                out = drive()
            flow.output = _sources(out)
        finally:
            model.train(was_training)
    finally:
        for h in handles:
            h.remove()
    return flow


def _required_positional(fn: Callable) -> int | None:
    """Number of required positional parameters, or None when the signature takes ``*args``."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return None
    return sum(
        1 for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    )


def _owner_of(model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> str:
    """The deepest module that contains every block's container (GPT for ``model.h.0``, ``model.h.1``)."""
    parents = [name.rsplit(".", 2)[0] if name.count(".") >= 2 else "" for name, _ in blocks]
    common = parents[0].split(".") if parents[0] else []
    for p in parents[1:]:
        parts = p.split(".") if p else []
        n = 0
        while n < min(len(common), len(parts)) and common[n] == parts[n]:
            n += 1
        common = common[:n]
    return ".".join(common)


def _state_device(module: nn.Module) -> torch.device:
    return next(itertools.chain(module.parameters(), module.buffers()), torch.empty(0)).device


def block_width(block: nn.Module) -> int | None:
    for m in block.modules():
        if is_norm(m):
            return int(m.weight.shape[0])
        if is_projection(m):
            return in_features(m)
    return None


def auto_trace(
    model: nn.Module, blocks: list[tuple[str, nn.Module]], example_inputs: Any
) -> tuple[Flow | None, str]:
    """Trace with the user's example inputs, else with made-up tokens or activations; (None, why) if impossible."""
    named = dict(model.named_modules())
    if example_inputs is not None:
        try:
            flow = _trace(model, blocks, call_with(model, example_inputs))
        except Exception as err:  # noqa: BLE001 - any failure of user code means "no trace", said in the note
            return None, f"running the model on example_inputs failed: {type(err).__name__}: {err}"
        return flow, ""
    reasons = []
    owner_name = _owner_of(model, blocks)
    owner = named[owner_name]
    block_ids = {id(m) for _, b in blocks for m in b.modules()}
    embeddings = [m for m in owner.modules() if isinstance(m, nn.Embedding) and id(m) not in block_ids]
    device = _state_device(model)
    if embeddings and _required_positional(owner.forward) == 1:
        tokens = token_ids(_TRACE_BATCH, _TRACE_SEQ, device)
        try:
            return _trace(model, blocks, partial(owner, tokens)), ""
        except Exception as err:  # noqa: BLE001
            reasons.append(
                f"{owner_name or type(owner).__name__}(tokens) failed: {type(err).__name__}: {err}"
            )
    else:
        reasons.append(
            f"{owner_name or type(owner).__name__} does not look like a token model (one input, embeddings)"
        )
    first = blocks[0][1]
    width = block_width(first)
    if width is not None and _required_positional(first.forward) == 1:
        dtype = next((p.dtype for p in first.parameters() if p.is_floating_point()), torch.float32)

        def drive() -> Any:
            x = hidden_states(_TRACE_BATCH, _TRACE_SEQ, width, dtype, device)
            for _, block in blocks:
                x = block(x)
            return x

        try:
            return _trace(model, blocks, drive), ""
        except Exception as err:  # noqa: BLE001
            reasons.append(f"calling the blocks on ({_TRACE_BATCH}, {_TRACE_SEQ}, {width}) failed: {err}")
    else:
        reasons.append(f"{type(first).__name__}.forward needs more than one input")
    return None, "; ".join(reasons)


# --- simulated local forward (one rank, meta device) ----------------------------------------------------


class _LocalShapeError(RuntimeError):
    pass


def _local_embedding(n_out: int, dtype: torch.dtype, x: torch.Tensor) -> torch.Tensor:
    return torch.zeros(*x.shape, n_out, dtype=dtype, device=x.device)


def simulate(
    block_name: str,
    block: nn.Module,
    flow: Flow,
    local: Mapping[str, tuple[int, int]],
    attrs: Sequence[tuple[str, str, int, int]],
    root: nn.Module,
) -> None:
    """Run one block on meta tensors with each split Linear producing its local shape; raise on failure."""
    from torch.func import functional_call

    named = dict(root.named_modules())
    args, kwargs = flow.block_args[block_name]
    patched: list[tuple[nn.Module, Any]] = []

    def local_forward(path: str, n_in: int, n_out: int):
        def forward(x: torch.Tensor) -> torch.Tensor:
            if x.shape[-1] != n_in:
                raise _LocalShapeError(
                    f"{path} receives {x.shape[-1]} features per rank where the plan gives it {n_in}"
                )
            return x.new_zeros(*x.shape[:-1], n_out)

        return forward

    prefix = f"{block_name}." if block_name else ""
    old_attrs = []
    try:
        for path, (n_in, n_out) in local.items():
            m = named[path]
            patched.append((m, m.__dict__.get("forward")))
            if isinstance(m, nn.Embedding):  # split over its embedding dimension (one value per head)
                m.forward = partial(_local_embedding, n_out, m.weight.dtype)
            else:
                m.forward = local_forward(path[len(prefix) :], n_in, n_out)
        for path, attr, _, new in attrs:
            old_attrs.append((named[path], attr, getattr(named[path], attr)))
            setattr(named[path], attr, new)
        states = {
            n: torch.empty_like(t, device="meta")
            for n, t in itertools.chain(block.named_parameters(), block.named_buffers())
        }
        out = functional_call(block, states, _meta_copy(args), _meta_copy(kwargs), strict=False)
    finally:
        for m, fwd in patched:
            if fwd is None:
                m.__dict__.pop("forward", None)
            else:
                m.forward = fwd
        for m, attr, value in old_attrs:
            setattr(m, attr, value)
    # the stream (first output) must keep its shape; later outputs may be per head (T5's position
    # bias, attention weights) and so legitimately per rank
    got = [tuple(t.shape) for t in tensors_in(out)][:1]
    want = [tuple(t.shape) for t in tensors_in(flow.block_out[block_name])][:1]
    if got != want:
        raise _LocalShapeError(f"the block's output has shape {got} per rank instead of {want}")
