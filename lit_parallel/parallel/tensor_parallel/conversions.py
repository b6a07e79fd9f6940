"""Module conversions that make a model splittable by tensor parallelism, as data: one entry per family.

Some modules compute with a fused kernel that reads a packed weight whole, so tensor parallelism cannot
split them in place (torch's ``nn.MultiheadAttention`` and its packed ``in_proj_weight``). Before a plan
is inferred, :func:`convert_for_tensor_parallel` replaces each such module by an equivalent one built from
plain ``nn.Linear`` layers (the way ``SyncBatchNormConversion`` replaces BatchNorm), in place, with exact
copies of the weights. A new family is a new entry in :data:`CONVERSIONS`.

State dict keys of converted modules change (``self_attn.in_proj_weight`` becomes
``self_attn.q_proj.weight``, ``k_proj``, ``v_proj``); a converted module still loads the original keys,
and :func:`revert_tensor_parallel_conversions` converts an unsplit model back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from lit_parallel.nn.attention import SplittableMultiheadAttention


@dataclass(frozen=True)
class Conversion:
    """Replace every module of ``source`` type by ``convert(module)``.

    Attributes:
        source: the module type converted (subclasses too, unless already of the target type).
        target: the type it becomes.
        convert: builds the equivalent module; raises ``ValueError`` (with the reason) when it cannot.
        revert: builds the original module back from a converted one (``None``: no reverse conversion).
        after: called once on every module of the model after a conversion happened (fix-ups of parents
            that cached facts about the converted children).
    """

    source: type[nn.Module]
    target: type[nn.Module]
    convert: Callable[[nn.Module], nn.Module]
    revert: Callable[[nn.Module], nn.Module] | None = None
    after: Callable[[nn.Module], None] | None = None


def _no_nested_tensor_fast_path(module: nn.Module) -> None:
    # nn.TransformerEncoder decides at construction whether its eval fast path may turn inputs into nested
    # tensors, reading the packed attention weights; after the conversion that path does not apply.
    if isinstance(module, nn.TransformerEncoder) and isinstance(
        getattr(module.layers[0], "self_attn", None), SplittableMultiheadAttention
    ):
        module.use_nested_tensor = False


CONVERSIONS: list[Conversion] = [
    Conversion(
        source=nn.MultiheadAttention,
        target=SplittableMultiheadAttention,
        convert=SplittableMultiheadAttention.from_multihead_attention,
        revert=lambda m: m.to_multihead_attention(),
        after=_no_nested_tensor_fast_path,
    ),
]


def _replace(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name), child, new)


def convert_for_tensor_parallel(module: nn.Module, notes: list[str] | None = None) -> list[str]:
    """Convert, in place, the submodules tensor parallelism cannot split into equivalent ones; return
    their qualified names. ``notes`` receives one line per conversion kind, and one per module left as
    it is (with the reason)."""
    converted: list[str] = []
    for conv in CONVERSIONS:
        done, kept = [], []
        for name, m in list(module.named_modules()):
            if not isinstance(m, conv.source) or isinstance(m, conv.target):
                continue
            if not name:
                kept.append(f"the root module itself is a {conv.source.__name__}; wrap it in a module")
                continue
            try:
                _replace(module, name, conv.convert(m))
            except ValueError as err:
                kept.append(f"{name}: {err}")
                continue
            done.append(name)
        if done and conv.after is not None:
            for m in module.modules():
                conv.after(m)
        converted += done
        if notes is not None and done:
            shown = ", ".join(done) if len(done) <= 3 else f"{done[0]}, ... {done[-1]}"
            notes.append(
                f"converted {len(done)} {_qualname(conv.source)} to {conv.target.__name__} ({shown}) so"
                " that they can be split; their state dict keys change"
            )
        if notes is not None:
            notes += [f"not converted to {conv.target.__name__}, stays replicated: {why}" for why in kept]
    return converted


def revert_tensor_parallel_conversions(module: nn.Module) -> list[str]:
    """Undo :func:`convert_for_tensor_parallel` on a model that is not split (e.g. before exporting it);
    return the qualified names reverted."""
    reverted = []
    for conv in CONVERSIONS:
        if conv.revert is None:
            continue
        for name, m in list(module.named_modules()):
            if name and isinstance(m, conv.target):
                _replace(module, name, conv.revert(m))
                reverted.append(name)
    return reverted


def _qualname(cls: type) -> str:
    return f"nn.{cls.__name__}" if cls.__module__.startswith("torch.nn") else cls.__name__
