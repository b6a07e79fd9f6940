"""Mid-epoch resume: skip the batches the epoch already used, or refuse with the reason."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from torch.utils.data import Sampler


class _SkipFirst(Sampler):
    """``sampler`` without its first ``skip`` indices, once: the rest of the epoch a checkpoint stopped in.
    Its length stays the whole epoch's (Lightning counts the skipped batches as done)."""

    def __init__(self, sampler: Sampler, skip: int) -> None:
        self.sampler = sampler
        self.skip = skip

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.sampler)
        skip, self.skip = self.skip, 0
        for _ in itertools.islice(it, skip):
            pass
        yield from it

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        if callable(getattr(self.sampler, "set_epoch", None)):
            self.sampler.set_epoch(epoch)


def _is_stateful(loader: Any) -> bool:
    return callable(getattr(loader, "state_dict", None)) and callable(
        getattr(loader, "load_state_dict", None)
    )


_MID_EPOCH_FIX = (
    "Fix: resume from a checkpoint taken at the end of an epoch (ModelCheckpoint(every_n_epochs=1)), use"
    " Lightning's DistributedSampler (use_distributed_sampler=True, the default) or a SequentialSampler, or"
    " a dataloader that saves its position (state_dict()/load_state_dict(), e.g. torchdata's"
    " StatefulDataLoader)."
)
