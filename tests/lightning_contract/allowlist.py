"""Lightning tests that may pass with Lightning's strategy and not with ours, each with its reason.

Every reason is a deliberate difference listed in ``docs/compatibility.md`` (the key is its section).
"""

from __future__ import annotations

from fnmatch import fnmatch

# section of docs/compatibility.md -> one line of why
REASONS: dict[str, str] = {}

# (modes, test id pattern relative to tests_pytorch, section)
ALLOWED: list[tuple[tuple[str, ...], str, str]] = []


def allowed_difference(mode: str, test: str) -> str | None:
    """The documented reason ``test`` may fail with ``mode`` where Lightning's strategy passes, else None."""
    rel = test.split("tests_pytorch/", 1)[-1]
    for modes, pattern, section in ALLOWED:
        if mode in modes and fnmatch(rel, pattern):
            return f"{section}: {REASONS[section]}"
    return None
