"""The optional extras of ``pyproject.toml`` that commands need, checked before a command does any work.

A command that needs an extra calls :func:`require_extra` first: a missing module is found by
``importlib.util.find_spec`` (nothing is imported), and the error names the extra, what is missing and the
``pip install`` line that adds it. The CLI prints it and exits with status 2.
"""

from __future__ import annotations

import importlib.util

# extra -> {distribution: the top-level module the commands import from it}; each distribution is one of the
# extra's requirements in pyproject.toml (a test holds the two together)
EXTRAS: dict[str, dict[str, str]] = {
    "demo": {"scikit-learn": "sklearn"},
    "bench": {"matplotlib": "matplotlib"},
    "moe": {"transformers": "transformers"},
}


class MissingExtraError(ImportError):
    """A command needs an optional extra of lit_parallel that is not installed."""

    def __init__(self, extra: str, missing: dict[str, str], purpose: str) -> None:
        self.extra, self.missing = extra, missing
        dists = " and ".join(missing)
        modules = " and ".join(repr(m) for m in missing.values())
        verb = "is" if len(missing) == 1 else "are"
        super().__init__(
            f"{dists} {verb} not installed (no module named {modules}), needed for {purpose}. Install the"
            f' optional "{extra}" extra: pip install "lit_parallel[{extra}]"',
            name=next(iter(missing.values())),
        )


def missing_modules(extra: str) -> dict[str, str]:
    """The distributions of ``extra`` whose module this Python cannot find, each with that module."""
    if extra not in EXTRAS:
        raise ValueError(
            f"extra={extra!r} is not an extra the commands need; choose from {', '.join(EXTRAS)}"
        )
    return {dist: module for dist, module in EXTRAS[extra].items() if not _found(module)}


def _found(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # an import hook refuses it, or sys.modules holds None for it
        return False


def require_extra(extra: str, purpose: str) -> None:
    """Raise :class:`MissingExtraError` unless every module of ``extra`` is installed.

    Args:
        purpose: what needs the extra, as the message says it (``"needed for the demo's data set"``).
    """
    missing = missing_modules(extra)
    if missing:
        raise MissingExtraError(extra, missing, purpose)
