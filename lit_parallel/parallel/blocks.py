"""Finding the transformer blocks of any ``nn.Module``.

A transformer block is recognised structurally, not by name: it is a module with parameterised children
that appears at least twice among the siblings of a ``ModuleList``, ``Sequential`` or ``ModuleDict``,
and the blocks together hold most of the model's parameters. That covers ``nn.TransformerEncoder`` /
``nn.TransformerDecoder`` layers, GPT/Llama/ViT blocks written by users, and models with several block
kinds (encoder + decoder) without anyone registering a class.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from torch import nn

BlockTypes = str | Iterable[type | str] | Callable[[nn.Module], bool]

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


class NoBlocksFoundError(ValueError):
    """No transformer blocks were found; the message says what was searched and how to pass them."""


@dataclass
class BlockPlan:
    """The blocks found in a module.

    Attributes:
        blocks: ``(qualified name, module)`` of every block, in module order; never nested in each other.
        block_types: the classes of the blocks, in order of first appearance.
        total_params: parameters of the whole module (shared parameters counted once).
        how: how the blocks were chosen (``"auto"``, ``"classes"`` or ``"predicate"``).
    """

    blocks: list[tuple[str, nn.Module]]
    block_types: tuple[type, ...]
    total_params: int
    how: str = "auto"
    _block_params: dict[str, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._block_params = {name: _num_params(m) for name, m in self.blocks}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def block_params(self) -> int:
        """Parameters inside blocks."""
        return sum(self._block_params.values())

    @property
    def rest_params(self) -> int:
        """Parameters outside blocks (embeddings, final norm, heads): sharded as one root group."""
        return self.total_params - self.block_params

    @property
    def block_fraction(self) -> float:
        return self.block_params / self.total_params if self.total_params else 0.0

    def params_per_block(self) -> dict[str, list[int]]:
        """Class name -> parameter count of each block of that class."""
        out: dict[str, list[int]] = {}
        for name, module in self.blocks:
            out.setdefault(type(module).__name__, []).append(self._block_params[name])
        return out

    def counts(self) -> list[str]:
        """One ``"2 x GPTBlock (12,704 params each)"`` per block class."""
        parts = []
        for cls_name, sizes in self.params_per_block().items():
            per = f"{sizes[0]:,}" if len(set(sizes)) == 1 else f"{min(sizes):,}-{max(sizes):,}"
            parts.append(f"{len(sizes)} x {cls_name} ({per} params each)")
        return parts

    def describe(self) -> str:
        return (
            f"{self.num_blocks} blocks: {', '.join(self.counts())}; {self.block_fraction:.0%} of {self.total_params:,}"
            f" params in blocks, {self.rest_params:,} outside (root group)"
        )


def _num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _has_parameterised_children(module: nn.Module) -> bool:
    return any(True for child in module.children() for _ in child.parameters())


def _outermost(named: Iterable[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Drop every module that lies inside another module of the list (names are qualified names)."""
    kept: list[tuple[str, nn.Module]] = []
    for name, module in sorted(named, key=lambda item: item[0].count(".") if item[0] else -1):
        if any(name == k or name.startswith(k + ".") or k == "" for k, _ in kept):
            continue
        kept.append((name, module))
    return kept


def _repeated_siblings(root: nn.Module) -> dict[type, list[tuple[str, nn.Module]]]:
    """Class -> instances that have at least one sibling of the same class in a container."""
    found: dict[type, dict[str, nn.Module]] = {}
    for name, container in root.named_modules():
        if not isinstance(container, _CONTAINERS):
            continue
        by_cls: dict[type, list[tuple[str, nn.Module]]] = {}
        for child_name, child in container.named_children():
            by_cls.setdefault(type(child), []).append((f"{name}.{child_name}" if name else child_name, child))
        for cls, members in by_cls.items():
            if len(members) < 2 or isinstance(members[0][1], _CONTAINERS):
                continue
            if not _has_parameterised_children(members[0][1]):
                continue  # a leaf (Linear, Embedding, ...) is not a block
            found.setdefault(cls, {}).update(members)
    return {cls: list(members.items()) for cls, members in found.items()}


def _auto_blocks(root: nn.Module, total: int, min_fraction: float) -> tuple[list[tuple[str, nn.Module]], str]:
    candidates = _repeated_siblings(root)
    if not candidates:
        return [], "no container holds two or more sibling modules of one class with parameterised children"
    everything = [item for members in candidates.values() for item in members]

    def inside(name: str, outer: str) -> bool:
        return outer == "" or name.startswith(outer + ".")

    def refine(selection: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
        # Split a block into the repeated blocks inside it when those hold most of its parameters
        # (stages made of layers); stay put when they don't (attention heads inside a layer).
        out = []
        for name, module in selection:
            inner = _outermost((n, m) for n, m in everything if n != name and inside(n, name))
            inner_params = sum(_num_params(m) for _, m in inner)
            if inner and inner_params >= 0.5 * _num_params(module):
                out.extend(refine(inner))
            else:
                out.append((name, module))
        return out

    blocks = refine(_outermost(everything))
    order = {name: i for i, (name, _) in enumerate(root.named_modules())}
    blocks.sort(key=lambda item: order[item[0]])
    covered = sum(_num_params(m) for _, m in blocks)
    if total and covered < min_fraction * total:
        names = sorted({type(m).__name__ for _, m in blocks})
        return [], (
            f"the repeated modules found ({', '.join(names)}) hold {covered:,} of {total:,} parameters"
            f" ({covered / total:.0%}), less than min_fraction={min_fraction:g}"
        )
    return blocks, ""


def _resolve_class_names(spec: Iterable[type | str], root: nn.Module) -> tuple[set[type], set[str]]:
    classes: set[type] = set()
    names: set[str] = set()
    for item in spec:
        if isinstance(item, type):
            if not issubclass(item, nn.Module):
                raise TypeError(f"block_types entry {item!r} is not an nn.Module subclass")
            classes.add(item)
        elif isinstance(item, str):
            if "." in item:  # an import path: "my_pkg.model.Block"
                module_name, _, attr = item.rpartition(".")
                try:
                    classes.add(getattr(importlib.import_module(module_name), attr))
                except (ImportError, AttributeError) as err:
                    raise ValueError(f"block_types entry {item!r} cannot be imported: {err}") from err
            else:
                names.add(item)
        else:
            raise TypeError(
                f"block_types entries must be classes or class names, got {type(item).__name__}: {item!r}"
            )
    return classes, names


def find_transformer_blocks(
    module: nn.Module, block_types: BlockTypes = "auto", *, min_fraction: float = 0.5
) -> BlockPlan:
    """Find the transformer blocks of ``module``.

    Args:
        module: any module (a LightningModule works too).
        block_types: ``"auto"`` (repeated sibling modules of one class in a ``ModuleList``/``Sequential``/
            ``ModuleDict`` that hold at least ``min_fraction`` of the parameters; blocks made of repeated
            blocks are split into those), a collection of classes, class names (``"GPTBlock"``) or import
            paths (``"pkg.model.GPTBlock"``), or a predicate ``fn(module) -> bool``. Matches nested inside
            another match are ignored (the outer one is the block).
        min_fraction: with ``"auto"``, the smallest share of parameters the blocks must hold.

    Raises:
        NoBlocksFoundError: nothing matched; the message says what was searched and how to pass blocks.
    """
    total = sum(p.numel() for p in module.parameters())
    if isinstance(block_types, str) and block_types == "auto":
        blocks, how = _blocks_auto(module, total, min_fraction), "auto"
    elif callable(block_types) and not isinstance(block_types, type):
        blocks, how = _blocks_by_predicate(module, block_types), "predicate"
    else:
        blocks, how = _blocks_by_class(module, block_types), "classes"
    order = {name: i for i, (name, _) in enumerate(module.named_modules())}
    blocks.sort(key=lambda item: order[item[0]])
    types: list[type] = []
    for _, m in blocks:
        if type(m) not in types:
            types.append(type(m))
    return BlockPlan(blocks=blocks, block_types=tuple(types), total_params=total, how=how)


_HINT = (
    "pass the block classes explicitly, e.g. block_types={MyBlock} (or class names: block_types="
    "{'MyBlock'}), or a predicate block_types=lambda m: isinstance(m, MyBlock)"
)


def _blocks_auto(module: nn.Module, total: int, min_fraction: float) -> list[tuple[str, nn.Module]]:
    blocks, why = _auto_blocks(module, total, min_fraction)
    if not blocks:
        raise NoBlocksFoundError(
            f"block_types='auto' found no transformer blocks in {type(module).__name__} ({total:,} parameters):"
            f" searched every nn.ModuleList / nn.Sequential / nn.ModuleDict for two or more sibling"
            f" modules of one class that have parameterised children; {why}. To shard it anyway, {_HINT}."
        )
    return blocks


def _blocks_by_predicate(
    module: nn.Module, predicate: Callable[[nn.Module], bool]
) -> list[tuple[str, nn.Module]]:
    blocks = _outermost((n, m) for n, m in module.named_modules() if n and predicate(m))
    if not blocks:
        raise NoBlocksFoundError(
            f"the block_types predicate matched no submodule of {type(module).__name__}; check it against"
            f" the classes present: {_present_classes(module)}"
        )
    return blocks


def _blocks_by_class(module: nn.Module, block_types: BlockTypes) -> list[tuple[str, nn.Module]]:
    if isinstance(block_types, (str, type)):
        block_types = [block_types]
    classes, names = _resolve_class_names(block_types, module)
    matches = [
        (n, m)
        for n, m in module.named_modules()
        if n and (isinstance(m, tuple(classes)) or type(m).__name__ in names)
    ]
    blocks = _outermost(matches)
    if not blocks:
        wanted = sorted([c.__name__ for c in classes] + sorted(names))
        raise NoBlocksFoundError(
            f"block_types={{{', '.join(wanted)}}} names no module in {type(module).__name__}; the classes present"
            f" are: {_present_classes(module)}. Pass one of them, or block_types='auto'."
        )
    return blocks


def _present_classes(module: nn.Module) -> str:
    counts: dict[str, int] = {}
    for name, m in module.named_modules():
        if name and any(True for _ in m.parameters()):
            counts[type(m).__name__] = counts.get(type(m).__name__, 0) + 1
    return ", ".join(f"{k} (x{v})" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])[:12])
