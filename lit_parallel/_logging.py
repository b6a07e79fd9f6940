"""The package's one logger and its rank-zero helpers.

Decisions are logged once, on global rank 0, at INFO (one short summary per decision); details go to DEBUG.
``lit_parallel/parallel/`` stays free of Lightning: code there returns descriptions and the callers log them.
"""

from __future__ import annotations

import logging

from lightning.pytorch.utilities.rank_zero import rank_zero_only

log = logging.getLogger("lit_parallel")


def info(msg: str) -> None:
    """Log ``msg`` at INFO on global rank 0 only."""
    if rank_zero_only.rank == 0:
        log.info(msg)


def debug(msg: str) -> None:
    """Log ``msg`` at DEBUG on global rank 0 only."""
    if rank_zero_only.rank == 0:
        log.debug(msg)


def warning(msg: str) -> None:
    """Log ``msg`` at WARNING on this rank (problems are reported where they happen)."""
    log.warning(msg)
