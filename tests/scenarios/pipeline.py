"""Scenarios for ``pp_dp``, run on real gloo ranks by tests/strategies/test_pipeline.py.

Each scenario returns plain data; the tests compute the expected values on their own (a plain PyTorch
reference loop, formulas) and compare.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import lit_parallel as lp
from tests.models import GPT, GPTConfig, Llama, LlamaConfig
from tests.scenarios.common import quiet_trainer as trainer

VOCAB, SEQ, N_LAYER = 64, 8, 4
SCHEDULES_2RANKS = [
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
]
SCHEDULES_DP = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS"]


def lm_dataset(n: int = 64, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def build_model(seed: int = 0, name: str = "gpt") -> torch.nn.Module:
    torch.manual_seed(seed)
    if name == "llama":  # its attention splits by heads, as tensor parallelism needs
        return Llama(LlamaConfig(n_layers=N_LAYER, max_seq_len=SEQ))
    return GPT(GPTConfig(n_layer=N_LAYER, block_size=SEQ))


def lm_loss(model: torch.nn.Module, batch) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]).flatten(0, 1), batch[1].flatten())


class PipeModel(L.LightningModule):
    """Only the pp_dp contract: forward(inputs) and pipeline_loss(output, targets); no *_step methods."""

    def __init__(self, lr: float = 0.1, momentum: float = 0.0, name: str = "gpt"):
        super().__init__()
        self.lr, self.momentum = lr, momentum
        self.model = build_model(name=name)

    def forward(self, idx):
        return self.model(idx)

    def pipeline_loss(self, output, targets):
        return F.cross_entropy(output.flatten(0, 1), targets.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


class PipeModelWithSteps(PipeModel):
    """Also trains under the other strategies (checkpoint round trips), which call the steps."""

    def training_step(self, batch, batch_idx):
        loss = self.pipeline_loss(self(batch[0]), batch[1])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.pipeline_loss(self(batch[0]), batch[1]))


class NoLossHook(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = build_model()

    def forward(self, idx):
        return self.model(idx)


class LossRecorder(Callback):
    """The loss the strategy reports to callbacks and loggers, every batch, on this rank."""

    def __init__(self):
        self.train: list[float] = []
        self.val: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.train.append(trainer.callback_metrics["train_loss"].item())

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.val.append(outputs.item())


def local_params(module: torch.nn.Module) -> dict:
    """This rank's parameters, whole (DTensor shards gathered over their data-/tensor-parallel mesh)."""
    out = {}
    for k, v in module.state_dict().items():
        out[k] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
    return out


def _fit(ctx, strategy, *, steps=3, accumulate=2, clip=0.5, batch=4, val=False, name="gpt"):
    model = PipeModel(name=name)
    rec = LossRecorder()
    t = trainer(
        ctx,
        strategy,
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
        callbacks=[rec],
        limit_val_batches=2 if val else 0,
        val_check_interval=accumulate * steps if val else None,
    )
    data = DataLoader(lm_dataset(), batch_size=batch)
    t.fit(model, data, DataLoader(lm_dataset(16, seed=1), batch_size=batch) if val else None)
    return t, model, rec


def parity(ctx, schedules, pp=2, microbatches=4, tp=1, name="gpt"):
    out = {}
    for schedule in schedules:
        strategy = lp.PipelineParallelStrategy(
            pipeline_parallel_size=pp, schedule=schedule, microbatches=microbatches, tensor_parallel_size=tp
        )
        t, model, rec = _fit(ctx, strategy, val=schedule == "1F1B", name=name)
        out[schedule] = {
            "losses": rec.train,
            "val": rec.val,
            "params": local_params(model),
            "table": t.strategy.pipeline_plan.table(),
            "stages": [s.plan.index for s in t.strategy.pipeline.stages],
        }
    return out


def parity_pp2(ctx):
    return parity(ctx, SCHEDULES_2RANKS)


def parity_pp2_dp2(ctx):
    return parity(ctx, SCHEDULES_DP)


def missing_hook(ctx):
    strategy = lp.PipelineParallelStrategy(pipeline_parallel_size=2)
    t = trainer(ctx, strategy, max_steps=1)
    try:
        t.fit(NoLossHook(), DataLoader(lm_dataset(), batch_size=4))
    except TypeError as err:
        return {"error": str(err)}
    return {"error": None}


# --- checkpoints: DCP across pipeline sizes and strategies -----------------------------------------------


def _epoch_fit(ctx, strategy, epochs, ckpt_path=None):
    model = PipeModelWithSteps(momentum=0.9)  # optimizer state to save and restore
    rec = LossRecorder()
    t = trainer(ctx, strategy, max_epochs=epochs, callbacks=[rec], limit_val_batches=0)
    t.fit(model, DataLoader(lm_dataset(16), batch_size=2), ckpt_path=ckpt_path)
    return t, model, rec


def _pp(size=2, schedule="1F1B"):
    return lp.PipelineParallelStrategy(pipeline_parallel_size=size, schedule=schedule, microbatches=2)


def checkpoints(ctx):
    """Save under pp2 after one epoch; load under pp1 (dp2), fsdp_blocks, ddp_tuned (through a consolidated
    file) and nothing is trained (the loaded weights); save under fsdp_blocks and ddp_tuned and load under pp2;
    resume pp2 for a second epoch."""
    from lit_parallel.checkpoint.convert import consolidate, consolidate_checkpoint

    root = Path(ctx.outdir)
    out: dict = {}
    t, model, rec = _epoch_fit(ctx, _pp(), 1)
    t.save_checkpoint(root / "pp2")
    out["saved"] = local_params(model)
    out["first_epoch"] = rec.train
    if dist.get_rank() == 0:
        out["consolidated"] = consolidate(root / "pp2", root / "pp2_weights.pt")
        consolidate_checkpoint(root / "pp2", root / "pp2_full.ckpt")
    dist.barrier()
    for label, strategy, path in (
        ("pp1", _pp(1, "GPipe"), root / "pp2"),
        ("fsdp_blocks", "fsdp_blocks", root / "pp2"),
        ("ddp_tuned", "ddp_tuned", root / "pp2_full.ckpt"),
    ):
        _, loaded, rec = _epoch_fit(ctx, strategy, 1, ckpt_path=path)
        out[label] = {"params": local_params(loaded), "trained": len(rec.train)}
    for label, strategy, path in (
        ("fsdp", "fsdp_blocks", root / "fsdp"),
        ("ddp", "ddp_tuned", root / "ddp.ckpt"),
    ):
        t, model, _ = _epoch_fit(ctx, strategy, 1)
        t.save_checkpoint(path)
        out[f"{label}_saved"] = local_params(model)
        _, loaded, rec = _epoch_fit(ctx, _pp(), 1, ckpt_path=path)
        out[f"pp2_from_{label}"] = {"params": local_params(loaded), "trained": len(rec.train)}
    _, _, resumed = _epoch_fit(ctx, _pp(), 2, ckpt_path=root / "pp2")
    _, _, straight = _epoch_fit(ctx, _pp(), 2)
    out["resumed"], out["uninterrupted"] = resumed.train, straight.train
    return out


def parity_pp2_dp2_tp2(ctx):
    return parity(ctx, ["1F1B"], tp=2, name="llama")


# --- memory and point-to-point traffic -------------------------------------------------------------------


class P2PRecorder(Callback):
    """Bytes this rank sends to other stages, per training batch, and the stages' peak in-flight counts."""

    def __init__(self):
        self.sends: list[list] = []
        self.peaks: list[dict] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        from lit_parallel.measure.p2p import count_p2p

        self._ctx = count_p2p()
        self._record = self._ctx.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._ctx.__exit__(None, None, None)
        self.sends.append(list(self._record.sends))
        self.peaks.append({s.plan.index: s.peak_in_flight for s in trainer.strategy.pipeline.stages})


def memory_and_p2p(ctx):
    out = {}
    for schedule in ("GPipe", "1F1B"):
        rec = P2PRecorder()
        strategy = lp.PipelineParallelStrategy(pipeline_parallel_size=2, schedule=schedule, microbatches=4)
        t = trainer(ctx, strategy, max_steps=2, callbacks=[rec])
        t.fit(PipeModel(), DataLoader(lm_dataset(), batch_size=4))
        out[schedule] = {"sends": rec.sends[-1], "peaks": rec.peaks[-1]}
    return out


def options(ctx):
    """Activation checkpointing per block (exact) and bf16-mixed (FSDP2's policy casts), 1F1B at pp2."""
    out = {}
    for label, kwargs, precision in (
        ("checkpointing", {"activation_checkpointing": True}, "32-true"),
        ("bf16_mixed", {}, "bf16-mixed"),
    ):
        strategy = lp.PipelineParallelStrategy(pipeline_parallel_size=2, microbatches=4, **kwargs)
        model, rec = PipeModel(), LossRecorder()
        t = trainer(
            ctx,
            strategy,
            max_steps=3,
            accumulate_grad_batches=2,
            gradient_clip_val=0.5,
            callbacks=[rec],
            precision=precision,
        )
        t.fit(model, DataLoader(lm_dataset(), batch_size=4))
        tested = t.test(model, DataLoader(lm_dataset(16, seed=1), batch_size=4), verbose=False)
        blocks = [m for n, m in model.named_modules() if n.startswith("model.h.") and n.count(".") == 2]
        out[label] = {
            "losses": rec.train,
            "params": local_params(model),
            "checkpointed": [getattr(b, "_lp_activation_checkpointing", False) for b in blocks],
            "plugin": type(t.precision_plugin).__name__,
            "test_loss": tested[0]["test_loss"],
        }
    return out


# two stages per rank, microbatches=4, batches of 8: samples -> the schedule that runs the last, short batch
LAST_BATCH_FALLBACKS = {"Interleaved1F1B": (57, "LoopedBFS", 1), "DualPipeV": (58, "ZBVZeroBubble", 2)}


def smaller_last_batch(ctx):
    """60 samples in batches of 8: the epoch's last batch has 4, a second shape for the stages. Then two
    schedules with two stages per rank whose last batch (1 or 2 samples) is fewer micro-batches than they
    accept: a schedule of the same layout runs it (LAST_BATCH_FALLBACKS)."""
    model, rec = PipeModel(), LossRecorder()
    t = trainer(ctx, _pp(2, "1F1B"), max_epochs=1, gradient_clip_val=0.5, callbacks=[rec])
    t.fit(model, DataLoader(lm_dataset(60), batch_size=8))
    out: dict = {"losses": rec.train, "params": local_params(model), "fallbacks": {}}
    for schedule, (samples, _, _) in LAST_BATCH_FALLBACKS.items():
        model, rec = PipeModel(), LossRecorder()
        strategy = lp.PipelineParallelStrategy(pipeline_parallel_size=2, schedule=schedule, microbatches=4)
        t = trainer(ctx, strategy, max_epochs=1, gradient_clip_val=0.5, callbacks=[rec])
        t.fit(model, DataLoader(lm_dataset(samples), batch_size=8))
        out["fallbacks"][schedule] = {
            "losses": rec.train,
            "params": local_params(model),
            "pipelines": sorted((k[1], k[2]) for k in t.strategy._pipelines),
        }
    return out


class EvalRecorder(LossRecorder):
    """Also the test loss of every batch."""

    def __init__(self):
        super().__init__()
        self.test: list[float] = []

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.test.append(outputs.item())


PARTIAL = {"train": 46, "val": 10, "test": 14}  # samples; per data-parallel rank 23, 5, 7 in batches of 4


def partial_batches(ctx):
    """pp2 x dp2, microbatches=4, batches of 4 per rank, no drop_last: every loader's last batch is short.
    Training (accumulation 2, clipping): the epoch's sixth batch has 3 samples (3 micro-batches of 1 under
    1F1B); validation's second batch has 1 (1F1B needs 2 micro-batches at pp2: GPipe runs it); test's
    second has 3."""
    model, rec = PipeModel(), EvalRecorder()
    strategy = lp.PipelineParallelStrategy(pipeline_parallel_size=2, schedule="1F1B", microbatches=4)
    t = trainer(ctx, strategy, max_steps=3, accumulate_grad_batches=2, gradient_clip_val=0.5, callbacks=[rec])
    batches = {k: DataLoader(lm_dataset(n, seed=i), batch_size=4) for i, (k, n) in enumerate(PARTIAL.items())}
    t.fit(model, batches["train"], batches["val"])
    t.test(model, batches["test"], verbose=False)
    return {
        "losses": rec.train,
        "val": rec.val,
        "test": rec.test,
        "params": local_params(model),
        "pipelines": sorted((k[1], k[2]) for k in t.strategy._pipelines),
    }


# --- the recipe: recipes/gpt.py with recipes/configs/gpt_pp.yaml as written (tests/scenarios/recipes.py) ----


def recipe_gpt_pp(ctx):
    """The header's ``torchrun --nproc-per-node=4`` command, to the end of its first validation."""
    from tests.scenarios.recipes import run_as_written

    cli, out = run_as_written("gpt_pp", 4, Path(ctx.outdir) / "gpt_pp")
    t = cli.trainer
    out["dims"] = t.strategy.parallel_dims.describe()
    out["microbatches"] = t.strategy._microbatches
    out["data_parallel"] = t.strategy.parallel_dims.data_parallel
    out["pipelines"] = sorted({(k[1], k[2]) for k in t.strategy._pipelines})
    out["val_set"] = len(cli.datamodule.val)
    out["val_batch"] = cli.datamodule.hparams.batch_size
    return out


# --- a model built on the meta device: reset_parameters or init_from (tests/strategies/test_pipeline.py) ----


class MetaPipeModel(PipeModel):
    """Builds its model on the meta device in configure_model: each rank materialises only its stages."""

    def __init__(self):
        super().__init__()
        self.model = None
        self.rng_state_at_init: torch.Tensor | None = None

    def configure_model(self):
        if self.model is not None:
            return
        with torch.device("meta"):
            self.model = GPT(GPTConfig(n_layer=N_LAYER, block_size=SEQ))
        self.rng_state_at_init = torch.get_rng_state()


class _Held(Callback):
    """This rank's stage parameters once the strategy has set the model up, before any step."""

    def on_fit_start(self, trainer, pl_module):
        self.params = local_params(pl_module)


def meta_init(ctx):
    """pp2 on a meta-device model: by each module's reset_parameters, and from a full state dict file
    (``init_from``; rank 1 is given a path that does not exist: only rank 0 reads it)."""
    out = {}
    torch.manual_seed(1000 + ctx.rank)  # ranks start from different generator states: rank 0's must win
    model, held = MetaPipeModel(), _Held()
    t = trainer(ctx, _pp(), max_steps=1, callbacks=[held])
    t.fit(model, DataLoader(lm_dataset(), batch_size=4))
    out["reset"] = {"params": held.params, "rng_state": model.rng_state_at_init}
    path = ctx.args["pretrained"] if ctx.rank == 0 else "/nonexistent/weights.pt"
    held = _Held()
    strategy = lp.PipelineParallelStrategy(pipeline_parallel_size=2, microbatches=2, init_from=path)
    t = trainer(ctx, strategy, max_steps=1, callbacks=[held])
    t.fit(MetaPipeModel(), DataLoader(lm_dataset(), batch_size=4))
    out["init_from"] = {"params": held.params}
    return out
