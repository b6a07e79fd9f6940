"""ddp_tuned scenarios: each trains with a real Trainer on real gloo ranks and returns what it saw."""

from __future__ import annotations

import logging

import lightning as L
import torch
import torch.distributed as dist
import torchmetrics
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from lit_parallel import TunedDDPStrategy
from lit_parallel.measure.collectives import CollectiveStats, count_collectives

IN, HIDDEN, OUT = 16, 32, 4
LR = 0.1


class Net(nn.Module):
    """An MLP returning (logits, features); optionally with an auxiliary head that training never uses."""

    def __init__(self, aux_head: bool, hidden: int, depth: int):
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(IN, hidden), nn.Tanh()]
        for _ in range(depth - 1):
            layers += [nn.Linear(hidden, hidden), nn.Tanh()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(hidden, OUT)
        if aux_head:
            self.aux = nn.Linear(hidden, 2)

    def forward(self, x):
        h = self.body(x)
        return self.head(h), h


def make_net(seed: int = 0, *, aux_head: bool = False, hidden: int = HIDDEN, depth: int = 2) -> nn.Module:
    torch.manual_seed(seed)
    return Net(aux_head, hidden, depth)


def net_loss(net: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(net(x)[0], y)


def make_dataset(n: int = 40, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, IN, generator=g), torch.randint(0, OUT, (n,), generator=g))


class NetModule(L.LightningModule):
    """Wraps a net; records every micro-batch loss. ``self.net(...)`` is called, not ``self(...)``."""

    def __init__(self, net: nn.Module, *, dropout: float = 0.0, use_aux_on_first_batch_only: bool = False):
        super().__init__()
        self.net = net
        self.dropout = nn.Dropout(dropout)
        self.norm = nn.BatchNorm1d(IN) if dropout else nn.Identity()
        self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=OUT)
        self.use_aux_on_first_batch_only = use_aux_on_first_batch_only
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits, h = self.net(self.dropout(self.norm(x)))
        loss = nn.functional.cross_entropy(logits, y)
        if self.use_aux_on_first_batch_only and batch_idx == 0:
            loss = loss + 0.0 * self.net.aux(h).sum()
        self.train_acc(logits, y)
        self.log("train_loss", loss)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        h = self.net(x)[1]
        if hasattr(self.net, "aux"):
            self.log("aux_mean", self.net.aux(h).mean())
        self.log("val_loss", net_loss(self.net, batch))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def make_trainer(ctx, strategy, *, max_steps: int, accumulate: int = 1, clip: float | None = None, **kw):
    return L.Trainer(
        accelerator="cpu",
        devices=ctx.nprocs if not ctx.torchrun else dist.get_world_size(),
        strategy=strategy,
        max_steps=max_steps,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kw,
    )


def _state(module: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


class _LogCapture(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _capture_logs() -> _LogCapture:
    handler = _LogCapture()
    logging.getLogger("lit_parallel").addHandler(handler)
    return handler


def parity(ctx) -> dict:
    """Default ddp_tuned (auto buckets, probe) with accumulation 2 and norm clipping; 6 steps, 2 epochs."""
    logs = _capture_logs()
    strategy = TunedDDPStrategy() if ctx.args.get("strategy_object", True) else "ddp_tuned"
    model, info = NetModule(make_net(0)), _DDPInfo()
    trainer = make_trainer(ctx, strategy, max_steps=6, accumulate=2, clip=0.05, callbacks=[info])
    trainer.fit(model, DataLoader(make_dataset(), batch_size=4))
    s = trainer.strategy
    return {
        "strategy": type(s).__name__,
        "losses": model.losses,
        "params": _state(model.net),
        "find_unused": info.info["find_unused"],
        "bucket_caps": list(s.bucket_plan.cap_bytes_list),
        "logs": logs.messages,
        "world": trainer.world_size,
    }


def unused_head(ctx) -> dict:
    """A net with an auxiliary head used only in validation trains under default settings."""
    logs = _capture_logs()
    model, info, seen = NetModule(make_net(0, aux_head=True)), _DDPInfo(), _ModelSeen()
    aux_before = _state(model.net.aux)
    trainer = make_trainer(
        ctx,
        TunedDDPStrategy(),
        max_steps=5,
        accumulate=2,
        clip=0.05,
        val_check_interval=4,
        callbacks=[info, seen],
    )
    ds = make_dataset()
    trainer.fit(model, DataLoader(ds, batch_size=4), DataLoader(ds, batch_size=8))
    return {
        "losses": model.losses,
        "params": _state(model.net),
        "aux_before": aux_before,
        "find_unused": info.info["find_unused"],
        "unused": trainer.strategy.unused_parameters,
        "logs": logs.messages,
        "seen": seen.seen,
    }


def static_graph_unused_head(ctx) -> dict:
    """static_graph=True under find_unused_parameters='auto': no probe (DDP's static graph finds the unused
    auxiliary head itself), clipping on."""
    logs = _capture_logs()
    model, seen = NetModule(make_net(0, aux_head=True)), _ModelSeen()
    trainer = make_trainer(ctx, TunedDDPStrategy(static_graph=True), max_steps=4, clip=0.05, callbacks=[seen])
    trainer.fit(model, DataLoader(make_dataset(), batch_size=4))
    return {"losses": model.losses, "params": _state(model.net), "logs": logs.messages, "seen": seen.seen}


def probe_leaves_no_trace(ctx) -> dict:
    """Dropout, BatchNorm and a torchmetrics metric: the probe must not change RNG, buffers or metric state."""
    out = {}
    for mode in ("auto", False):
        torch.manual_seed(123)
        model, info, seen = NetModule(make_net(0), dropout=0.3), _DDPInfo(), _ModelSeen()
        trainer = make_trainer(
            ctx, TunedDDPStrategy(find_unused_parameters=mode), max_steps=4, callbacks=[info, seen]
        )
        trainer.fit(model, DataLoader(make_dataset(), batch_size=4))
        out[str(mode)] = {
            "losses": model.losses,
            "state": _state(model),
            "metric_updates": model.train_acc._update_count,
            "find_unused": info.info["find_unused"],
            "seen": seen.seen,
        }
    return out


class _DDPInfo(L.Callback):
    """What the wrapped DDP module looks like during training (Lightning unwraps it at teardown)."""

    def __init__(self):
        self.info: dict = {}

    def on_train_end(self, trainer, pl_module):
        ddp = trainer.strategy.model
        assert isinstance(ddp, DistributedDataParallel), type(ddp)
        self.info = {
            "caps": list(ddp.bucket_bytes_cap_list),
            "bucket_sizes": ddp._get_ddp_logging_data().get("bucket_sizes"),
            "find_unused": ddp.find_unused_parameters,
            "gradient_as_bucket_view": ddp.gradient_as_bucket_view,
            "net_compiled": getattr(pl_module.net, "_compiled_call_impl", None) is not None,
        }


class _ModelSeen(L.Callback):
    """What a callback sees as ``trainer.model`` (Lightning: the DDP wrapper once set up) at each hook of the
    first three batches, with the strategy's ``find_unused_parameters`` at that moment."""

    def __init__(self):
        self.seen: list[tuple] = []
        self._wrappers: list[int] = []

    def _record(self, hook: str, trainer) -> None:
        model = trainer.model
        if id(model) not in self._wrappers:
            self._wrappers.append(id(model))
        self.seen.append(
            (
                hook,
                type(model).__name__,
                model is trainer.strategy.model,
                isinstance(model, DistributedDataParallel) and model.module is trainer.lightning_module,
                self._wrappers.index(id(model)),
                trainer.strategy.find_unused_parameters,
            )
        )

    def on_fit_start(self, trainer, pl_module):
        self._record("on_fit_start", trainer)

    def on_train_start(self, trainer, pl_module):
        self._record("on_train_start", trainer)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx < 3 and trainer.current_epoch == 0:
            self._record(f"on_train_batch_start:{batch_idx}", trainer)

    def on_before_backward(self, trainer, pl_module, loss):
        if trainer.fit_loop.epoch_loop.batch_idx < 3 and trainer.current_epoch == 0:
            self._record(f"on_before_backward:{trainer.fit_loop.epoch_loop.batch_idx}", trainer)


class _CountPerBatch(L.Callback):
    """Collectives per training batch; the stats are reset after the strategy's own batch-start work."""

    def __init__(self):
        self.stats = CollectiveStats()
        self.per_batch: list[dict] = []

    def on_before_backward(self, trainer, pl_module, loss):
        # the probe (first batch) issues its own all-reduce before training_step; start counting here
        self.stats.reset()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.per_batch.append(
            {
                "calls": self.stats.calls["all_reduce"],
                "bytes": self.stats.bytes["all_reduce"],
                "other_calls": sum(v for k, v in self.stats.calls.items() if k != "all_reduce"),
            }
        )


def comm_bytes(ctx) -> dict:
    """Bytes all-reduced per micro-batch for the fp32 (Python all-reduce) and fp16 hooks, accumulation 2."""
    out = {}
    for hook in ("allreduce", "fp16"):
        counter, info = _CountPerBatch(), _DDPInfo()
        model = NetModule(make_net(0, hidden=64, depth=3))
        # find_unused_parameters=False: no probe step, so every step goes through the hook
        strategy = TunedDDPStrategy(comm_hook=hook, bucket_cap_mb=[0.01, 0.02], find_unused_parameters=False)
        trainer = make_trainer(ctx, strategy, max_steps=3, accumulate=2, callbacks=[counter, info])
        with count_collectives(counter.stats):  # 48 samples: 6 micro-batches of 4 per rank, 3 steps
            trainer.fit(model, DataLoader(make_dataset(48), batch_size=4))
        out[hook] = {
            "per_batch": counter.per_batch,
            "n_params": sum(p.numel() for p in model.net.parameters()),
            **info.info,
        }
    return out


def powersgd_bytes(ctx) -> dict:
    """PowerSGD (rank 2, warm-up 2) on gloo: one bucket, compressed payload after warm-up."""
    counter, info = _CountPerBatch(), _DDPInfo()
    model = NetModule(make_net(0, hidden=64, depth=3))
    strategy = TunedDDPStrategy(
        comm_hook="powersgd", powersgd_rank=2, powersgd_warmup_steps=2, find_unused_parameters=False
    )
    trainer = make_trainer(ctx, strategy, max_steps=5, callbacks=[counter, info])
    with count_collectives(counter.stats):
        trainer.fit(model, DataLoader(make_dataset(), batch_size=4))
    return {
        "per_batch": counter.per_batch,
        "shapes": [list(p.shape) for p in model.net.parameters()],
        "losses": model.losses,
        **info.info,
    }


def bucket_choice(ctx) -> dict:
    """Auto buckets on a model large enough for several buckets: the plan is what DDP uses."""
    info = _DDPInfo()
    model = NetModule(make_net(0, hidden=384, depth=3))
    trainer = make_trainer(ctx, TunedDDPStrategy(), max_steps=2, callbacks=[info])
    trainer.fit(model, DataLoader(make_dataset(), batch_size=4))
    s = trainer.strategy
    return {
        "plan": list(s.bucket_plan.cap_bytes_list),
        "ddp_caps": info.info["caps"],
        "gradient_as_bucket_view": info.info["gradient_as_bucket_view"],
        "measurement": s.allreduce_measurement.to_dict(),
        "bucket_sizes": info.info["bucket_sizes"],
        "grad_bytes": [p.numel() * 4 for p in reversed(list(model.parameters())) if p.requires_grad],
    }


def compile_parity(ctx) -> dict:
    """compile={"backend": "aot_eager"}: compiled before DDP, same numbers as the reference."""
    model, info = NetModule(make_net(0)), _DDPInfo()
    strategy = TunedDDPStrategy(compile={"backend": "aot_eager"})
    trainer = make_trainer(ctx, strategy, max_steps=6, accumulate=2, clip=0.05, callbacks=[info])
    trainer.fit(model, DataLoader(make_dataset(), batch_size=4))
    return {
        "losses": model.losses,
        "params": _state(model.net),
        "compiled_during_fit": info.info["net_compiled"],
        "restored_after_fit": getattr(model.net, "_compiled_call_impl", None) is None,
    }


def unused_on_later_step(ctx) -> dict:
    """A parameter used on the probed batch only: the error must name the fix."""
    model = NetModule(make_net(0, aux_head=True), use_aux_on_first_batch_only=True)
    trainer = make_trainer(ctx, TunedDDPStrategy(), max_steps=4)
    try:
        trainer.fit(model, DataLoader(make_dataset(), batch_size=4))
    except RuntimeError as err:
        return {"error": str(err)}
    return {"error": None}


class _StepPeaks(L.Callback):
    """Peak live bytes of each training batch (from its start to its end: the probe's optimizer step and the
    new wrapper it builds included), counted by a :class:`LiveMemory` open around the whole fit (so DDP's
    buckets, made when the model is wrapped, are counted)."""

    def __init__(self, tracker):
        self.tracker = tracker
        self.peaks: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        from lit_parallel.measure.live_memory import MemoryPeak

        self.tracker.peak = MemoryPeak(self.tracker.snapshot().total)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.peaks.append(self.tracker.peak.total)


def probe_memory(ctx) -> dict:
    """Peak bytes per step of ddp_tuned with the probe (find_unused_parameters="auto") and without it (False:
    a plain DDP step from the start), on a model whose gradients dominate (activations are tiny), SGD with
    momentum; plus the gradient bytes, for scale."""
    from lit_parallel.measure.live_memory import LiveMemory

    out = {}
    for mode in ("auto", False):
        model = NetModule(make_net(0, hidden=256, depth=4))
        model.configure_optimizers = lambda m=model: torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9)
        tracker, ddp_info = LiveMemory(model), _DDPInfo()
        peaks = _StepPeaks(tracker)
        strategy = TunedDDPStrategy(find_unused_parameters=mode)
        trainer = make_trainer(ctx, strategy, max_steps=2, callbacks=[peaks, ddp_info])
        with tracker:
            trainer.fit(model, DataLoader(make_dataset(), batch_size=4))
        out[str(mode)] = {"peaks": peaks.peaks, "find_unused": ddp_info.info["find_unused"]}
    out["grad_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return out


def average_gradients_in_place(ctx) -> dict:
    """lit_parallel.parallel.average_gradients on 2 ranks, chunks of 64 bytes: the gradients it returns (one
    used on both ranks, one only on rank 1, one big enough to go alone, one unused) and whether they are the
    same tensors as before (averaged in place)."""
    from lit_parallel.parallel import average_gradients

    rank = dist.get_rank()
    params = [nn.Parameter(torch.zeros(n)) for n in (3, 5, 40, 2)]
    params[0].grad = torch.full((3,), float(rank + 1))
    if rank == 1:
        params[1].grad = torch.arange(5.0)
    params[2].grad = torch.full((40,), 2.0 * (rank + 1))
    before = [p.grad for p in params]
    used = average_gradients(params, chunk_bytes=64)
    return {
        "used": used,
        "grads": [None if p.grad is None else p.grad.clone() for p in params],
        "in_place": [b is not None and p.grad is b for p, b in zip(params, before)],
    }
