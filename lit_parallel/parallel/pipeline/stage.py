"""Stage modules: run one pipeline stage of an unmodified model through the model's own ``forward``.

The model's code is not rewritten or traced. Every rank keeps the model object, pruned to the pieces of its
own stages (other blocks removed from the container, other embeddings/heads replaced by a :class:`_Skip`),
so parameter names and state-dict keys stay those of the whole model and checkpoints reshard freely. A
:class:`StageModule` runs ``model(*inputs)`` with only its stage's pieces in place:

- before its first block, a module another stage owns (the embeddings, on later stages) is a
  :class:`_Skip` that returns zeros of the right shape; the first block's input is then replaced by the
  activation received from the previous stage;
- after its last block (on stages before the last), the block's output is taken as the stage's output and
  the rest of ``forward`` does not run: the block's forward hook ends the model's ``forward`` there (an
  exception the stage catches), so a stage without the head allocates no logits at all.

Stages other than the first also receive the micro-batch's inputs from the previous stage (token ids are
small), so code in ``forward`` that reads them (shapes, masks) sees the real values. A module that would be
skipped where its output matters (a first stage reaching a module it does not own, or the last stage after its
blocks) raises an error naming it: the split put it on the wrong stage.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lit_parallel import _compat
from lit_parallel.parallel.pipeline.plan import PipelinePlan, StagePlan

__all__ = ["StageModule", "build_stage_modules"]


def _map_tensors(fn: Any, value: Any) -> Any:
    """``fn`` applied to every tensor in nested tuples, lists and dicts."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_map_tensors(fn, v) for v in value)
    if isinstance(value, dict):
        return {k: _map_tensors(fn, v) for k, v in value.items()}
    return value


# torch < 2.13 (_compat feature "pipelining_integer_tensors"): a stage asks for a gradient of every tensor it
# receives, which an integer tensor cannot have. The inputs later stages read travel as floating tensors: the
# same bytes reinterpreted (exact for every value), or converted to float32 for 1-byte types (exact too).
_SAME_BYTES = {8: torch.float64, 4: torch.float32, 2: torch.float16}


def _to_wire(value: Any) -> Any:
    if not isinstance(value, torch.Tensor) or value.is_floating_point() or value.is_complex():
        return value
    wire = _SAME_BYTES.get(value.element_size())
    return value.view(wire) if wire is not None else value.to(torch.float32)


def _from_wire(value: Any, dtype: torch.dtype | None) -> Any:
    if dtype is None or not isinstance(value, torch.Tensor) or value.dtype == dtype:
        return value
    value = value.detach()
    return value.view(dtype) if dtype.itemsize in _SAME_BYTES else value.to(dtype)


class _ZeroGradsForWire(torch.autograd.Function):
    """The activation unchanged; in backward, zero gradients for the inputs that came as floating tensors
    (torch < 2.13 sends a gradient back for every tensor a stage received)."""

    @staticmethod
    def forward(ctx: Any, activation: torch.Tensor, *wired: torch.Tensor) -> torch.Tensor:
        ctx.wired = [(w.shape, w.dtype, w.device) for w in wired]
        return activation.view_as(activation)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (grad, *(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.wired))


class _StageState:
    """What the stage now running needs to know inside the model's forward (one per rank)."""

    def __init__(self) -> None:
        self.stage: StageModule | None = None
        self.phase = "prefix"
        self.inject: torch.Tensor | None = None
        self.output: Any = None


class _StageDone(Exception):
    """Raised after a non-last stage's last block: the rest of the model's ``forward`` is not this stage's."""


class _Skip(nn.Module):
    """Stands in for a module another stage owns: returns zeros shaped like that module's output."""

    def __init__(self, name: str, real: nn.Module, state: _StageState) -> None:
        super().__init__()
        self._name = name
        self._state = state
        # a parameter-free copy on the meta device computes the output's shape and dtype, once per shape of
        # the input (every micro-batch has the same: running it again costs as much as the real module's
        # dispatch, more for ops that run decomposed on meta, such as BatchNorm)
        object.__setattr__(self, "_meta", copy.deepcopy(real).to("meta"))
        self._shapes: dict[Any, Any] = {}

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        state = self._state
        stage = state.stage
        legit = stage is not None and state.phase == "prefix" and not stage.plan.index == 0
        if not legit:
            where = stage.plan.index if stage is not None else "?"
            raise RuntimeError(
                f"pipeline stage {where} reached {self._name!r}, which another stage owns, in its {state.phase}"
                " part: the model's forward uses it where this stage needs its result. Put it on this stage"
                " with split=[...] or register it before/after the blocks in the order forward calls it"
            )
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
        key = _shape_key((args, kwargs))
        out = self._shapes.get(key) if key is not None else None
        if out is None:
            meta_args, meta_kwargs = _map_tensors(lambda t: t.to("meta"), (args, kwargs))
            with torch.no_grad():  # shapes only: no graph (and no saved tensors) kept for them
                out = self._meta(*meta_args, **meta_kwargs)
            if key is not None:
                self._shapes[key] = out
        return _map_tensors(lambda t: torch.zeros(t.shape, dtype=t.dtype, device=device), out)


def _shape_key(value: Any) -> Any:
    """What a skipped module's output shape depends on: its tensors' shapes and dtypes and the other
    arguments' values; ``None`` when an argument is neither a tensor nor a plain value (no caching)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, (tuple, list)):
        parts = tuple(_shape_key(v) for v in value)
        return None if any(p is None for p in parts) else (type(value).__name__, parts)
    if isinstance(value, dict):
        parts = tuple((k, _shape_key(v)) for k, v in value.items())
        return None if any(p[1] is None for p in parts) else ("dict", parts)
    if value is None or isinstance(value, (bool, int, float, str)):
        return ("value", type(value).__name__, value)
    return None


class StageModule(nn.Module):
    """One stage: its pieces as children (``parameters()`` are the stage's), ``forward`` runs the model.

    Input: the model's inputs (first stage) or ``(activation, *inputs)``. Output: ``(activation, *inputs)``,
    or on the last stage the model's output.
    """

    def __init__(
        self,
        model: nn.Module,
        plan: PipelinePlan,
        stage: StagePlan,
        skips: dict,
        state: _StageState,
    ):
        super().__init__()
        self.plan = stage
        self.is_last = stage.index == plan.num_stages - 1
        modules = dict(model.named_modules())
        for name in stage.pieces:
            self.add_module(name.replace(".", "__"), modules[name])
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_container", modules[plan.container] if plan.container else model)
        self._blocks = {name.rsplit(".", 1)[-1]: modules[name] for name in stage.blocks}
        object.__setattr__(self, "_first", modules[stage.blocks[0]])
        object.__setattr__(self, "_last", modules[stage.blocks[-1]])
        self._state = state
        # micro-batches whose activations this stage holds for backward (now, and the most since reset)
        self.in_flight = self.peak_in_flight = 0
        # the stage's MoE layers split over the expert-parallel ranks (parallelize_stages; None without)
        self.expert_plan: Any = None
        # the dtypes of the model's inputs (None for non-tensors), set before each step: on torch < 2.13 the
        # integer ones reach later stages as floating tensors and are read back as these
        self.input_dtypes: tuple[torch.dtype | None, ...] = ()
        # non-block pieces of the whole model: (parent, attribute, the real module, its skip)
        self._others = skips

    @contextmanager
    def _in_place(self) -> Iterator[None]:
        """The model holds exactly this stage's pieces while the stage runs."""
        container = self._container
        saved_blocks = container._modules
        saved = {}
        for name, (parent, attr, real, skip) in self._others.items():
            saved[name] = parent._modules[attr]
            parent._modules[attr] = real if name in self.plan.pieces else skip
        container._modules = dict(self._blocks)
        try:
            yield
        finally:
            container._modules = saved_blocks
            for name, (parent, attr, _, _) in self._others.items():
                parent._modules[attr] = saved[name]

    def forward(self, *args: Any) -> Any:
        state = self._state
        first = self.plan.index == 0
        inputs = args if first else args[1:]
        state.stage, state.phase, state.output = self, "prefix", None
        state.inject = None if first else args[0]
        out = None
        wire = not _compat.has_feature("pipelining_integer_tensors")
        if wire and not first and len(self.input_dtypes) == len(inputs):
            wired = [w for w, d in zip(inputs, self.input_dtypes) if d is not None and w.dtype != d]
            inputs = tuple(_from_wire(w, d) for w, d in zip(inputs, self.input_dtypes))
            if wired and isinstance(args[0], torch.Tensor):
                state.inject = _ZeroGradsForWire.apply(args[0], *wired)
        try:
            with self._in_place():
                out = self._model(*inputs)
        except _StageDone:
            pass  # a stage before the last: its output is its last block's (state.output)
        finally:
            state.stage = None
        if wire and not self.is_last:
            _compat.log_degraded("pipelining_integer_tensors")
            inputs = tuple(_to_wire(i) for i in inputs)
        result = out if self.is_last else (state.output, *inputs)
        self._count_in_flight(out if self.is_last else state.output)
        return result

    def _count_in_flight(self, output: Any) -> None:
        """A micro-batch is in flight from its forward until backward reaches its output."""
        if not (torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad):
            return
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)

        def done(grad: torch.Tensor) -> None:
            self.in_flight -= 1

        output.register_hook(done)

    def reset_counters(self) -> None:
        self.in_flight = self.peak_in_flight = 0

    def _pre_hook(self, block: nn.Module, args: tuple) -> tuple | None:
        state = self._state
        if state.stage is not self or block is not self._first:
            return None
        state.phase = "blocks"
        if state.inject is not None:
            return (state.inject, *args[1:])
        return None

    def _post_hook(self, block: nn.Module, args: tuple, output: Any) -> None:
        state = self._state
        if state.stage is self and block is self._last:
            state.phase = "suffix"
            state.output = output
            if not self.is_last:
                # after FSDP's post-forward (registered first); nothing after this block is this stage's
                raise _StageDone

    def register_hooks(self) -> None:
        """Call after FSDP: the input swap runs before FSDP's pre-forward, the capture after its post-forward."""
        for block in {id(self._first): self._first, id(self._last): self._last}.values():
            block.register_forward_pre_hook(self._pre_hook, prepend=True)
            block.register_forward_hook(self._post_hook)


def build_stage_modules(model: nn.Module, plan: PipelinePlan, pp_rank: int) -> list[StageModule]:
    """Prune ``model`` in place to the pieces of ``pp_rank``'s stages and return one module per stage."""
    state = _StageState()
    modules = dict(model.named_modules())
    mine = plan.stages_of(pp_rank)
    kept = {p for s in mine for p in s.pieces}
    others: dict[str, tuple] = {}
    for stage in plan.stages:
        for name in [*stage.prefix, *stage.suffix]:
            parent_name, _, attr = name.rpartition(".")
            parent = modules[parent_name] if parent_name else model
            real = modules[name]
            skip = _Skip(name, real, state)
            others[name] = (parent, attr, real if name in kept else skip, skip)
            if name not in kept:
                parent._modules[attr] = skip  # free the pieces of other ranks' stages
    container = modules[plan.container] if plan.container else model
    container._modules = {
        k: m for k, m in container._modules.items() if f"{plan.container}.{k}".lstrip(".") in kept
    }
    return [StageModule(model, plan, stage, others, state) for stage in mine]
