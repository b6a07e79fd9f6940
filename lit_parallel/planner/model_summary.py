"""What the advisor needs to know about a model: its parameters, its largest transformer block and an
activation estimate, from a built module, its class, or an import path (built on the meta device)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lit_parallel.parallel.blocks import BlockPlan, NoBlocksFoundError, find_transformer_blocks
from lit_parallel.parallel.example_inputs import NoExampleInput
from lit_parallel.parallel.expert_parallel import MoELayer, find_moe_layers
from lit_parallel.planner.activations import ActivationEstimate, estimate_activations


@dataclass(frozen=True)
class ModelSummary:
    """What the advisor needs to know about a model.

    Attributes:
        expert_params: elements of every expert weight of its MoE layers (0 without MoE layers).
        experts_per_layer: the number of experts of each MoE layer, in module order.
        largest_block_expert_params: of ``largest_block_params``, those that are experts.
        param_tensors: trainable parameter tensors (AdamW keeps a step counter for each).
        buffer_bytes: bytes of the persistent buffers (those in the state dict).
        module: the module measured (on the meta device when built from a class), for the per-tensor state
            formulas (:mod:`lit_parallel.planner.memory.rank_state`); not part of comparisons.
    """

    name: str
    params: int
    trainable_params: int
    largest_block_params: int | None = None
    block_params: int = 0
    num_blocks: int = 0
    block_description: str = ""
    activations: ActivationEstimate | None = None
    notes: tuple[str, ...] = ()
    expert_params: int = 0
    experts_per_layer: tuple[int, ...] = ()
    largest_block_expert_params: int = 0
    param_tensors: int = 0
    buffer_bytes: int = 0
    module: nn.Module | None = field(default=None, repr=False, compare=False)


def load_model_class(path: str) -> type:
    """``"package.module:Class"`` (or ``"package.module.Class"``) -> the class."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"model={path!r} must look like 'package.module:Class'")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(
            f"model={path!r}: cannot import {module_name!r} ({err}); is it on PYTHONPATH?"
        ) from err
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"model={path!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, nn.Module)) and not callable(obj):
        raise ValueError(f"model={path!r} is not an nn.Module class or a function that returns one")
    return obj


def build_on_meta(factory: Callable[..., nn.Module], kwargs: dict[str, Any] | None = None) -> nn.Module:
    """Build a model on the meta device (shapes only, no memory); runs ``configure_model`` if it has one."""
    _check_kwargs(factory, kwargs or {})
    with torch.device("meta"):
        try:
            module = factory(**(kwargs or {}))
        except TypeError as err:  # e.g. a value of the wrong type: one line, not a traceback
            name = getattr(factory, "__name__", str(factory))
            raise ValueError(f"building {name} with model_kwargs={kwargs or {}} failed: {err}") from err
        if not isinstance(module, nn.Module):
            raise ValueError(f"{factory!r} returned {type(module).__name__}, not an nn.Module")
        configure = getattr(module, "configure_model", None)
        if callable(configure):
            configure()
    return module


def _check_kwargs(factory: Callable[..., nn.Module], kwargs: dict[str, Any]) -> None:
    """A keyword ``factory`` does not take -> one line naming it, the closest accepted name and the rest."""
    import difflib
    import inspect

    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin without a signature: let the call decide
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    accepted = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for key in kwargs:
        if key not in accepted:
            close = difflib.get_close_matches(key, accepted, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            name = getattr(factory, "__name__", str(factory))
            raise ValueError(
                f"model_kwargs key {key!r} is not an argument of {name}; {hint}it takes"
                f" {', '.join(accepted) or 'no arguments'}"
            )


def _resolve(model: nn.Module | type | str, model_kwargs: dict[str, Any] | None) -> tuple[str, nn.Module]:
    """The model's name and the module to measure (a class or import path is built on meta)."""
    if isinstance(model, str):
        model = load_model_class(model)
    if isinstance(model, nn.Module):
        if model_kwargs:
            raise ValueError("model_kwargs= is for a class or import path, not a built module")
        return type(model).__name__, model
    if callable(model):
        return getattr(model, "__name__", str(model)), build_on_meta(model, model_kwargs)
    raise ValueError(f"model={model!r} must be an nn.Module, its class, or 'package.module:Class'")


def _try_estimate(
    module: nn.Module, plan: BlockPlan | None, notes: list[str], **kw: Any
) -> ActivationEstimate | None:
    """The activation estimate, or ``None`` with a note saying why there is none."""
    try:
        return estimate_activations(
            module, blocks=[m for _, m in plan.blocks] if plan is not None else (), **kw
        )
    except NoExampleInput as err:
        notes.append(str(err))
    except Exception as err:  # a model that cannot run on the meta device: say so, keep the rest
        notes.append(
            f"no activation estimate: tracing the forward on the meta device failed ({type(err).__name__}:"
            f" {err}); set example_input_array to an input the forward accepts"
        )
    return None


def summarize_model(
    model: nn.Module | type | str,
    *,
    precision: str = "bf16-mixed",
    batch_size: int | None = None,
    seq_len: int | None = None,
    model_kwargs: dict[str, Any] | None = None,
    example_inputs: Any = None,
    block_types: Any = "auto",
) -> ModelSummary:
    """Parameters, the largest transformer block and an activation estimate of ``model``.

    A class or import path is built on the meta device (no memory used). A built module is measured
    as it is; its forward for the activation estimate runs on meta-device stand-ins of its parameters.
    """
    name, module = _resolve(model, model_kwargs)
    notes: list[str] = []
    try:
        plan = find_transformer_blocks(module, block_types)
    except NoBlocksFoundError as err:
        plan = None
        notes.append(str(err).split(";")[0])
    activations = _try_estimate(
        module,
        plan,
        notes,
        precision=precision,
        batch_size=batch_size,
        seq_len=seq_len,
        example_inputs=example_inputs,
    )
    layers = _moe_layers(module, notes)
    largest = _largest_block(plan)
    return ModelSummary(
        name=name,
        params=sum(p.numel() for p in module.parameters()),
        trainable_params=sum(p.numel() for p in module.parameters() if p.requires_grad),
        largest_block_params=(
            max((n for sizes in plan.params_per_block().values() for n in sizes), default=None)
            if plan is not None
            else None
        ),
        block_params=plan.block_params if plan is not None else 0,
        num_blocks=plan.num_blocks if plan is not None else 0,
        block_description=plan.describe() if plan is not None else (notes[0] if notes else ""),
        activations=activations,
        notes=tuple(notes),
        expert_params=sum(layer.expert_numel for layer in layers),
        experts_per_layer=tuple(layer.num_experts for layer in layers),
        largest_block_expert_params=sum(
            layer.expert_numel for layer in layers if largest is not None and _inside(layer.module, largest)
        ),
        param_tensors=sum(1 for p in module.parameters() if p.requires_grad),
        buffer_bytes=sum(
            t.numel() * t.element_size()
            for t in module.state_dict(keep_vars=True).values()
            if t is not None and not isinstance(t, nn.Parameter)
        ),
        module=module,
    )


def _moe_layers(module: nn.Module, notes: list[str]) -> list[MoELayer]:
    """The model's MoE layers (as expert parallelism finds them), or none with a note saying why."""
    try:
        return find_moe_layers(module)
    except ValueError as err:  # experts already split by transformers' own expert parallelism
        notes.append(f"MoE layers not counted: {err}")
        return []


def _largest_block(plan: BlockPlan | None) -> nn.Module | None:
    """The block with the most parameters (the first of equals)."""
    if plan is None or not plan.blocks:
        return None
    return max((m for _, m in plan.blocks), key=lambda m: sum(p.numel() for p in m.parameters()))


def _inside(module: nn.Module, block: nn.Module) -> bool:
    return any(m is module for m in block.modules())


def shaped_input(shape: tuple[int, ...] | None) -> Any:
    """``batch -> a meta input of shape (batch, *shape)`` for ``--input-shape``; ``None`` without one."""
    if shape is None:
        return None
    return lambda batch: torch.empty((batch, *shape), device="meta")


def meta_model(path: str, kwargs: dict[str, Any]) -> tuple[str, nn.Module, list[str], str | None]:
    """The model built on meta, its blocks' names and the largest block's name."""
    from lit_parallel.parallel.blocks import NoBlocksFoundError, find_transformer_blocks

    factory = load_model_class(path)
    module = build_on_meta(factory, kwargs)
    try:
        plan = find_transformer_blocks(module, "auto")
    except NoBlocksFoundError:
        return getattr(factory, "__name__", path), module, [], None
    names = [n for n, _ in plan.blocks]
    largest = max(names, key=lambda n: sum(p.numel() for p in module.get_submodule(n).parameters()))
    return getattr(factory, "__name__", path), module, names, largest
