"""Scenarios: any checkpoint under any strategy and any number of ranks.

Two launches. On 2 ranks, six strategies (ddp_tuned, Lightning's ddp, fsdp_blocks, hsdp, tp_dp and Lightning's
ModelParallelStrategy with FSDP2 applied in ``configure_model``) each train the tiny Llama of the reliability
scenarios for one epoch and save; then each checkpoint of another strategy is restored under tp_dp (2 -> 2).
On 3 ranks every checkpoint is restored under strategies other than the one that saved it (2 -> 3). Each
restore returns the full model and optimizer state as loaded, on rank 0; the tests compare them with what
was saved. Scenarios return plain data.
"""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader

import lit_parallel as lp
from tests.scenarios.fsdp import _full_on_rank0, _opt_state_on_rank0, lm_dataset
from tests.scenarios.reliability import BATCH, NoisyLlama, _seed, trainer

N = 16  # 2 ranks x 4 batches x 2 samples (3 ranks: 3 batches, the last one padded by the sampler)

# file name of each saving strategy's checkpoint
SAVED = {
    "ddp_tuned": "ddp_tuned.ckpt",
    "lightning_ddp": "lightning_ddp.ckpt",
    "fsdp_blocks": "fsdp.ckpt",
    "hsdp": "hsdp.ckpt",
    "tp_dp": "tp.ckpt",
    "lightning_model_parallel": "mps.ckpt",
}


class ShardedInConfigureModel(NoisyLlama):
    """For Lightning's ModelParallelStrategy, which shards only what ``configure_model`` shards."""

    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


def _strategy(name: str, world: int):
    if name == "ddp_tuned":
        return lp.TunedDDPStrategy()
    if name == "lightning_ddp":
        return DDPStrategy()
    if name == "fsdp_blocks":
        return lp.TransformerFSDPStrategy()
    if name == "hsdp":
        return lp.HybridShardStrategy(shard_size=1)  # world replicas x 1 shard
    if name == "hsdp_1xN":
        return lp.HybridShardStrategy(shard_size=world)
    if name == "tp_dp":
        return lp.TensorParallelStrategy(tensor_parallel_size=2)
    if name == "lightning_model_parallel":
        return ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    raise ValueError(name)


def _model(name: str) -> NoisyLlama:
    return (
        ShardedInConfigureModel(per_rank_rng=False)
        if name == "lightning_model_parallel"
        else NoisyLlama(per_rank_rng=False)
    )


def _state(model, t) -> dict:
    return {"model": _full_on_rank0(model), "optimizer": _opt_state_on_rank0(model, t.optimizers[0])}


def _save(ctx, name: str, path: Path) -> dict:
    model = _model(name)
    _seed()
    t = trainer(ctx, _strategy(name, ctx.world_size), max_epochs=1)
    t.fit(model, DataLoader(lm_dataset(n=N), batch_size=BATCH))
    t.save_checkpoint(path)
    return {**_state(model, t), "global_step": t.global_step}


def _restore(ctx, name: str, path: Path) -> dict:
    """Restore under ``name``; nothing is trained (the checkpoint is at the end of the only epoch)."""
    model = _model(name)
    t = trainer(ctx, _strategy(name, ctx.world_size), max_epochs=1)
    t.fit(model, DataLoader(lm_dataset(n=N), batch_size=BATCH), ckpt_path=path)
    restored = {**_state(model, t), "global_step": t.global_step, "trained": len(model.losses)}
    restored.update(strategy=type(t.strategy).__name__, world=t.world_size)
    return restored


def any_save(ctx) -> dict:
    """2 ranks: every strategy trains one epoch and saves; then the others' checkpoints restore under tp_dp."""
    root = Path(ctx.args["dir"])
    saved = {name: _save(ctx, name, root / file) for name, file in SAVED.items()}
    restored = {
        f"{source}_to_tp_dp": _restore(ctx, "tp_dp", root / SAVED[source])
        for source in ("ddp_tuned", "lightning_ddp", "fsdp_blocks", "hsdp", "lightning_model_parallel")
    }
    return {"saved": saved, "restored": restored}


# (label, saving strategy, restoring strategy) restored on 3 ranks
LOADS_ON_3 = [
    ("fsdp_blocks_to_ddp_tuned", "fsdp_blocks", "ddp_tuned"),
    ("hsdp_to_ddp_tuned", "hsdp", "ddp_tuned"),
    ("tp_dp_to_ddp_tuned", "tp_dp", "ddp_tuned"),
    ("lightning_model_parallel_to_ddp_tuned", "lightning_model_parallel", "ddp_tuned"),
    ("ddp_tuned_to_fsdp_blocks", "ddp_tuned", "fsdp_blocks"),
    ("lightning_ddp_to_fsdp_blocks", "lightning_ddp", "fsdp_blocks"),
    ("ddp_tuned_to_hsdp", "ddp_tuned", "hsdp"),
    ("lightning_ddp_to_hsdp_1xN", "lightning_ddp", "hsdp_1xN"),
    ("tp_dp_to_hsdp", "tp_dp", "hsdp"),
]


def any_load(ctx) -> dict:
    """3 ranks: each 2-rank checkpoint restored under another strategy."""
    root = Path(ctx.args["dir"])
    return {label: _restore(ctx, target, root / SAVED[source]) for label, source, target in LOADS_ON_3}
