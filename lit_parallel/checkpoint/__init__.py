"""Checkpoint files: written without ever replacing what this package did not write (:mod:`~.write`),
verified and loaded without unpickling code (:mod:`~.load`), converted from sharded to full (:mod:`~.convert`).

No Lightning strategy code; may import the base modules only.
"""

from lit_parallel.checkpoint.convert import consolidate, consolidate_checkpoint, full_checkpoint
from lit_parallel.checkpoint.load import (
    IncompleteCheckpointError,
    NotACheckpointError,
    UnsafeCheckpointError,
    load_sharded,
    verify_checkpoint,
)
from lit_parallel.checkpoint.write import CheckpointWriteError, ForeignDestinationError, ForeignFolderError

__all__ = [
    "CheckpointWriteError",
    "ForeignDestinationError",
    "ForeignFolderError",
    "IncompleteCheckpointError",
    "NotACheckpointError",
    "UnsafeCheckpointError",
    "consolidate",
    "consolidate_checkpoint",
    "full_checkpoint",
    "load_sharded",
    "verify_checkpoint",
]
