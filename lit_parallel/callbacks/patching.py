"""Shadowing a method of one object for a while, and putting it back.

A few objects the callbacks observe offer no hook for what they need: the LightningModule's ``log``,
a torchmetrics ``update``/``forward``, the profiler's ``start``/``stop`` and the strategy's
``process_dataloader``. The callbacks then set an attribute on that one instance, which shadows the
class's method; classes are never touched, and the callable :func:`patch_attribute` returns undoes it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def patch_attribute(obj: Any, name: str, value: Any) -> Callable[[], None]:
    """Set ``obj.<name> = value`` on this instance; the returned function restores what was there."""
    attrs = vars(obj)
    shadowed = name in attrs  # e.g. torchmetrics keeps a wrapped ``update`` on each instance
    previous = attrs.get(name)
    setattr(obj, name, value)

    def undo() -> None:
        if shadowed:
            setattr(obj, name, previous)
        elif name in vars(obj):
            delattr(obj, name)

    return undo
