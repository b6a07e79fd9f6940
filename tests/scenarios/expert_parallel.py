"""Scenarios for expert parallelism (``expert_parallel_size`` on fsdp_blocks, tp_dp and pp_dp), run on real
gloo ranks by tests/parallel/expert_parallel/test_expert_parallel.py. Each returns plain data; the tests
compute the expected values on their own (a single-process plain PyTorch reference, the routing of an
unsplit model, formulas) and compare.
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
from lit_parallel.parallel import ParallelDims
from lit_parallel.parallel.expert_parallel import plan_expert_parallel
from lit_parallel.parallel.parallelize import ParallelizeConfig, parallelize
from tests.moe_models import MODELS, VOCAB, lm_loss
from tests.scenarios.common import quiet_trainer

SEQ, PER_RANK_BATCH, LR = 8, 2, 0.1
STEPS, ACCUMULATE, CLIP = 3, 2, 0.5
SAMPLES = 48  # 3 steps x 2 micro-batches x 2 samples on up to 4 data-parallel ranks
MODEL_NAMES = ("mixtral", "qwen2_moe", "olmoe", "hand")


def lm_dataset(n: int = SAMPLES, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def data_parallel_loss(model: torch.nn.Module, batch, dp: int) -> torch.Tensor:
    """The loss N data-parallel ranks optimise on a global batch (rank 0's samples first): the mean of the
    ranks' own losses. Cross-entropy alone would equal one loss over the batch; a load-balancing loss is
    computed per rank's batch, as under any data parallelism."""
    tokens, targets = batch[0], batch[1]
    chunks = zip(tokens.chunk(dp), targets.chunk(dp))
    return sum(lm_loss(model, x, y) for x, y in chunks) / dp


def pipeline_loss(model: torch.nn.Module, batch) -> torch.Tensor:
    """pp_dp's loss: cross-entropy only (a pipeline's last stage returns the logits, not the router's)."""
    return F.cross_entropy(model(batch[0]).flatten(0, 1), batch[1].flatten())


class LitMoE(L.LightningModule):
    def __init__(self, name: str, momentum: float = 0.0):
        super().__init__()
        self.model = MODELS[name]()
        self.momentum = momentum
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = lm_loss(self.model, batch[0], batch[1])
        self.losses.append(loss.detach().item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=self.momentum)


class PipelinedMoE(L.LightningModule):
    """pp_dp's contract: forward(inputs) and pipeline_loss(output, targets)."""

    def __init__(self, name: str = "hand"):
        super().__init__()
        self.model = MODELS[name]()
        self.losses: list[float] = []

    def forward(self, tokens):
        return self.model(tokens)

    def pipeline_loss(self, output, targets):
        return F.cross_entropy(output.flatten(0, 1).float(), targets.flatten())

    def on_train_batch_end(self, outputs, batch, batch_idx):
        # Lightning hands callbacks the loss divided by accumulate_grad_batches (what backward used)
        self.losses.append(float(outputs["loss"]) * self.trainer.accumulate_grad_batches)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def _full_params(strategy, module: torch.nn.Module) -> dict:
    """The unsplit state on rank 0: every rank makes the tensors it holds whole (DTensor.full_tensor, a
    collective among the ranks sharing them), then every rank's go to rank 0 (other stages' layers under
    pp_dp, other ranks' module-list experts)."""
    from torch.distributed.tensor import DTensor

    mine = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone()
        for k, v in module.state_dict().items()
    }
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    merged: dict = {}
    for part in everyone:
        for k, v in part.items():
            merged.setdefault(k, v)
    return merged if dist.get_rank() == 0 else {}


def _dp_mean_losses(strategy, losses: list[float]) -> list[float]:
    group = strategy.parallel_dims.data_parallel_mesh().get_group()
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, losses, group=group)
    return [sum(step) / len(step) for step in zip(*everyone)]


def _holdings(module: torch.nn.Module, strategy) -> dict:
    """What this rank holds of every expert weight: its local tensor (a DTensor's shard) by name."""
    from torch.distributed.tensor import DTensor

    names = set()
    for layer in strategy.expert_plan.layers:
        names.update(layer.expert_parameter_names())
    out = {}
    for name, p in module.named_parameters():
        if name in names or any(name.startswith(f"{n}.") for n in names) or _in_expert_list(name, strategy):
            out[name] = (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
    return out


def _in_expert_list(name: str, strategy) -> bool:
    for layer in strategy.expert_plan.layers:
        if layer.kind == "module_list":
            prefix = ".".join(p for p in (layer.path, layer.experts_name) if p) + "."
            if name.startswith(prefix):
                return True
    return False


def _fit(ctx, strategy, module, *, steps: int = STEPS, ckpt_path=None, dataset=None, **kwargs):
    t = quiet_trainer(
        ctx, strategy, max_steps=steps, accumulate_grad_batches=ACCUMULATE, gradient_clip_val=CLIP, **kwargs
    )
    t.fit(module, DataLoader(dataset or lm_dataset(), batch_size=PER_RANK_BATCH), ckpt_path=ckpt_path)
    return t


def _parity(ctx, name: str, strategy, module=None) -> dict:
    module = module or LitMoE(name)
    t = _fit(ctx, strategy, module)
    s = t.strategy
    return {
        "losses": torch.tensor(_dp_mean_losses(s, module.losses), dtype=torch.float64),
        "params": _full_params(s, module),
        "holdings": _holdings(module, s),
        "mesh": list(s.device_mesh.mesh_dim_names),
        "dims": {
            "dp": s.parallel_dims.data_parallel,
            "ep": s.parallel_dims.expert_parallel,
            "ep_rank": s.parallel_dims.expert_mesh().get_local_rank(),
        },
        "layers": [(layer.path, layer.kind, layer.num_experts) for layer in s.expert_plan.layers],
        "dropped": s.expert_plan.stats.dropped,
    }


def _fsdp(ctx, ep: int) -> dict:
    return {
        name: _parity(ctx, name, lp.TransformerFSDPStrategy(expert_parallel_size=ep)) for name in MODEL_NAMES
    }


# --- launch: 2 ranks ------------------------------------------------------------------------------------


def parity_fsdp_ep2(ctx) -> dict:
    return _fsdp(ctx, 2)


def parity_fsdp_ep2_checkpointed(ctx) -> dict:
    """With activation checkpointing: the recomputed blocks exchange their tokens again in backward."""
    return {
        name: _parity(
            ctx, name, lp.TransformerFSDPStrategy(expert_parallel_size=2, activation_checkpointing=True)
        )
        for name in ("mixtral", "hand")
    }


def exchange_bytes(ctx) -> dict:
    """One forward and backward of a one-layer Mixtral split over 2 expert-parallel ranks, under torch's dispatch-level
    collective counter; returns the all-to-all bytes it saw and the exchange statistics."""
    world = dist.get_world_size()
    tokens = torch.randint(
        0, VOCAB, (world * PER_RANK_BATCH, SEQ), generator=torch.Generator().manual_seed(7)
    )
    mine = tokens[dist.get_rank() * PER_RANK_BATCH : (dist.get_rank() + 1) * PER_RANK_BATCH]
    out = {}
    for capacity in (None, 0.5):
        model = MODELS["mixtral"](layers=1)  # one layer: the routing of an unsplit model predicts all of it
        dims = ParallelDims.for_fsdp(world, expert_parallel=world)
        dims.build_mesh("cpu")
        plan = plan_expert_parallel(model, world, capacity_factor=capacity)
        parallelize(model, dims, ParallelizeConfig(expert_parallel=plan))
        with CommCounter() as counter:
            model(input_ids=mine).logits.sum().backward()
        a2a = [r for r in counter.records if r.kind == "all_to_all"]
        out["exact" if capacity is None else "capacity"] = {
            "all_to_all_bytes": sum(r.payload_bytes for r in a2a),
            "all_to_all_calls": len(a2a),
            "rows_sent": plan.stats.rows_sent,
            "rows_received": plan.stats.rows_received,
            "dropped": plan.stats.dropped,
            "calls": plan.stats.calls,
        }
    out["tokens"] = tokens
    return out


class Snapshot(L.Callback):
    """The unsplit weights right after optimizer step ``at`` (where ModelCheckpoint saves too)."""

    def __init__(self, at: int):
        self.at, self.params = at, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.at and self.params is None:
            self.params = _full_params(trainer.strategy, pl_module)


def _run_and_checkpoint(ctx, name: str, folder: Path, momentum: float = 0.0, **strategy_kwargs) -> dict:
    """4 optimizer steps without a break, a checkpoint after step 2 (ModelCheckpoint, inside the loop)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    module, snapshot = LitMoE(name, momentum), Snapshot(2)
    saver = ModelCheckpoint(dirpath=folder, filename="{step}", every_n_train_steps=2, save_top_k=-1)
    strategy = lp.TransformerFSDPStrategy(expert_parallel_size=2, **strategy_kwargs)
    _fit(ctx, strategy, module, steps=4, callbacks=[snapshot, saver], enable_checkpointing=True)
    return {
        "path": str(folder / "step=2.ckpt"),
        "saved": snapshot.params,
        "continued": module.losses[2 * ACCUMULATE :],
    }


def checkpoint_save(ctx) -> dict:
    """Train the hand-written MoE and Mixtral 4 steps with expert_parallel_size=2, checkpointing after step
    2; resume from that checkpoint with the same split and with none (expert_parallel_size=1) and train the
    last 2 steps again. Also a full (one-file) checkpoint of Mixtral, and the refusal of one for module-list
    experts."""
    root = Path(ctx.args["ckpt_dir"])
    out = {}
    for name in ("hand", "mixtral"):
        out[name] = _run_and_checkpoint(ctx, name, root / name)
        out[name]["resumed"] = {}
        for ep in (2, 1):
            again = LitMoE(name)
            strategy = lp.TransformerFSDPStrategy(expert_parallel_size=ep)
            _fit(ctx, strategy, again, steps=4, ckpt_path=out[name]["path"])
            out[name]["resumed"][ep] = again.losses
    # a full file (rank 0 writes it) of stacked experts (DTensors), with momentum: Lightning's full-file
    # resume reads the first optimizer state entry, and plain SGD has none
    full = _run_and_checkpoint(ctx, "mixtral", root / "full", 0.9, save_distributed_checkpoint=False)
    again = LitMoE("mixtral", momentum=0.9)
    _fit(ctx, lp.TransformerFSDPStrategy(expert_parallel_size=2), again, steps=4, ckpt_path=full["path"])
    out["mixtral_full"] = {**full, "resumed": again.losses}
    try:
        strategy = lp.TransformerFSDPStrategy(expert_parallel_size=2, save_distributed_checkpoint=False)
        _fit(ctx, strategy, LitMoE("hand"))
        out["hand_full_refused"] = ""
    except ValueError as err:
        out["hand_full_refused"] = str(err)
    return out


# --- launch: 4 ranks ------------------------------------------------------------------------------------


def parity_fsdp_ep2_of_4(ctx) -> dict:
    return _fsdp(ctx, 2)


def parity_fsdp_ep4(ctx) -> dict:
    return _fsdp(ctx, 4)


# OLMoE normalises q and k over all heads together (q_norm/k_norm of the full width): tp_dp's plan cannot
# split that, with or without experts
TP_MODEL_NAMES = ("mixtral", "qwen2_moe", "hand")


def parity_tp_dp(ctx) -> dict:
    return {
        name: _parity(
            ctx,
            name,
            lp.TensorParallelStrategy(data_parallel_size=2, tensor_parallel_size=2, expert_parallel_size=2),
        )
        for name in TP_MODEL_NAMES
    }


def parity_pp_dp(ctx) -> dict:
    strategy = lp.PipelineParallelStrategy(pipeline_parallel_size=2, microbatches=2, expert_parallel_size=2)
    return {"hand": _parity(ctx, "hand", strategy, PipelinedMoE("hand"))}


def checkpoint_reshard(ctx) -> dict:
    """Load the 2-rank checkpoints (expert_parallel_size=2) on 4 ranks with expert_parallel_size 4 and 2,
    and return the loaded weights, unsplit."""
    out = {}
    for name in ("hand", "mixtral"):
        path = ctx.args[f"{name}_ckpt"]
        for ep in (4, 2):
            module = LitMoE(name)
            t = quiet_trainer(ctx, lp.TransformerFSDPStrategy(expert_parallel_size=ep), max_steps=2)
            t.fit(module, DataLoader(lm_dataset(), batch_size=PER_RANK_BATCH), ckpt_path=path)
            # max_steps=2 was reached by the checkpoint: nothing trained, the loaded weights are unchanged
            out[f"{name}_ep{ep}"] = {"params": _full_params(t.strategy, module), "losses": module.losses}
    return out


class MetaMoE(LitMoE):
    """Built on the meta device in configure_model: each rank materialises only what it keeps."""

    def __init__(self, name: str):
        L.LightningModule.__init__(self)
        self.name, self.momentum, self.losses = name, 0.0, []

    def configure_model(self):
        if not hasattr(self, "model"):
            with torch.device("meta"):
                self.model = MODELS[self.name]()


def meta_init(ctx) -> dict:
    """Mixtral and the hand-written MoE built on the meta device under expert_parallel_size=2: trained 2
    steps, returned unsplit."""
    out = {}
    for name in ("hand", "mixtral"):
        module = MetaMoE(name)
        t = _fit(ctx, lp.TransformerFSDPStrategy(expert_parallel_size=2), module, steps=2)
        out[name] = {"losses": module.losses, "params": _full_params(t.strategy, module)}
    return out


class ValidatedMoE(LitMoE):
    def validation_step(self, batch, batch_idx):
        return lm_loss(self.model, batch[0], batch[1])


def init_from_file(ctx) -> dict:
    """``init_from=`` a full state dict (every expert) under expert_parallel_size=2: each rank keeps its
    experts (module-list experts: only its own keys). Returned unsplit after a validation (no step)."""
    out = {}
    for name in ("hand", "mixtral"):
        path = Path(ctx.args["ckpt_dir"]) / f"{name}_init.pt"
        if dist.get_rank() == 0:
            torch.save({f"model.{k}": v for k, v in MODELS[name](seed=5).state_dict().items()}, path)
        dist.barrier()
        module = ValidatedMoE(name)
        t = quiet_trainer(ctx, lp.TransformerFSDPStrategy(expert_parallel_size=2, init_from=str(path)))
        t.validate(module, DataLoader(lm_dataset(8), batch_size=PER_RANK_BATCH))
        out[name] = {"path": str(path), "params": _full_params(t.strategy, module)}
    return out
