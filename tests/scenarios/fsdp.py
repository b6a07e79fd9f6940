"""Scenarios for ``fsdp_blocks`` and ``hsdp``, run on real gloo ranks by tests/strategies/test_fsdp.py*.py.

Each scenario returns plain data (numbers, strings, tensors); the tests compute the expected values on
their own (plain PyTorch reference, formulas) and compare.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

import lit_parallel as lp
from lit_parallel.parallel import CommCounter, clip_grad_norm_, full_state_dict, training_state_bytes
from tests.models import GPT, GPTConfig, Llama, Seq2Seq, tanh_mlp
from tests.scenarios.common import quiet_trainer as trainer

VOCAB = 64
SEQ = 8


# --- data, models, losses (shared with the tests' references) -------------------------------------------


def lm_dataset(n: int = 32, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:], torch.arange(n))


def seq2seq_dataset(n: int = 32, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    tgt = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return TensorDataset(src, tgt[:, :-1], tgt[:, 1:], torch.arange(n))


def regression_dataset(n: int = 32, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    return TensorDataset(x, torch.sin(x[:, :4]) + 0.1 * torch.randn(n, 4, generator=g), torch.arange(n))


def mse_loss(model: torch.nn.Module, batch) -> torch.Tensor:
    return F.mse_loss(model(batch[0]).float(), batch[1])


def lm_loss(model: torch.nn.Module, batch) -> torch.Tensor:
    x, y = batch[0], batch[1]
    return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def seq2seq_loss(model: torch.nn.Module, batch) -> torch.Tensor:
    src, tgt_in, tgt_out = batch[0], batch[1], batch[2]
    return F.cross_entropy(model(src, tgt_in).flatten(0, 1).float(), tgt_out.flatten())


def build_model(name: str = "gpt", seed: int = 0, n_layer: int = 2) -> torch.nn.Module:
    torch.manual_seed(seed)
    if name == "gpt":
        return GPT(GPTConfig(n_layer=n_layer))
    if name == "llama":
        return Llama()
    if name == "seq2seq":
        return Seq2Seq()
    if name == "mlp":
        return tanh_mlp()
    raise ValueError(name)


LOSSES = {"gpt": lm_loss, "llama": lm_loss, "seq2seq": seq2seq_loss, "mlp": mse_loss}
DATASETS = {"gpt": lm_dataset, "llama": lm_dataset, "seq2seq": seq2seq_dataset, "mlp": regression_dataset}


class LitModel(L.LightningModule):
    """An ordinary LightningModule: ``training_step`` calls ``self.model``, never ``self.forward``."""

    def __init__(
        self, name: str = "gpt", lr: float = 0.1, optimizer: str = "sgd", n_layer: int = 2, build=True
    ):
        super().__init__()
        self.name, self.lr, self.optimizer_name, self.n_layer = name, lr, optimizer, n_layer
        self.model = build_model(name, n_layer=n_layer) if build else None
        self.losses: list[float] = []
        self.eval_losses: dict[str, list[float]] = {"val": [], "test": []}
        self.autocast_seen: list[bool] = []

    def training_step(self, batch, batch_idx):
        loss = LOSSES[self.name](self.model, batch)
        self.losses.append(loss.detach().float().item())
        self.autocast_seen.append(torch.is_autocast_enabled("cpu"))
        return loss

    def validation_step(self, batch, batch_idx):
        self.eval_losses["val"].append(LOSSES[self.name](self.model, batch).item())

    def test_step(self, batch, batch_idx):
        self.eval_losses["test"].append(LOSSES[self.name](self.model, batch).item())

    def predict_step(self, batch, batch_idx):
        return {"idx": batch[-1], "out": self.model(batch[0]).float()}

    def configure_optimizers(self):
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class MetaLitModel(LitModel):
    """Builds its model on the meta device in ``configure_model``: no rank materialises it whole."""

    def __init__(self, **kwargs):
        super().__init__(build=False, **kwargs)
        self.rng_state_at_init: torch.Tensor | None = None

    def configure_model(self):
        if self.model is not None:
            return
        with torch.device("meta"):
            self.model = GPT(GPTConfig(n_layer=self.n_layer))
        self.rng_state_at_init = torch.get_rng_state()


def loader(dataset, batch_size: int = 2) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size)


class CommRecorder(Callback):
    """Every collective of every training batch (forward, backward, clipping, optimizer step)."""

    def __init__(self):
        self.batches: list[list[tuple[str, int, int]]] = []
        self._counter: CommCounter | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._counter = CommCounter()
        self._counter.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        assert self._counter is not None
        self._counter.__exit__(None, None, None)
        self.batches.append([(r.kind, r.payload_bytes, r.group_size) for r in self._counter.records])


def _steps(batches: list[list[tuple[str, int, int]]], accumulate: int) -> list[dict]:
    """Collective counts and bytes per optimizer step."""
    out = []
    for start in range(0, len(batches), accumulate):
        records = [r for b in batches[start : start + accumulate] for r in b]
        step: dict = {"records": [list(r) for r in records]}
        for kind in ("all_gather", "reduce_scatter", "all_reduce", "broadcast"):
            step[kind] = sum(1 for r in records if r[0] == kind)
            step[kind + "_bytes"] = sum(r[1] for r in records if r[0] == kind)
        out.append(step)
    return out


def _full_on_rank0(module: torch.nn.Module) -> dict:
    state = full_state_dict(module)
    return {k: v.clone() for k, v in state.items()} if dist.get_rank() == 0 else {}


def _placements(module: torch.nn.Module) -> dict:
    from torch.distributed.tensor import DTensor

    return {n: str(p.placements) for n, p in module.named_parameters() if isinstance(p, DTensor)}


def _parity_run(ctx, strategy, name="gpt", max_steps=5, accumulate=2, clip=0.5, lr=0.1, **trainer_kwargs):
    model = LitModel(name=name, lr=lr)
    rec = CommRecorder()
    t = trainer(
        ctx,
        strategy,
        max_steps=max_steps,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
        callbacks=[rec],
        **trainer_kwargs,
    )
    t.fit(model, loader(DATASETS[name]()))
    return {
        "losses": torch.tensor(model.losses, dtype=torch.float64),
        "steps": _steps(rec.batches, accumulate),
        "params": _full_on_rank0(model),
        "placements": _placements(model),
        "autocast": any(model.autocast_seen),
        "precision_plugin": type(t.precision_plugin).__name__,
        "num_blocks": t.strategy.plan.blocks.num_blocks if getattr(t.strategy, "plan", None) else 0,
    }


# --- launch A: fsdp_blocks on 2 ranks -------------------------------------------------------------------


def parity_zero3(ctx) -> dict:
    return _parity_run(ctx, lp.TransformerFSDPStrategy(reshard_after_forward=True))


def parity_zero2(ctx) -> dict:
    return _parity_run(ctx, lp.TransformerFSDPStrategy(reshard_after_forward=False))


def parity_llama_seq2seq(ctx) -> dict:
    out = {}
    for name in ("llama", "seq2seq"):
        out[name] = _parity_run(ctx, "fsdp_blocks", name=name, max_steps=2, accumulate=1, clip=None)
    return out


def comm_vs_ddp(ctx) -> dict:
    """Bytes per optimizer step (no accumulation, no clipping) for ZeRO-3, ZeRO-2 and Lightning's DDP."""
    out = {}
    for label, strategy in (
        ("zero3", lp.TransformerFSDPStrategy(reshard_after_forward=True)),
        ("zero2", lp.TransformerFSDPStrategy(reshard_after_forward=False)),
        ("ddp", "ddp"),
    ):
        run = _parity_run(ctx, strategy, max_steps=2, accumulate=1, clip=None)
        step = run["steps"][1]  # the second step: DDP rebuilds its buckets after the first
        out[label] = {k: v for k, v in step.items()}
    return out


def memory_adamw(ctx) -> dict:
    model = LitModel(optimizer="adamw", lr=1e-3)
    t = trainer(ctx, "fsdp_blocks", max_steps=1)
    t.fit(model, loader(lm_dataset()))
    return training_state_bytes(model, t.optimizers[0])


def no_blocks_mlp(ctx) -> dict:
    """A plain MLP without repeated blocks under fsdp_blocks: parity run, then one AdamW step's memory."""
    from torch.distributed.fsdp import FSDPModule

    out = _parity_run(ctx, "fsdp_blocks", name="mlp")
    model = LitModel(name="mlp", optimizer="adamw", lr=1e-3)
    t = trainer(ctx, "fsdp_blocks", max_steps=1)
    t.fit(model, loader(regression_dataset()))
    out["memory"] = training_state_bytes(model, t.optimizers[0])
    out["how"] = t.strategy.plan.blocks.how
    out["summary"] = t.strategy.plan.summary()
    out["groups"] = [name for name, _ in t.strategy.plan.blocks.blocks]
    out["fsdp_modules"] = [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    return out


class _SetupProfiler(Callback):
    """CPU allocations between the ``setup`` hook (before configure_model) and ``on_fit_start`` (after the
    strategy sharded the model): the largest single allocation and the peak of live bytes."""

    def setup(self, trainer, pl_module, stage):
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()

    def on_fit_start(self, trainer, pl_module):
        self._prof.__exit__(None, None, None)
        events = sorted(self._prof.events(), key=lambda e: e.time_range.start)
        live = peak = largest = 0
        for e in events:
            delta = e.self_cpu_memory_usage if e.name != "[memory]" else e.cpu_memory_usage
            largest = max(largest, delta)
            live += delta
            peak = max(peak, live)
        self.largest, self.peak = largest, peak
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # every rank gathers the full weights: they must be identical on all ranks
        self.full = get_model_state_dict(pl_module, options=StateDictOptions(full_state_dict=True))
        self.full = {k: v.detach().clone() for k, v in self.full.items()}


def meta_init(ctx) -> dict:
    model = MetaLitModel(n_layer=4)
    prof = _SetupProfiler()
    t = trainer(ctx, "fsdp_blocks", max_steps=1, callbacks=[prof])
    t.fit(model, loader(lm_dataset()))
    return {
        "largest_alloc": prof.largest,
        "peak": prof.peak,
        "full": prof.full,
        "rng_state": model.rng_state_at_init,
        "shard_numel": sum(p.to_local().numel() for p in model.parameters()),
    }


def pretrained_load(ctx) -> dict:
    """``init_from``: rank 0 reads the file; the other ranks get a path that does not exist."""
    path = ctx.args["pretrained"] if ctx.rank == 0 else "/nonexistent/weights.pt"
    model = MetaLitModel(n_layer=2)
    seen = {}

    class Grab(Callback):
        def on_fit_start(self, trainer, pl_module):
            seen["full"] = _full_on_rank0(pl_module)

    t = trainer(ctx, lp.TransformerFSDPStrategy(init_from=path), max_steps=1, callbacks=[Grab()])
    t.fit(model, loader(lm_dataset()))
    return seen


def evaluation(ctx) -> dict:
    """validate / test / predict under fsdp_blocks (ZeRO-3 and ZeRO-2) and hsdp."""
    out = {}
    for label, strategy in (
        ("fsdp", lp.TransformerFSDPStrategy()),
        ("fsdp_zero2", lp.TransformerFSDPStrategy(reshard_after_forward=False)),
        ("hsdp", lp.HybridShardStrategy(shard_size=ctx.world_size // 2)),
    ):
        model = LitModel()
        t = trainer(ctx, strategy)
        data = loader(lm_dataset(n=16, seed=1))
        t.validate(model, data, verbose=False)
        t.test(model, data, verbose=False)
        preds = t.predict(model, data)
        out[label] = {
            "val": model.eval_losses["val"],
            "test": model.eval_losses["test"],
            "pred_idx": torch.cat([p["idx"] for p in preds]),
            "pred_out": torch.cat([p["out"] for p in preds]),
        }
    return out


def precision_modes(ctx) -> dict:
    out = {}
    for precision in ("bf16-mixed", "bf16-true"):
        model = LitModel()
        dtypes = {}

        def hook(module, args, output, dtypes=dtypes):
            dtypes["weight"] = str(module.weight.dtype)
            dtypes["input"] = str(args[0].dtype)
            dtypes["output"] = str(output.dtype)

        model.model.h[0].attn.c_attn.register_forward_hook(hook)
        t = trainer(ctx, "fsdp_blocks", precision=precision, max_steps=2)
        t.fit(model, loader(lm_dataset()))
        p = model.model.h[0].attn.c_attn.weight
        out[precision] = {
            "compute": dict(dtypes),
            "sharded_param": str(p.dtype),
            "grad": str(p.grad.dtype),
            "autocast": any(model.autocast_seen),
            "trainer_precision": t.precision,
            "losses": model.losses,
        }
    return out


def checkpointing_compile_offload(ctx) -> dict:
    """Activation checkpointing + per-block compile + cpu_offload (a warned no-op on CPU) change nothing."""
    plain = _parity_run(ctx, "fsdp_blocks", max_steps=2, accumulate=1, clip=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy = lp.TransformerFSDPStrategy(
            activation_checkpointing=True, compile={"backend": "eager"}, cpu_offload=True
        )
        fancy = _parity_run(ctx, strategy, max_steps=2, accumulate=1, clip=None)
    return {
        "plain": plain["losses"],
        "fancy": fancy["losses"],
        "plain_params": plain["params"],
        "fancy_params": fancy["params"],
        "warnings": [str(w.message) for w in caught if "cpu_offload" in str(w.message)],
    }


def clip_mixed_dtensor(ctx) -> dict:
    """clip_grad_norm_ over a sharded DTensor, a replicated DTensor and a plain tensor at once."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ctx.world_size,))
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(8, 4, generator=g), torch.randn(6, generator=g), torch.randn(3, 3, generator=g)]
    grads = [torch.randn(t.shape, generator=g) for t in full]
    params = [
        torch.nn.Parameter(distribute_tensor(full[0], mesh, [Shard(0)])),
        torch.nn.Parameter(distribute_tensor(full[1], mesh, [Replicate()])),
        torch.nn.Parameter(full[2].clone()),
    ]

    def set_grads():  # copies: clipping scales gradients in place, and shards may be views
        params[0].grad = distribute_tensor(grads[0].clone(), mesh, [Shard(0)])
        params[1].grad = distribute_tensor(grads[1].clone(), mesh, [Replicate()])
        params[2].grad = grads[2].clone()

    set_grads()
    torch_error = ""
    try:
        torch.nn.utils.clip_grad_norm_(params, 1.0)
    except Exception as err:  # what Lightning's ModelParallelStrategy runs into
        torch_error = f"{type(err).__name__}: {err}"
    set_grads()  # torch may have scaled some gradients before failing: start again
    total = clip_grad_norm_(params, 1.0)
    return {
        "total": total,
        "clipped": [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in params],
        "grads": grads,
        "torch_error": torch_error,
    }


def prebuilt_dtensors(ctx) -> dict:
    """fsdp_blocks and tp_dp parallelize the model themselves: a model that configure_model already
    sharded is refused, with what to do instead."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lit_parallel import TensorParallelStrategy, TransformerFSDPStrategy

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    fully_shard(model, mesh=init_device_mesh("cpu", (ctx.world_size,)))
    out = {}
    for strategy in (TransformerFSDPStrategy(), TensorParallelStrategy()):
        strategy.model = model
        try:
            strategy._parallelize()
        except TypeError as err:
            out[type(strategy).__name__] = str(err)
    return out


# --- launch B: 4 ranks ----------------------------------------------------------------------------------


def hsdp_parity(ctx) -> dict:
    from lit_parallel.parallel.mesh import DP, DP_REPLICATE, DP_SHARD

    strategy = lp.HybridShardStrategy(shard_size=2)
    run = _parity_run(ctx, strategy)
    run["mesh_dims"] = list(strategy.device_mesh.mesh_dim_names)
    run["mesh_shape"] = list(strategy.device_mesh.shape)
    run["dp_size"] = strategy.parallel_dims.data_parallel_mesh().size()
    run["sampler"] = strategy.distributed_sampler_kwargs
    run["names"] = [DP, DP_REPLICATE, DP_SHARD]
    return run


def _opt_state_on_rank0(module, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    state = get_optimizer_state_dict(
        module, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return state if dist.get_rank() == 0 else {}


def checkpoint_save(ctx) -> dict:
    """Save sharded and full checkpoints after 2 epochs on 4 ranks; resume to 4 epochs and compare with an
    uninterrupted run."""
    out_dir = Path(ctx.args["ckpt_dir"])
    data = lm_dataset()

    def fit(strategy, max_epochs, ckpt_path=None):
        model = LitModel(optimizer="adamw", lr=1e-2)
        t = trainer(ctx, strategy, max_epochs=max_epochs)
        t.fit(model, loader(data), ckpt_path=ckpt_path)
        return t, model

    t_full, m_full = fit("fsdp_blocks", 4)
    t_half, m_half = fit("fsdp_blocks", 2)
    t_half.save_checkpoint(out_dir / "sharded")
    saved = {
        "model": _full_on_rank0(m_half),
        "optimizer": _opt_state_on_rank0(m_half, t_half.optimizers[0]),
        "global_step": t_half.global_step,
        "epoch": t_half.current_epoch,
        "memory": training_state_bytes(m_half, t_half.optimizers[0]),
    }
    t_file, m_file = fit(lp.TransformerFSDPStrategy(save_distributed_checkpoint=False), 2)
    t_file.save_checkpoint(out_dir / "full.ckpt")
    saved["file_model"] = _full_on_rank0(m_file)
    saved["file_optimizer"] = _opt_state_on_rank0(m_file, t_file.optimizers[0])
    t_res, m_res = fit("fsdp_blocks", 4, ckpt_path=out_dir / "sharded")
    return {
        "saved": saved,
        "uninterrupted": torch.tensor(m_full.losses, dtype=torch.float64),
        "first_half": torch.tensor(m_half.losses, dtype=torch.float64),
        "resumed": torch.tensor(m_res.losses, dtype=torch.float64),
        "resumed_params": _full_on_rank0(m_res),
        "uninterrupted_params": _full_on_rank0(m_full),
    }


# --- launches C, D: load on fewer ranks -----------------------------------------------------------------


def checkpoint_load(ctx) -> dict:
    """Restore the 4-rank checkpoints (sharded and full file) here; no further training step."""
    out = {}
    for label, path in (("sharded", ctx.args["sharded"]), ("file", ctx.args["file"])):
        model = LitModel(optimizer="adamw", lr=1e-2)
        t = trainer(ctx, "fsdp_blocks", max_epochs=2)
        t.fit(model, loader(lm_dataset()), ckpt_path=path)
        out[label] = {
            "model": _full_on_rank0(model),
            "optimizer": _opt_state_on_rank0(model, t.optimizers[0]),
            "global_step": t.global_step,
            "epoch": t.current_epoch,
            "trained": len(model.losses),
        }
    return out


# --- launch E: two torchrun "nodes" ---------------------------------------------------------------------


def hsdp_two_nodes(ctx) -> dict:
    strategy = lp.HybridShardStrategy()  # shard_size="auto": devices per node
    model = LitModel()
    seen: list[int] = []

    class Indices(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.extend(batch[-1].tolist())

    t = trainer(ctx, strategy, max_epochs=1, callbacks=[Indices()])
    t.fit(model, loader(lm_dataset(n=16)))
    return {
        "node_rank": t.node_rank,
        "num_nodes": t.num_nodes,
        "shard": strategy.parallel_dims.data_parallel_shard,
        "replicate": strategy.parallel_dims.data_parallel_replicate,
        "placements": _placements(model),
        "indices": seen,
        "losses": model.losses,
    }


# --- launch F: Lightning's own launcher -----------------------------------------------------------------


def lightning_launcher(ctx) -> dict:
    """String names, Lightning's launcher, and fit -> validate -> a second Trainer in the same processes."""
    model = LitModel()
    t = trainer(ctx, "fsdp_blocks", max_steps=2)
    t.fit(model, loader(lm_dataset()))
    t.validate(model, loader(lm_dataset(n=8, seed=1)), verbose=False)
    first = {
        "rank": t.global_rank,
        "world": t.world_size,
        "losses": model.losses,
        "val": model.eval_losses["val"],
    }
    model2 = LitModel()
    t2 = trainer(ctx, "hsdp", max_steps=2)
    t2.fit(model2, loader(lm_dataset()))
    return {
        "first": first,
        "second_losses": model2.losses,
        "second_strategy": type(t2.strategy).__name__,
        "same_mesh": t2.strategy.device_mesh is t.strategy.device_mesh,
    }


# --- GPU only (tests/strategies/test_fsdp_gpu.py) ------------------------------------------------------------------


def gpu_fsdp(ctx) -> dict:
    """On CUDA: fp32 parity, CPU offload (shards and optimizer step in CPU memory), bf16-mixed."""
    out = {}
    for label, strategy, precision in (
        ("fp32", lp.TransformerFSDPStrategy(), "32-true"),
        ("offload", lp.TransformerFSDPStrategy(cpu_offload=True), "32-true"),
        ("bf16", lp.TransformerFSDPStrategy(), "bf16-mixed"),
    ):
        model = LitModel()
        t = trainer(
            ctx,
            strategy,
            accelerator="gpu",
            precision=precision,
            max_steps=3,
            accumulate_grad_batches=2,
            gradient_clip_val=0.5,
        )
        t.fit(model, loader(lm_dataset()))
        out[label] = {
            "losses": torch.tensor(model.losses, dtype=torch.float64),
            "params": _full_on_rank0(model),
            "shard_devices": sorted({p.to_local().device.type for p in model.parameters()}),
        }
    return out


# --- the parallelize pipeline on its own, without a Trainer ----------------------------------------------


def parallelize_without_trainer(ctx) -> dict:
    """``ParallelDims`` + ``parallelize`` on a plain module: rank 1 starts from other weights (rank 0's must
    win), activation checkpointing on, 3 SGD steps with clipping; each rank takes its half of a global batch."""
    from lit_parallel.parallel import ParallelDims, ParallelizeConfig, parallelize

    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model("gpt", seed=rank)  # different initialisations: parallelize syncs rank 0's
    dims = ParallelDims.for_fsdp(world)
    dims.build_mesh("cpu")
    plan = parallelize(model, dims, ParallelizeConfig(activation_checkpointing=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y, _ = lm_dataset(n=12).tensors  # 3 global batches of 4
    losses = []
    for step in range(3):
        bx = x[4 * step : 4 * step + 4].chunk(world)[rank]
        by = y[4 * step : 4 * step + 4].chunk(world)[rank]
        loss = F.cross_entropy(model(bx).flatten(0, 1), by.flatten())
        loss.backward()
        clip_grad_norm_(list(model.parameters()), 0.5)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {
        "losses": torch.tensor(losses, dtype=torch.float64),
        "params": _full_on_rank0(model),
        "blocks": plan.num_blocks,
        "fsdp_groups": sum(type(m).__name__.startswith("FSDP") for m in model.modules()),
        "checkpointed": sum(bool(getattr(m, "_lp_activation_checkpointing", False)) for m in model.modules()),
    }


# --- LiveMemory's categories under FSDP2 (tests/strategies/test_fsdp.py computes the bytes from the shapes) ---------

LIVE_IN, LIVE_OUT, LIVE_BATCH = 8, 6, 4


def live_memory_categories(ctx) -> dict:
    """One Linear block (fully_shard) in a root without parameters; one step measured by LiveMemory, with
    its split taken inside the block's forward, once both unsharded gradients exist, and after backward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lit_parallel.measure.live_memory import LiveMemory

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(LIVE_IN, LIVE_OUT), torch.nn.Tanh())
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randn(LIVE_BATCH, LIVE_IN, requires_grad=True)
    model(x).sum().backward()  # a first step: FSDP2's buffers exist, as in the measured steady state
    for p in model.parameters():
        p.grad = None
    seen: dict[str, dict[str, int]] = {}
    with LiveMemory(model) as live:

        def inside_block(module, args, output) -> None:  # before FSDP2's own hook reshards the block
            seen["forward"] = live.snapshot().by_category
            gathered = [module.weight, module.bias]  # the unsharded parameters, while the block runs
            done: list[torch.Tensor] = []

            def unsharded_grad(p) -> None:  # runs after LiveMemory's hook on the same parameter
                done.append(p)
                if len(done) == len(gathered):
                    seen["unsharded grads"] = live.snapshot().by_category

            for p in gathered:
                p.register_post_accumulate_grad_hook(unsharded_grad)

        hook = model[0].register_forward_hook(inside_block, prepend=True)
        out = model(x)
        hook.remove()
        out.sum().backward()
        seen["after backward"] = live.snapshot().by_category
    return seen
