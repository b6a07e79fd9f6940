"""Host synchronisations per optimizer step, every strategy in one launch (tests/strategies/test_host_syncs.py).

A tiny Llama (token model, plain PyTorch), SGD with momentum, gradient clipping by norm on, fp32, under SLURM's
environment so that the preemption check runs after every optimizer step. A :class:`HostSyncCounter` is open
around each ``fit``; a callback reads it at the start of each training batch, so a step's figure covers its
whole step and the boundary after it (callbacks, the preemption check, loading the next batch).
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

import lit_parallel as lp
from lit_parallel.measure.host_syncs import HostSyncCounter
from tests.models import Llama, LlamaConfig
from tests.scenarios.common import quiet_trainer
from tests.scenarios.pipeline import lm_dataset
from tests.scenarios.reliability import _environ, _slurm_environment

STRATEGIES = ("ddp", "ddp_tuned", "fsdp_blocks", "hsdp", "tp_dp", "pp_dp")
STEPS = 7  # steps 3-6 (1-based) are counted: from the start of batch 2 to the start of batch 6
COUNTED = range(2, 6)
BATCH = 4  # per rank


class TokenModel(L.LightningModule):
    """A plain PyTorch Llama; ``training_step`` for every strategy, ``pipeline_loss`` for ``pp_dp``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = Llama(LlamaConfig(n_layers=2, max_seq_len=8))

    def forward(self, idx):
        return self.model(idx)

    def pipeline_loss(self, output, targets):
        return F.cross_entropy(output.flatten(0, 1), targets.flatten())

    def training_step(self, batch, batch_idx):
        return self.pipeline_loss(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class SyncsPerStep(Callback):
    """The counter's figure between the starts of consecutive training batches; where they came from."""

    def __init__(self, counter: HostSyncCounter):
        self.counter = counter
        self.at_start: list[int] = []
        self.preemption_on = False
        self.where: list[str] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == COUNTED.start:
            self.counter.reset()
        if batch_idx == COUNTED.stop:
            self.where = list(self.counter.stacks)
        self.at_start.append(self.counter.count)
        reliability = getattr(trainer.strategy, "reliability", None)
        self.preemption_on = reliability is not None and reliability.preemption is not None

    def per_step(self) -> list[int]:
        counts = self.at_start[COUNTED.start : COUNTED.stop + 1]
        return [b - a for a, b in zip(counts, counts[1:])]


def _strategy(name: str):
    if name == "ddp":
        return "ddp"  # Lightning's own, for reference
    if name == "ddp_tuned":
        return lp.TunedDDPStrategy()
    if name == "fsdp_blocks":
        return lp.TransformerFSDPStrategy()
    if name == "hsdp":
        return lp.HybridShardStrategy(shard_size=1)  # 2 ranks: 2 replicas x 1 shard
    if name == "tp_dp":
        return lp.TensorParallelStrategy()  # 2 ranks: tensor parallel 2
    return lp.PipelineParallelStrategy(pipeline_parallel_size=2, microbatches=2)


def syncs_per_step(ctx) -> dict:
    """``{strategy: {"per_step": [syncs in steps 3..6], "preemption_on": bool, "where": [stacks]}}``."""
    out = {}
    with _environ(_slurm_environment(ctx, ctx.outdir / "bin")):
        for name in STRATEGIES:
            counter = HostSyncCounter(where=True)
            seen = SyncsPerStep(counter)
            trainer = quiet_trainer(
                ctx, _strategy(name), max_steps=STEPS, gradient_clip_val=0.05, callbacks=[seen]
            )
            data = DataLoader(lm_dataset(n=STEPS * BATCH * ctx.world_size), batch_size=BATCH)
            with counter:
                trainer.fit(TokenModel(), data)
            out[name] = {
                "per_step": seen.per_step(),
                "preemption_on": seen.preemption_on,
                "where": seen.where,
            }
    return out
