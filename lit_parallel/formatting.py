"""The package's one byte formatter and one "choose 1, 2 or 4" formatter (pure Python)."""

from __future__ import annotations

from collections.abc import Iterable

GB = 1e9  # decimal gigabyte: device memory as vendors and the advisor's tables state it


def format_bytes(n: float, *, decimal: bool = False) -> str:
    """Binary units by default (``1536`` -> ``"1.50 KiB"``); ``decimal=True`` for the advisor's tables, whose
    memory is in GB of 1e9 bytes (``3.44 GB``, ``512.00 MB``). Bytes below one unit print as ``"512 B"``."""
    if decimal:
        for unit, size in (("TB", 1e12), ("GB", GB), ("MB", 1e6), ("kB", 1e3)):
            if abs(n) >= size:
                return f"{n / size:,.2f} {unit}"
        return f"{n:,.0f} B"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} B" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    return f"{n:,.2f} TiB"  # pragma: no cover - the loop returns at GiB


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n`` in increasing order (the sizes an error message can suggest)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def format_choices(values: Iterable[object]) -> str:
    """``[1, 2, 4]`` -> ``"1, 2 or 4"`` (for "choose 1, 2 or 4" in error messages)."""
    text = [str(v) for v in values]
    if not text:
        return ""
    return text[0] if len(text) == 1 else ", ".join(text[:-1]) + " or " + text[-1]
