"""The paths an older torch takes (lit_parallel._compat.FEATURES forced off), on real gloo ranks, run by
tests/strategies/test_older_torch.py in the shared Lightning-launcher launch (tests/strategies/conftest.py).

On torch 2.11 these paths are the ones every run takes; forcing the features off runs them on any torch.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader

import lit_parallel as lp
from lit_parallel import _compat
from tests.scenarios import ddp as ddp_sc
from tests.scenarios import pipeline as pp_sc


@contextlib.contextmanager
def _older_torch(*features: str) -> Iterator[list[str]]:
    """``features`` forced off; yields the lit_parallel log messages emitted meanwhile."""
    messages: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("lit_parallel")
    logger.addHandler(handler)
    saved = dict(_compat._FORCED), set(_compat._LOGGED)
    _compat._FORCED.update(dict.fromkeys(features, False))
    _compat._LOGGED.difference_update(features)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        _compat._FORCED.clear()
        _compat._FORCED.update(saved[0])
        _compat._LOGGED.clear()
        _compat._LOGGED.update(saved[1])


class TaggedModule(ddp_sc.NetModule):
    """A buffer set to this rank's number + 1 before each batch; training_step records what forward saw."""

    def __init__(self):
        super().__init__(ddp_sc.make_net(0))
        self.register_buffer("tag", torch.zeros(()))
        self.seen: list[float] = []

    def on_train_batch_start(self, batch, batch_idx):
        self.tag.fill_(self.global_rank + 1)

    def training_step(self, batch, batch_idx):
        self.seen.append(float(self.tag))
        return super().training_step(batch, batch_idx)


def forward_sync_buffers(ctx) -> dict:
    """``ddp_tuned(forward_sync_buffers=True/False)`` as on torch < 2.13 (no such DDP argument)."""
    out = {}
    with _older_torch("ddp_forward_sync_buffers") as messages:
        for value in (True, False):
            model = TaggedModule()
            strategy = lp.TunedDDPStrategy(forward_sync_buffers=value, find_unused_parameters=False)
            trainer = ddp_sc.make_trainer(ctx, strategy, max_steps=2)
            trainer.fit(model, DataLoader(ddp_sc.make_dataset(8), batch_size=2))
            out[str(value)] = model.seen
    out["messages"] = [m for m in messages if "lacks" in m]
    return out


def pipeline(ctx) -> dict:
    """``pp_dp`` (pp2, 1F1B, validation before training goes on) as on torch 2.11: integer inputs between
    stages and a schedule that ran eval() first."""
    with _older_torch("pipelining_integer_tensors", "pipelining_mode_switch") as messages:
        strategy = lp.PipelineParallelStrategy(pipeline_parallel_size=2, schedule="1F1B", microbatches=4)
        model, rec = pp_sc.PipeModel(name="gpt"), pp_sc.LossRecorder()
        # tests/strategies/test_pipeline.py's reference run: 3 steps of 2 batches of 4, clipping at 0.5; the
        # sanity check evaluates one batch before training starts
        t = pp_sc.trainer(
            ctx,
            strategy,
            max_steps=3,
            accumulate_grad_batches=2,
            gradient_clip_val=0.5,
            callbacks=[rec],
            num_sanity_val_steps=1,
            limit_val_batches=1,
            val_check_interval=6,
        )
        data = DataLoader(pp_sc.lm_dataset(), batch_size=4)
        t.fit(model, data, DataLoader(pp_sc.lm_dataset(16, seed=1), batch_size=4))
    return {
        "losses": rec.train,
        "val": rec.val,
        "params": pp_sc.local_params(model),
        "messages": [m for m in messages if "lacks" in m],
        "pipelines": len(t.strategy._pipelines),
    }
