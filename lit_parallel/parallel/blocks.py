"""Finding the blocks (FSDP groups) of any ``nn.Module``.

A block is recognised structurally, not by name: it is a module with parameterised children that appears
at least twice among the siblings of a ``ModuleList``, ``Sequential`` or ``ModuleDict``, and the blocks
together hold most of the model's parameters. That covers ``nn.TransformerEncoder`` /
``nn.TransformerDecoder`` layers, GPT/Llama/ViT blocks written by users, residual blocks or CNN stages
written as ``nn.Sequential``, and models with several block kinds (encoder + decoder) without anyone
registering a class. A model without such blocks (a plain MLP) is split into size-based groups instead,
like FSDP1's ``size_based_auto_wrap_policy``, so every model can be sharded.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lit_parallel.parallel.expert_parallel.discovery import find_moe_layers

BlockTypes = str | Iterable[type | str] | Callable[[nn.Module], bool]

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
# containers without a forward of their own: fully_shard refuses them (it hooks a module's forward)
_NO_FORWARD = (nn.ModuleList, nn.ModuleDict)


class NoBlocksFoundError(ValueError):
    """No transformer blocks were found; the message says what was searched and how to pass them."""


@dataclass
class BlockPlan:
    """The blocks found in a module.

    Attributes:
        blocks: ``(qualified name, module)`` of every block, in module order; never nested in each other.
        block_types: the classes of the blocks, in order of first appearance.
        total_params: parameters of the whole module (shared parameters counted once).
        how: how the blocks were chosen (``"auto"``, ``"classes"``, ``"predicate"``, or ``"size"``: no
            repeated blocks, so the blocks are size-based groups).
        group_threshold: with ``how="size"``, the parameter count at which a group was closed.
        reason: with ``how="size"``, why no repeated blocks were taken.
    """

    blocks: list[tuple[str, nn.Module]]
    block_types: tuple[type, ...]
    total_params: int
    how: str = "auto"
    group_threshold: int | None = None
    reason: str = ""
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
        """One ``"2 x GPTBlock (12,704 params each)"`` per block class (size-based groups: one line for all)."""
        if self.how == "size":
            avg = round(self.block_params / self.num_blocks) if self.num_blocks else 0
            return [
                f"no repeated blocks: {self.num_blocks} size-based groups of ~{avg:,} params"
                f" (threshold {self.group_threshold or 0:,})"
            ]
        parts = []
        for cls_name, sizes in self.params_per_block().items():
            per = f"{sizes[0]:,}" if len(set(sizes)) == 1 else f"{min(sizes):,}-{max(sizes):,}"
            parts.append(f"{len(sizes)} x {cls_name} ({per} params each)")
        return parts

    def describe(self) -> str:
        if self.how == "size":
            names = ", ".join(name for name, _ in self.blocks) or "none"
            return (
                f"{self.counts()[0]}: {names}; {self.block_fraction:.0%} of {self.total_params:,} params in"
                f" groups, {self.rest_params:,} outside (root group); {self.reason}"
            )
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


def _structure(module: nn.Module) -> tuple:
    """The class tree of ``module`` (classes only, no shapes): what makes two containers "the same"."""
    return (type(module), tuple(_structure(child) for child in module.children()))


def _sibling_key(module: nn.Module) -> tuple:
    # Every nn.Sequential is of one class, so containers also need the same class tree: two residual blocks
    # Sequential(Linear, Tanh, Linear) repeat, a conv stem and a classifier head that are both Sequential
    # do not. Shapes are left out on purpose: CNN stages that widen from stage to stage are still blocks.
    return (type(module), _structure(module)) if isinstance(module, _CONTAINERS) else (type(module),)


def _repeated_siblings(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules with parameterised children that have a sibling of the same kind in a container."""
    found: dict[str, nn.Module] = {}
    for name, container in root.named_modules():
        if not isinstance(container, _CONTAINERS):
            continue
        by_key: dict[tuple, list[tuple[str, nn.Module]]] = {}
        for child_name, child in container.named_children():
            by_key.setdefault(_sibling_key(child), []).append(
                (f"{name}.{child_name}" if name else child_name, child)
            )
        for members in by_key.values():
            if len(members) >= 2 and _has_parameterised_children(members[0][1]):
                found.update(members)  # a leaf (Linear, Embedding, ...) is never a block
    return list(found.items())


def size_groups(root: nn.Module, threshold: int) -> list[tuple[str, nn.Module]]:
    """Size-based FSDP groups: walk ``root`` post-order and close a group at a module once it holds
    ``threshold`` parameters not already in a group below it.

    Unlike FSDP1's ``size_based_auto_wrap_policy`` groups never nest: a module with a group below it is not
    a group itself, and what it holds outside its groups goes to the root group. A module whose
    parameters are shared with a module outside it (tied weights) is never a group. A ``ModuleList`` or
    ``ModuleDict`` that reaches the threshold is never a group either (it has no forward for FSDP2 to
    hook): its members holding ungrouped parameters are the groups instead.
    """
    owners: dict[int, set[int]] = {}
    for m in root.modules():
        for p in m.parameters(recurse=False):
            owners.setdefault(id(p), set()).add(id(m))
    seen: set[int] = set()
    groups: list[tuple[str, nn.Module]] = []

    def visit(name: str, module: nn.Module) -> tuple[int, bool]:  # (ungrouped params, holds a group)
        own = 0
        for p in module.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                own += p.numel()
        pending, grouped, children = own, False, []
        for child_name, child in module.named_children():
            path = f"{name}.{child_name}" if name else child_name
            n, g = visit(path, child)
            pending, grouped = pending + n, grouped or g
            children.append((path, child, n, g))
        if name and not grouped and pending >= threshold and _self_contained(module, owners):
            if not isinstance(module, _NO_FORWARD):
                groups.append((name, module))
                return 0, True
            # a ModuleList / ModuleDict has no forward for FSDP to hook: its members are the groups instead
            members = [
                (path, child)
                for path, child, n, g in children
                if n and not g and _self_contained(child, owners)
            ]
            if members:
                groups.extend(members)
                return pending - sum(n for path, child, n, g in children if (path, child) in members), True
        return pending, grouped

    visit("", root)
    return groups


def _self_contained(module: nn.Module, owners: dict[int, set[int]]) -> bool:
    inside = {id(m) for m in module.modules()}
    return all(owners[id(p)] <= inside for p in module.parameters())


def default_group_threshold(total_params: int) -> int:
    """``min(ceil(total / 8), 10**8)``: see :func:`find_transformer_blocks`."""
    return max(1, min(-(-total_params // 8), 10**8))


def _auto_blocks(root: nn.Module, total: int, min_fraction: float) -> tuple[list[tuple[str, nn.Module]], str]:
    # an MoE layer's experts repeat too, but they are parts of a block (expert parallelism splits them)
    experts = [
        f"{layer.path}.{layer.experts_name}" if layer.path else str(layer.experts_name)
        for layer in find_moe_layers(root)
        if layer.kind == "module_list"
    ]
    everything = [
        (n, m) for n, m in _repeated_siblings(root) if not any(n.startswith(e + ".") for e in experts)
    ]
    if not everything:
        return [], "no container holds two or more sibling modules of one kind with parameterised children"

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
    module: nn.Module,
    block_types: BlockTypes = "auto",
    *,
    min_fraction: float = 0.5,
    min_group_params: int | None = None,
) -> BlockPlan:
    """Find the blocks of ``module``: the FSDP groups (and the units tensor parallelism splits).

    With ``"auto"``, a block is a module with parameterised children that has at least one sibling of the
    same kind in an ``nn.ModuleList`` / ``nn.Sequential`` / ``nn.ModuleDict``: the same class, and for
    containers (an ``nn.Sequential`` residual block, a ``ModuleList`` stage) also the same class tree of
    children (shapes may differ, so CNN stages that widen are blocks). A leaf (``nn.Linear``) is never a
    block, so the Linears of an MLP are not taken for blocks. Blocks made of repeated blocks that hold
    most of their parameters are split into those (stages made of layers).

    When no repeated blocks hold ``min_fraction`` of the parameters, the model is still sharded: the
    blocks become size-based groups (``how="size"``, see :func:`size_groups`), closed at
    ``min_group_params`` parameters. Its default, ``min(ceil(total / 8), 10**8)``, keeps the parameters
    gathered at once to about an eighth of the model (the memory contract: 16P/N plus one group) with at
    most ~8 groups, so the collectives stay few and large, and no module smaller than an eighth of the
    model is a group on its own; FSDP1's default of 1e8 caps it for large models. It depends only on the
    model, never on the world size, so a plan computed before launch is the plan every rank uses.

    Args:
        module: any module (a LightningModule works too).
        block_types: ``"auto"`` (above), a collection of classes, class names (``"GPTBlock"``) or import
            paths (``"pkg.model.GPTBlock"``), or a predicate ``fn(module) -> bool``. Matches nested inside
            another match are ignored (the outer one is the block).
        min_fraction: with ``"auto"``, the smallest share of parameters repeated blocks must hold to be
            taken; below it, size-based groups are used.
        min_group_params: with ``"auto"`` and no repeated blocks, the group threshold (``None``: default).

    Raises:
        NoBlocksFoundError: explicit ``block_types`` matched nothing; the message lists the classes present.
    """
    total = sum(p.numel() for p in module.parameters())
    if isinstance(block_types, str) and block_types == "auto":
        blocks, why = _auto_blocks(module, total, min_fraction)
        if not blocks:
            return _size_plan(module, total, min_group_params, why)
        how = "auto"
    elif callable(block_types) and not isinstance(block_types, type):
        blocks, how = _blocks_by_predicate(module, block_types), "predicate"
    else:
        blocks, how = _blocks_by_class(module, block_types), "classes"
    return _plan(module, blocks, total, how)


def _plan(
    module: nn.Module, blocks: list[tuple[str, nn.Module]], total: int, how: str, **kw: Any
) -> BlockPlan:
    order = {name: i for i, (name, _) in enumerate(module.named_modules())}
    blocks.sort(key=lambda item: order[item[0]])
    types: list[type] = []
    for _, m in blocks:
        if type(m) not in types:
            types.append(type(m))
    return BlockPlan(blocks=blocks, block_types=tuple(types), total_params=total, how=how, **kw)


def _size_plan(module: nn.Module, total: int, min_group_params: int | None, why: str) -> BlockPlan:
    if min_group_params is None:
        threshold = default_group_threshold(total)
    elif isinstance(min_group_params, bool) or not isinstance(min_group_params, int) or min_group_params < 1:
        raise ValueError(
            f"min_group_params={min_group_params!r} must be a positive integer (parameters per size-based"
            " group) or None for the default min(ceil(total / 8), 1e8)"
        )
    else:
        threshold = min_group_params
    reason = f"block_types='auto' found no repeated blocks ({why}); to use your own blocks instead, {_HINT}"
    return _plan(
        module, size_groups(module, threshold), total, "size", group_threshold=threshold, reason=reason
    )


_HINT = (
    "pass the block classes explicitly, e.g. block_types={MyBlock} (or class names: block_types="
    "{'MyBlock'}), or a predicate block_types=lambda m: isinstance(m, MyBlock)"
)


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
