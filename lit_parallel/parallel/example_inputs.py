"""Made-up inputs for a module the user gave no input for: the one place that decides what a model is run on
when it is only measured (the advisor's activation estimate) or traced (tensor-parallel plan inference).

The choices, in order: the user's own input (``example_inputs=``, or a LightningModule's
``example_input_array``); token ids when the model starts with an ``nn.Embedding``, as long as its
configured sequence length; activations of a block's width fed to the blocks directly. Inputs for a
forward on the meta device are meta tensors: shapes only, no memory.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

# where models keep their context length (nanoGPT, LLaMA-style configs, Hugging Face configs, ...)
SEQ_ATTRIBUTES = (
    "block_size",
    "max_seq_len",
    "max_position_embeddings",
    "n_positions",
    "seq_len",
    "context_length",
)


class NoExampleInput(ValueError):
    """No input can be made up for the module; the message says what to set."""


@dataclass(frozen=True)
class ExampleInput:
    """Positional arguments for one forward, what they are in words, and their batch size."""

    args: tuple
    description: str
    batch_size: int


def as_args(example: Any) -> tuple:
    """A single input or a tuple of inputs -> the positional arguments of a forward."""
    return example if isinstance(example, tuple) else (example,)


def batch_size_of(args: tuple) -> int:
    """The leading dimension of the first tensor with one (1 when there is none)."""
    return next((a.shape[0] for a in args if isinstance(a, torch.Tensor) and a.dim()), 1)


def to_meta(t: Any, dtype: torch.dtype | None = None) -> Any:
    """A meta tensor of ``t``'s shape (floating tensors cast to ``dtype`` when given); non-tensors as they are."""
    if not isinstance(t, torch.Tensor):
        return t
    if dtype is not None and t.is_floating_point():
        return torch.empty(t.shape, dtype=dtype, device="meta")
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def resize_batch(t: Any, batch_size: int) -> Any:
    """A meta tensor like ``t`` with leading dimension ``batch_size`` (scalars and non-tensors as they are)."""
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        return t
    return torch.empty((batch_size, *t.shape[1:]), dtype=t.dtype, device="meta")


def find_seq_len(module: nn.Module) -> int | None:
    """The sequence length the model is configured for (``block_size``, ``max_seq_len``, ...), if it says."""
    holders = [module]
    for attr in ("cfg", "config", "hparams", "model"):
        holders.append(getattr(module, attr, None))
        holders.append(getattr(getattr(module, "model", None), attr, None))
    for holder in holders:
        for attr in SEQ_ATTRIBUTES:
            if holder is None:
                continue
            value = holder.get(attr) if isinstance(holder, dict) else getattr(holder, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def token_ids(batch_size: int, seq_len: int, device: torch.device | str) -> torch.Tensor:
    """Token ids of shape ``(batch_size, seq_len)``: id 1 is in every vocabulary."""
    return torch.ones(batch_size, seq_len, dtype=torch.long, device=device)


def hidden_states(
    batch_size: int, seq_len: int, width: int, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """Hidden states of shape ``(batch_size, seq_len, width)``, the input of a transformer block."""
    return torch.zeros(batch_size, seq_len, width, dtype=dtype, device=device)


def first_parametrised_leaf(module: nn.Module) -> nn.Module | None:
    """The first module without children that holds parameters (the model's input layer)."""
    return next(
        (m for m in module.modules() if not list(m.children()) and any(True for _ in m.parameters(False))),
        None,
    )


def meta_example_input(
    module: nn.Module, *, batch_size: int | None = None, seq_len: int | None = None, given: Any = None
) -> ExampleInput:
    """One micro-batch of input for ``module``'s forward on the meta device.

    ``given`` wins; then ``module.example_input_array`` (resized to ``batch_size``); then tokens of
    ``seq_len`` (default: :func:`find_seq_len`) when the model starts with an ``nn.Embedding``.

    Raises:
        NoExampleInput: none of these applies.
    """
    if given is not None:
        args = as_args(given)
        return ExampleInput(tuple(to_meta(a) for a in args), "given example inputs", batch_size_of(args))
    example = getattr(module, "example_input_array", None)
    if example is not None:
        return _from_example_array(as_args(example), batch_size)
    if isinstance(first_parametrised_leaf(module), nn.Embedding):
        length = seq_len or find_seq_len(module)
        if length is None:
            raise NoExampleInput(
                "no activation estimate: the model reads tokens but its sequence length is unknown; pass"
                " seq_len (--seq-len) or set example_input_array"
            )
        b = batch_size or 1
        args = token_inputs(module, b, length)
        n = sum(isinstance(a, torch.Tensor) for a in args)
        return ExampleInput(args, f"tokens ({b}, {length})" + (f" x{n}" if n > 1 else ""), b)
    raise NoExampleInput(
        "no activation estimate: set example_input_array on the model (one micro-batch of input)"
    )


def token_inputs(module: nn.Module, batch_size: int, seq_len: int) -> tuple:
    """Positional arguments of ``module.forward`` for a token model: token ids for every argument it
    requires (``forward(src, tgt)``), and for ``decoder_input_ids`` when its config says it is an
    encoder-decoder (Hugging Face T5, BART, ...: optional in the signature, needed by the decoder); the
    arguments between them keep their defaults. Just one tensor of ids when nothing is required."""
    try:
        sig = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return (token_ids(batch_size, seq_len, "meta"),)
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = [p for p in sig.parameters.values() if p.kind in kinds]
    needed = {p.name for p in params if p.default is inspect.Parameter.empty}
    if getattr(getattr(module, "config", None), "is_encoder_decoder", False):
        needed.add("decoder_input_ids")
    if params:
        needed.add(params[0].name)  # the ids themselves
    last = max((i for i, p in enumerate(params) if p.name in needed), default=-1)
    if last < 0:
        return (token_ids(batch_size, seq_len, "meta"),)
    return tuple(
        token_ids(batch_size, seq_len, "meta") if p.name in needed else p.default for p in params[: last + 1]
    )


def _from_example_array(args: tuple, batch_size: int | None) -> ExampleInput:
    b = batch_size_of(args)
    if batch_size is not None and batch_size != b:
        args = tuple(resize_batch(a, batch_size) for a in args)
        b = batch_size
    shapes = ", ".join(str(tuple(a.shape)) for a in args if isinstance(a, torch.Tensor))
    return ExampleInput(tuple(to_meta(a) for a in args), f"example_input_array {shapes}", b)


def call_with(model: nn.Module, example_inputs: Any) -> Callable[[], Any]:
    """A zero-argument call of ``model`` on the user's inputs: a function ``f(model)``, a tuple of
    positional arguments, a dict of keyword arguments, or one input."""
    if callable(example_inputs):
        return partial(example_inputs, model)
    if isinstance(example_inputs, tuple):
        return partial(model, *example_inputs)
    if isinstance(example_inputs, dict):
        return partial(model, **example_inputs)
    return partial(model, example_inputs)


def real_inputs(example_args: tuple, vocab: int | None) -> tuple:
    """Real CPU tensors shaped like the (meta) example input: token ids below ``vocab``, floats random."""
    out = []
    g = torch.Generator().manual_seed(0)
    for a in example_args:
        if not isinstance(a, torch.Tensor):
            out.append(a)
        elif a.is_floating_point():
            out.append(torch.randn(a.shape, generator=g))
        else:
            out.append(torch.randint(0, max(2, vocab or 2), a.shape, generator=g, dtype=a.dtype))
    return tuple(out)


def vocabulary(module: nn.Module) -> int | None:
    """The first embedding's number of rows (token ids must stay below it)."""
    emb = next((m for m in module.modules() if isinstance(m, nn.Embedding)), None)
    return emb.num_embeddings if emb is not None else None
