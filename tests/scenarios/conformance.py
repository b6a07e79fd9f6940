"""Conformance cells (model x strategy) on real gloo ranks, run by tests/test_conformance.py.

One scenario, :func:`cells`, runs the cells named in ``ctx.args["cells"]`` one after the other in the same
processes. A cell that raises is recorded with its error and the next one runs; each cell's result is
also written to its own file as soon as it is done, so a launch that dies or times out still reports the
cells before it. Results are plain data: the per-micro-batch losses, the data-parallel rank and size, and
per parameter the bytes this rank holds against the full parameter; the test computes the expected
values itself (plain PyTorch reference on the same global batches, the table's own block and projection
names).
"""

from __future__ import annotations

import time
import traceback

import lightning as L
import torch
from torch.utils.data import DataLoader

import lit_parallel as lp
from tests.conformance_models import MODELS, build, dataset, loss_fn
from tests.scenarios.common import quiet_trainer as trainer

STRATEGIES = ("ddp_tuned", "fsdp_blocks", "hsdp", "tp_dp", "auto_parallel")
LR, PER_RANK_BATCH, STEPS, ACCUMULATE, TP = 0.1, 2, 3, 2, 2


def make_strategy(name: str):
    return {
        "ddp_tuned": lambda: lp.TunedDDPStrategy(),
        "fsdp_blocks": lambda: lp.TransformerFSDPStrategy(),
        "hsdp": lambda: lp.HybridShardStrategy(),
        "tp_dp": lambda: lp.TensorParallelStrategy(tensor_parallel_size=TP),
        "auto_parallel": lambda: lp.AutoStrategy(),
    }[name]()


class ConformanceModule(L.LightningModule):
    """The one LightningModule of the suite: a table model, its loss, SGD; records every micro-batch loss."""

    def __init__(self, name: str):
        super().__init__()
        self.model = build(name)
        self.loss = loss_fn(name)
        self.losses: list[float] = []
        self.indices: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        loss = self.loss(self.model, batch)
        self.losses.append(loss.detach().float().item())
        self.indices.append(batch[-1].tolist())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def _parameters(module: torch.nn.Module) -> dict[str, list]:
    """Per parameter (name relative to the table model): local numel, full numel, full shape, placements."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in module.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        placements = [str(x) for x in p.placements] if isinstance(p, DTensor) else []
        out[name.removeprefix("model.")] = [local.numel(), p.numel(), list(p.shape), placements]
    return out


def _plan_summary(strategy) -> dict:
    """What the strategy decided, in its own words (for the report and the docs page)."""
    out: dict = {"strategy": strategy.strategy_name}
    fsdp = getattr(strategy, "plan", None)
    if fsdp is not None and hasattr(fsdp, "blocks"):
        out["groups"] = fsdp.blocks.describe()
        out["group_names"] = [name.removeprefix("model.") for name, _ in fsdp.blocks.blocks]
    tp = getattr(strategy, "tp_plan", None)
    if tp is not None:
        out["tp_layers"] = [[x.path.removeprefix("model."), x.style, x.reason] for x in tp.layers]
        out["tp_notes"] = list(tp.notes)
    advice = getattr(strategy, "advice", None)
    if advice is not None:
        out["advice_rule"] = f"rule {advice.rule.number} ({advice.rule.strategy}): {advice.rule.when}"
        out["advice_recommendation"] = advice.recommendation
    return out


def run_cell(ctx, model_name: str, strategy_name: str) -> dict:
    module = ConformanceModule(model_name)
    strategy = make_strategy(strategy_name)
    callbacks = [lp.SyncBatchNormConversion()] if MODELS[model_name].sync_batchnorm else []
    t = trainer(ctx, strategy, max_steps=STEPS, accumulate_grad_batches=ACCUMULATE, callbacks=callbacks)
    t.fit(module, DataLoader(dataset(model_name), batch_size=PER_RANK_BATCH))
    sampler = t.strategy.distributed_sampler_kwargs or {"num_replicas": 1, "rank": 0}
    plan = _plan_summary(t.strategy)
    if strategy_name == "auto_parallel":
        plan.update({k: v for k, v in _plan_summary(strategy).items() if k.startswith("advice")})
    return {
        "ok": True,
        "losses": torch.tensor(module.losses, dtype=torch.float64),
        "indices": module.indices,
        "dp_rank": int(sampler["rank"]),
        "dp_size": int(sampler["num_replicas"]),
        "params": _parameters(module),
        "plan": plan,
    }


def cells(ctx) -> dict:
    """Every cell of ``ctx.args["cells"]`` (``[model, strategy]`` pairs); failures recorded, not raised."""
    out = {}
    for model_name, strategy_name in ctx.args["cells"]:
        key = f"{model_name}/{strategy_name}"
        start = time.monotonic()
        try:
            result = run_cell(ctx, model_name, strategy_name)
        except Exception as err:  # the cell fails; the launch goes on to the next one
            result = {
                "ok": False,
                "error": f"{type(err).__name__}: {err}",
                "traceback": traceback.format_exc(),
            }
        result["wall_s"] = time.monotonic() - start
        torch.save(result, ctx.outdir / f"cell-{model_name}-{strategy_name}-rank{ctx.rank}.pt")
        out[key] = result
    return out
