"""Scenarios for ``tp_dp`` (TensorParallelStrategy) and the pure TP functions, run on real gloo ranks by
tests/strategies/test_tensor_parallel.py*.py. Each returns plain data; the tests compute expected values on their own (a plain
PyTorch single-process reference, formulas) and compare.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import lit_parallel as lp
from lit_parallel.measure.collectives import CommCounter
from lit_parallel.parallel import (
    ParallelDims,
    apply_tp,
    full_state_dict,
    infer_tp_plan,
    local_parameter_bytes,
)
from tests.models import Llama
from tests.scenarios.common import quiet_trainer as trainer
from tests.tp_models import TPGPT

VOCAB, SEQ, PER_RANK_BATCH, LR = 64, 8, 2, 0.1
STEPS, ACCUMULATE, CLIP = 5, 2, 0.5
MOMENTUM = 0.9  # the checkpoint scenario: optimizer state to save and restore


# --- shared with the tests' references ------------------------------------------------------------------


def lm_dataset(n: int = 32, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:], torch.arange(n))


def lm_loss(model: torch.nn.Module, batch) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]).flatten(0, 1).float(), batch[1].flatten())


def build_model(name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return {"llama": Llama, "gpt": TPGPT}[name]()


class LitLM(L.LightningModule):
    """An ordinary LightningModule: ``training_step`` calls ``self.model``; no configure_model."""

    def __init__(self, name: str, optimizer: str = "sgd"):
        super().__init__()
        self.model = build_model(name)
        self.optimizer = optimizer
        self.losses: list[float] = []
        self.batch_indices: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        loss = lm_loss(self.model, batch)
        self.losses.append(loss.detach().float().item())
        self.batch_indices.append(batch[2].tolist())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(
            self.parameters(), lr=LR, momentum=MOMENTUM if self.optimizer == "momentum" else 0.0
        )


def _full_on_rank0(module: torch.nn.Module) -> dict:
    state = full_state_dict(module)
    return {k: v.clone() for k, v in state.items()} if dist.get_rank() == 0 else {}


def _fit(
    ctx,
    strategy,
    name: str,
    max_steps=STEPS,
    accumulate=ACCUMULATE,
    clip=CLIP,
    n=32,
    ckpt_path=None,
    **kwargs,
) -> tuple:
    model = LitLM(name)
    t = trainer(
        ctx,
        strategy,
        max_steps=max_steps,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
        **kwargs,
    )
    t.fit(model, DataLoader(lm_dataset(n), batch_size=PER_RANK_BATCH), ckpt_path=ckpt_path)
    return model, t


def _parity(ctx, name: str, **strategy_kwargs) -> dict:
    strategy = lp.TensorParallelStrategy(**strategy_kwargs)
    model, t = _fit(ctx, strategy, name)
    plan = t.strategy.tp_plan
    return {
        "losses": torch.tensor(model.losses, dtype=torch.float64),
        "batches": model.batch_indices,
        "params": _full_on_rank0(model),
        "styles": {layer.path: layer.style for layer in plan.layers},
        "placements": {n: str(p.placements) for n, p in model.named_parameters()},
        "how": plan.how,
        "mesh": list(t.strategy.device_mesh.mesh_dim_names),
        "dp_rank": t.strategy.parallel_dims.data_parallel_mesh().get_local_rank(),
        "local_bytes": local_parameter_bytes(model),
    }


# --- launch: 2 ranks, tensor_parallel_size=2 ------------------------------------------------------------


def parity_tp2(ctx) -> dict:
    """Llama and GPT blocks, sequence parallel off and on (and loss parallel with it), tp=2 x dp=1."""
    return {
        "llama": _parity(ctx, "llama", tensor_parallel_size=2),
        "llama_sp": _parity(ctx, "llama", tensor_parallel_size=2, sequence_parallel=True, loss_parallel=True),
        "gpt": _parity(ctx, "gpt", tensor_parallel_size=2),
        "gpt_sp": _parity(ctx, "gpt", tensor_parallel_size=2, sequence_parallel=True),
        "llama_ac": _parity(ctx, "llama", tensor_parallel_size=2, activation_checkpointing=True),
    }


def _llama_styles():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    col = ["attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"]
    plan = {f"model.layers.*.{c}": ColwiseParallel() for c in col}
    plan.update({f"model.layers.*.{r}": RowwiseParallel() for r in ("attention.wo", "feed_forward.w2")})
    return plan


def _llama_plan_fn(module, tp_mesh):
    from torch.distributed.tensor.parallel import parallelize_module

    for block in module.model.layers:
        styles = {k.removeprefix("model.layers.*."): v for k, v in _llama_styles().items()}
        parallelize_module(block, tp_mesh, styles)


def custom_plans(ctx) -> dict:
    """plan= a dict {path: ParallelStyle} (wildcards) and plan= a function, instead of the inferred plan."""
    return {
        "dict": _parity(ctx, "llama", tensor_parallel_size=2, plan=_llama_styles()),
        "function": _parity(ctx, "llama", tensor_parallel_size=2, plan=_llama_plan_fn),
    }


class MetaLitLM(LitLM):
    """Builds the model on the meta device in configure_model: no rank ever holds it whole."""

    def __init__(self):
        super().__init__("gpt")
        self.model = None

    def configure_model(self):
        if self.model is None:
            with torch.device("meta"):
                self.model = TPGPT()


def init_from_file(ctx) -> dict:
    """A meta-device model filled from a full state dict file (rank 0 reads it; fused rows reordered)."""
    seen = {}

    class Grab(L.Callback):
        def on_fit_start(self, trainer, pl_module):
            seen["params"] = _full_on_rank0(pl_module)

    model = MetaLitLM()
    strategy = lp.TensorParallelStrategy(tensor_parallel_size=2, init_from=ctx.args["pretrained"])
    t = trainer(ctx, strategy, max_steps=1, callbacks=[Grab()])
    t.fit(model, DataLoader(lm_dataset(), batch_size=PER_RANK_BATCH))
    return {"params": seen["params"], "how": t.strategy.tp_plan.how}


def _forward_comm(model: torch.nn.Module, tokens: torch.Tensor, **plan_kwargs) -> dict:
    from torch.distributed.tensor.debug import CommDebugMode

    dims = ParallelDims(world_size=dist.get_world_size(), tensor_parallel=dist.get_world_size())
    mesh = dims.build_mesh("cpu")
    plan = infer_tp_plan(model, dims.tensor_parallel, **plan_kwargs)
    apply_tp(model, mesh["tensor_parallel"], plan)
    with CommDebugMode() as debug, CommCounter() as counter:
        out = model(tokens)
    counts = {str(op).split(".")[-1]: n for op, n in debug.get_comm_counts().items()}
    records = [(r.kind, r.payload_bytes) for r in counter.records]
    if hasattr(out, "full_tensor"):
        out = out.full_tensor()
    return {"counts": counts, "records": records, "out": out.detach()}


def bench_model() -> torch.nn.Module:
    """The benchmark's GPT: fused qkv viewed as (3, heads, head_dim), not split with chunk()."""
    from argparse import Namespace

    from lit_parallel.commands.bench.common import make_gpt

    return make_gpt(Namespace(dim=32, heads=4, layers=2, vocab=VOCAB, seq=SEQ))


def comm_counts(ctx) -> dict:
    """apply_tp without a Trainer: the collectives of one forward (CommDebugMode) and its output."""
    tokens = lm_dataset()[:4][0]
    out = {}
    for name in ("llama", "gpt"):
        out[name] = _forward_comm(build_model(name), tokens)
        out[name + "_sp"] = _forward_comm(build_model(name), tokens, sequence_parallel=True)
    out["bench"] = _forward_comm(bench_model(), tokens)
    return out


def bad_sequence_length(ctx) -> dict:
    """sequence_parallel=True with a sequence length not divisible by tp: every rank raises the same error."""
    model = build_model("llama")
    dims = ParallelDims(world_size=dist.get_world_size(), tensor_parallel=dist.get_world_size())
    mesh = dims.build_mesh("cpu")
    apply_tp(
        model, mesh["tensor_parallel"], infer_tp_plan(model, dims.tensor_parallel, sequence_parallel=True)
    )
    try:
        model(torch.zeros(2, 7, dtype=torch.long))
    except ValueError as err:
        return {"error": str(err)}
    return {"error": ""}


# --- launch: 4 ranks, data_parallel 2 x tensor_parallel 2 -----------------------------------------------


def parity_dp2_tp2(ctx) -> dict:
    return {
        "llama": _parity(ctx, "llama", data_parallel_size=2, tensor_parallel_size=2),
        "llama_sp": _parity(
            ctx, "llama", data_parallel_size=2, tensor_parallel_size=2, sequence_parallel=True
        ),
        "gpt": _parity(ctx, "gpt", data_parallel_size=2, tensor_parallel_size=2),
        "gpt_sp": _parity(
            ctx,
            "gpt",
            data_parallel_size=2,
            tensor_parallel_size=2,
            sequence_parallel=True,
            loss_parallel=True,
        ),
    }


def checkpoint_resume(ctx) -> dict:
    """GPT (fused qkv, whose rows tp_dp reorders) with SGD + momentum on dp 2 x tp 2: one epoch, save a sharded
    checkpoint, resume for a second epoch; and two epochs without a break for comparison."""
    ckpt = Path(ctx.args["ckpt_dir"]) / "tp_dp.ckpt"
    data = DataLoader(lm_dataset(16), batch_size=PER_RANK_BATCH)

    def fit(epochs: int, ckpt_path=None):
        model = LitLM("gpt", optimizer="momentum")
        t = trainer(
            ctx, lp.TensorParallelStrategy(data_parallel_size=2), max_epochs=epochs, gradient_clip_val=CLIP
        )
        t.fit(model, data, ckpt_path=ckpt_path)
        return model, t

    first, t = fit(1)
    t.save_checkpoint(ckpt)
    resumed, _ = fit(2, ckpt_path=ckpt)
    straight, _ = fit(2)
    return {
        "first": torch.tensor(first.losses, dtype=torch.float64),
        "first_params": _full_on_rank0(first),
        "resumed": torch.tensor(resumed.losses, dtype=torch.float64),
        "straight": torch.tensor(straight.losses, dtype=torch.float64),
        "resumed_params": _full_on_rank0(resumed),
        "straight_params": _full_on_rank0(straight),
        "ckpt": str(ckpt),
    }


def resume_elsewhere(ctx) -> dict:
    """The 4-rank (dp 2 x tp 2) checkpoint on 2 ranks: as tp 2 it loads (data-parallel shards merged);
    as dp 2 x tp 1 it is refused (fused layers' optimizer state is in the tp-2 row order)."""
    ckpt = ctx.args["ckpt"]
    seen = {}

    class Grab(L.Callback):
        def on_train_start(self, trainer, pl_module):
            seen["params"] = _full_on_rank0(pl_module)
            seen["step"] = trainer.global_step

    data = DataLoader(lm_dataset(16), batch_size=PER_RANK_BATCH)
    t = trainer(ctx, lp.TensorParallelStrategy(tensor_parallel_size=2), max_steps=5, callbacks=[Grab()])
    t.fit(LitLM("gpt", optimizer="momentum"), data, ckpt_path=ckpt)
    error = ""
    try:
        t = trainer(ctx, lp.TensorParallelStrategy(tensor_parallel_size=1), max_steps=5)
        t.fit(LitLM("gpt", optimizer="momentum"), data, ckpt_path=ckpt)
    except ValueError as err:
        error = str(err)
    return {**seen, "error": error}


# --- launch: 8 ranks, 2 nodes x 4: replicate 2 x shard 2 x tensor 2 -------------------------------------


def parity_3d(ctx) -> dict:
    sizes = dict(data_parallel_size=4, data_parallel_replicate_size=2, tensor_parallel_size=2)
    return {
        "llama": _parity(ctx, "llama", **sizes),
        "gpt_sp": _parity(ctx, "gpt", sequence_parallel=True, loss_parallel=True, **sizes),
    }
