"""The sections of the device check: each a function ``(where) -> dict`` run in its own process.

Each returns what it measured; an ``AssertionError`` or any other exception marks it failed (the runner
records the traceback and goes on). ``SECTIONS`` lists them in the order they run: the ones most likely to
find a CUDA-only defect first, throughput last.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import lightning as L
import torch

import lit_parallel as lp
from lit_parallel.measure.host_syncs import HostSyncCounter
from tests.gpu.common import (
    REPO_ROOT,
    GPTModule,
    StepPeaks,
    Where,
    cuda_sync_warnings,
    finite,
    largest_block_bytes,
    lm_loss,
    loader,
    median,
    model_bytes,
    token_data,
    trainer,
)

STRATEGIES = ("ddp", "ddp_tuned", "fsdp_blocks", "hsdp", "tp_dp", "pp_dp", "auto_parallel")
STEPS = 6
SYNC_WINDOW = (2, 5)  # batch indices of steps 3 to 6: after warm-up, the probe and the first allocations


MICROBATCHES = 2  # pp_dp's, at size 1


def make_strategy(name: str, **kwargs: Any) -> Any:
    """``name`` at size 1 (one device); Lightning's own ``ddp`` is the reference."""
    if name == "ddp":
        return "ddp"
    if name == "pp_dp":
        return lp.PipelineParallelStrategy(pipeline_parallel_size=1, microbatches=MICROBATCHES, **kwargs)
    cls = {
        "ddp_tuned": lp.TunedDDPStrategy,
        "fsdp_blocks": lp.TransformerFSDPStrategy,
        "hsdp": lp.HybridShardStrategy,
        "tp_dp": lp.TensorParallelStrategy,
        "auto_parallel": lp.AutoStrategy,
    }[name]
    return cls(**kwargs)


# --- the environment -------------------------------------------------------------------------------------


def environment(where: Where) -> dict:
    import lightning

    out: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "cuda_available": torch.cuda.is_available(),
    }
    for name in ("transformers", "torchmetrics", "jsonargparse"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = None
    if where.cuda:
        assert torch.cuda.is_available(), "the device check needs CUDA (or --dry-run)"
        props = torch.cuda.get_device_properties(0)
        out.update(
            device=props.name,
            capability=f"{props.major}.{props.minor}",
            memory_bytes=props.total_memory,
            device_count=torch.cuda.device_count(),
            cuda=torch.version.cuda,
            nccl=".".join(map(str, torch.cuda.nccl.version())),
            bf16=torch.cuda.is_bf16_supported(),
        )
    return out


# --- each strategy at size 1: bf16-mixed, clipping, host syncs, peaks against the planner ----------------


class _SyncWindow(L.Callback):
    """Counts host synchronisations over steps 3 to 6: ``aten._local_scalar_dense`` calls (every
    ``.item()``/``float(t)``/``bool(t)``; on CUDA those of device tensors only) and, on CUDA, every
    synchronisation the driver sees (``set_sync_debug_mode("warn")``: device-to-host copies too).

    AdamW reads its step counters (CPU tensors) with ``.item()`` on every step: no device waits for those,
    so they are not counted."""

    def __init__(self, where: Where):
        self.where = where
        self.counter = _DeviceSyncs(cpu_reads=where.dry)
        self.cuda_syncs: list[str] = []
        self._ctx: Any = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == SYNC_WINDOW[0]:
            self.counter.exclude = {
                id(state["step"])
                for opt in trainer.optimizers
                for state in opt.state.values()
                if isinstance(state.get("step"), torch.Tensor)
            }
            self._ctx = cuda_sync_warnings(self.where, self.cuda_syncs)
            self._ctx.__enter__()
            self.counter.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == SYNC_WINDOW[1]:
            self.counter.__exit__(None, None, None)
            self._ctx.__exit__(None, None, None)

    def per_step(self) -> dict:
        steps = SYNC_WINDOW[1] - SYNC_WINDOW[0] + 1
        return {
            "steps": steps,
            "local_scalar_dense": self.counter.count / steps,
            "cuda_syncs": len(self.cuda_syncs) / steps,
            "cuda_sync_messages": sorted(set(self.cuda_syncs))[:10],
        }


class _DeviceSyncs(HostSyncCounter):
    """The package's counter, less the reads that make no device wait: the listed tensors (AdamW's step
    counters), and on a GPU run every CPU tensor."""

    def __init__(self, cpu_reads: bool):
        super().__init__()
        self.cpu_reads = cpu_reads
        self.exclude: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.name() == "aten::_local_scalar_dense" and args:
            t = args[0]
            if id(t) in self.exclude or (not self.cpu_reads and t.device.type == "cpu"):
                return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def _predicted_peak(where: Where, name: str) -> float | None:
    from lit_parallel.planner.memory.predict import predict_peaks

    cfg, b = where.config(), where.batch_size()
    with torch.device("meta"):
        model = GPTModule(cfg).model
    report = predict_peaks(
        model,
        precision="bf16-mixed",
        devices=1,
        batch_size=b,
        block_names=[f"h.{i}" for i in range(cfg.n_layer)],
        device_type="cuda",
        example_inputs=torch.zeros(b, cfg.block_size, dtype=torch.long, device="meta"),
    )
    key = "ddp_tuned" if name == "ddp" else name
    return report.peaks[key].total if key in report.peaks else None


def strategy_run(name: str) -> Callable[[Where], dict]:
    def run(where: Where) -> dict:
        cfg, b = where.config(), where.batch_size()
        module = GPTModule(cfg)
        weights = model_bytes(module.model)
        block = largest_block_bytes(module.model)
        ours = {} if name == "ddp" else {"preemption_signal": "SIGUSR1"}  # the preemption check is on
        peaks, syncs = StepPeaks(where), _SyncWindow(where)
        t = trainer(
            where,
            strategy=make_strategy(name, **ours),
            precision="bf16-mixed",
            max_steps=STEPS,
            gradient_clip_val=1.0,
            callbacks=[peaks, syncs],
        )
        if where.cuda:
            torch.cuda.reset_peak_memory_stats()
        t.fit(module, loader(cfg, STEPS * b, b))
        losses = module.loss_values()
        assert len(losses) == STEPS and finite(losses), f"{name}: losses {losses}"
        out: dict[str, Any] = {
            "strategy": type(t.strategy).__name__,
            "losses": losses,
            "host_syncs_per_step": syncs.per_step(),
            "weights_bytes": weights,
        }
        if where.cuda:
            predicted = _predicted_peak(where, name)
            out.update(
                setup_peak_bytes=peaks.setup_peak,
                # the rank's own weights plus at most one block in flight while they are moved and synced
                setup_bound_bytes=weights + block,
                step_peak_bytes={"1": peaks.peaks[0], "3": peaks.peaks[2]},
                predicted_peak_bytes=predicted,
            )
            if predicted:
                out["measured_over_predicted"] = {k: v / predicted for k, v in out["step_peak_bytes"].items()}
        return out

    run.__name__ = f"strategy_{name}"
    return run


# --- DDP's gradient compression hooks ---------------------------------------------------------------------


def ddp_comm_hooks(where: Where) -> dict:
    cfg, b = where.config(), where.batch_size()
    out = {}
    # bf16 compression needs NCCL: the strategy refuses it on gloo (its own test), so the dry run skips it
    for hook in ("bf16", "fp16", "powersgd") if where.cuda else ("fp16", "powersgd"):
        module = GPTModule(cfg)
        kw = {"powersgd_warmup_steps": 2} if hook == "powersgd" else {}
        t = trainer(
            where, strategy=lp.TunedDDPStrategy(comm_hook=hook, **kw), max_steps=4, precision="bf16-mixed"
        )
        t.fit(module, loader(cfg, 4 * b, b))
        losses = module.loss_values()
        assert len(losses) == 4 and finite(losses), f"comm_hook={hook}: losses {losses}"
        out[hook] = losses
    return out


# --- torch.compile with a smaller last batch (a recompile late in training) under the stall watchdog -------


def compile_last_batch(where: Where) -> dict:
    cfg, b = where.config(), where.batch_size()
    samples = 3 * b + 1  # the epoch's last batch holds one sample: a new shape, so a recompile
    # inductor on CUDA; on the CPU dry run dynamo still traces and recompiles, without inductor's minutes
    compile_arg: Any = True if where.cuda else {"backend": "eager"}
    out = {}
    for name in ("ddp_tuned", "fsdp_blocks"):
        module = GPTModule(cfg)
        peaks = StepPeaks(where)
        # a stall limit far below a compile's duration: the watchdog must pause while torch compiles
        t = trainer(
            where,
            strategy=make_strategy(name, compile=compile_arg, stall_timeout=30.0),
            precision="bf16-mixed",
            max_epochs=2,
            callbacks=[peaks],
        )
        t.fit(module, loader(cfg, samples, b))
        losses = module.loss_values()
        assert len(losses) == 8 and finite(losses), f"{name}: losses {losses}"
        out[name] = {"losses": losses, "step_seconds": [round(x, 3) for x in peaks.times]}
    return out


# --- meta-device models: init_from, reset_parameters, buffers nothing initialises --------------------------


def meta_init(where: Where) -> dict:
    cfg, b = where.config(), where.batch_size()
    reference = GPTModule(cfg, seed=3)
    path = where.tmp / "init_from.pt"
    torch.save(reference.state_dict(), path)  # the LightningModule's keys ("model.h.0..."), as a user saves
    expected = {k: v.float() for k, v in reference.model.state_dict().items()}
    out = {}
    for name in ("fsdp_blocks", "tp_dp", "pp_dp"):
        module = GPTModule(cfg, meta=True)
        t = trainer(where, strategy=make_strategy(name, init_from=str(path)), max_steps=1)
        # lr 0: the one step leaves the weights as loaded
        module.lr = 0.0
        t.fit(module, loader(cfg, b, b))
        got = _full_state(module.model)
        worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
        assert worst == 0.0, f"{name}: init_from differs from the file by {worst}"
        out[name] = {"max_abs_diff": worst, "loss": module.loss_values()[0]}
    out["uninitialised_buffer"] = _uninitialised_buffer_error(where)
    return out


def _full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().float().cpu()
        for k, v in model.state_dict().items()
    }


def _uninitialised_buffer_error(where: Where) -> dict:
    """A module whose buffer nothing initialises, built on meta: materialising it is an error naming it."""
    from lit_parallel.parallel.materialize import materialize_blocks

    class Table(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.arange(8.0), persistent=False)

    with torch.device("meta"):
        m = torch.nn.Sequential(torch.nn.Linear(4, 4), Table())
    try:
        list(materialize_blocks(m, [], where.device))
    except Exception as err:  # noqa: BLE001  (the message is what is checked)
        text = str(err)
        assert "table" in text and "Table" in text, text
        return {"raised": type(err).__name__, "message": text.splitlines()[0]}
    raise AssertionError("materialising a buffer nothing initialises did not raise")


# --- save and resume -------------------------------------------------------------------------------------


def _stopped_and_resumed(where: Where, name: str, tag: str, **first_kwargs: Any) -> dict:
    """A run stopped at step 3 (saving with ``first_kwargs``) and resumed to step 6, against the uninterrupted
    run: the worst relative difference of the losses."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    cfg, b = where.config(), where.batch_size()
    data = loader(cfg, 6 * b, b)
    full = GPTModule(cfg)
    trainer(where, strategy=make_strategy(name), max_steps=6).fit(full, data)
    ckpt_dir = where.tmp / f"{tag}_{name}"
    first = GPTModule(cfg)
    save = ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_train_steps=3)
    trainer(
        where,
        strategy=make_strategy(name, **first_kwargs),
        max_steps=3,
        enable_checkpointing=True,
        callbacks=[save],
    ).fit(first, data)
    second = GPTModule(cfg, seed=99)  # other weights: the checkpoint must replace them
    trainer(where, strategy=make_strategy(name), max_steps=6).fit(
        second, data, ckpt_path=str(ckpt_dir / "last.ckpt")
    )
    resumed = first.loss_values() + second.loss_values()
    worst = max(abs(x - y) / max(abs(y), 1e-6) for x, y in zip(resumed, full.loss_values()))
    # the same kernels in the same order; CUDA's atomics in the embedding's backward are the only slack
    assert worst < 1e-4, f"{name}: resumed losses {resumed} vs uninterrupted {full.loss_values()}"
    return {"max_rel_diff": worst, "losses": resumed}


def save_resume(where: Where) -> dict:
    return {name: _stopped_and_resumed(where, name, "ckpt") for name in ("ddp_tuned", "fsdp_blocks")}


def async_save(where: Where) -> dict:
    """``async_checkpoint=True`` on the device: the host copy is page-locked (CUDA) and reused, the time a
    save holds training (the copy) against a synchronous save of the same state, and a resume from the
    background-written checkpoint continues the uninterrupted losses."""
    import time

    from lightning.pytorch.callbacks import Callback

    class SaveTimes(Callback):
        def __init__(self):
            self.seconds: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            path = where.tmp / f"timed_{type(trainer.strategy).__name__}_{batch_idx}.ckpt"
            if where.cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
            trainer.save_checkpoint(path)
            self.seconds.append(time.perf_counter() - started)

    cfg, b = where.config(), where.batch_size()
    out = {}
    for name in ("ddp_tuned", "fsdp_blocks"):
        data = loader(cfg, 6 * b, b)
        timed = {}
        for label, setting in (("sync", False), ("async", True)):
            times = SaveTimes()
            t = trainer(
                where, strategy=make_strategy(name, async_checkpoint=setting), max_steps=4, callbacks=[times]
            )
            t.fit(GPTModule(cfg), data)
            timed[label] = median(times.seconds[1:])  # the first save allocates the host copy
            if setting:
                checkpoints = t.strategy.reliability.checkpoints
                copies = checkpoints.host.tensors()
                pinned = all(x.is_pinned() for x in copies if x.numel()) if where.cuda else None
                assert pinned in (True, None), "the host copy is not page-locked"
                host = checkpoints.host
                assert host.allocated_bytes - host.nbytes < 1024, (host.allocated_bytes, host.nbytes)
                host_bytes = checkpoints.host.nbytes
                # a save every batch waits for the previous write when a write takes longer than a step
                write_s = median([seconds for _, seconds in checkpoints.writer.completed])
        resumed = _stopped_and_resumed(where, name, "async", async_checkpoint=True)
        out[name] = {
            "blocked_sync_s": timed["sync"],
            "blocked_async_s": timed["async"],
            "ratio": timed["async"] / timed["sync"] if timed["sync"] else None,
            "background_write_s": write_s,
            "host_copy_bytes": host_bytes,
            "pinned": pinned,
            "max_rel_diff": resumed["max_rel_diff"],
        }
    return out


# --- the clipping norm's device and the RNG states of the rank's own device ------------------------------


def clip_norm_device(where: Where) -> dict:
    """FSDP2-sharded gradients: the norm comes back on their device (NCCL refuses CPU tensors)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lit_parallel.parallel.fsdp import apply_fsdp, clip_grad_norm_

    dist.init_process_group(where.backend, init_method=f"file://{where.tmp / 'pg'}", rank=0, world_size=1)
    try:
        if where.cuda:
            torch.cuda.set_device(0)
        mesh = init_device_mesh(where.device.type, (1,), mesh_dim_names=("data_parallel",))
        cfg = where.config()
        module = GPTModule(cfg).model.to(where.device)
        apply_fsdp(module, mesh, list(module.h))
        x = token_data(cfg, 2)[:][0].to(where.device)
        lm_loss(module(x), x).backward()
        norm = clip_grad_norm_(module.parameters(), 0.5)
        assert norm.device.type == where.device.type, f"norm on {norm.device}, gradients on {where.device}"
        return {"norm_device": str(norm.device), "norm": float(norm)}
    finally:
        dist.destroy_process_group()


def rank0_sync_memory(where: Where) -> dict:
    """Rank 0's weights, on the CPU, broadcast over NCCL: staged on the GPU through one buffer of at most the
    cap, never the whole model. One GPU makes a group of one, whose broadcasts are real NCCL calls that move
    nothing; the size-1 shortcut of ``broadcast_from_rank0`` is bypassed so that its NCCL path runs."""
    import torch.distributed as dist

    from lit_parallel.parallel import materialize

    dist.init_process_group(where.backend, init_method=f"file://{where.tmp / 'pg'}", rank=0, world_size=1)
    try:
        if where.cuda:
            torch.cuda.set_device(0)
        model = GPTModule(where.config()).model  # on the CPU
        before = {k: v.clone() for k, v in model.state_dict().items()}
        cap = 2**20 if where.cuda else 4096
        materialize._distributed = lambda: True  # a group of one: see the docstring
        if where.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        materialize.broadcast_from_rank0(list(model.parameters()) + list(model.buffers()), chunk_bytes=cap)
        out: dict[str, Any] = {"weights_bytes": model_bytes(model), "cap_bytes": cap}
        if where.cuda:
            torch.cuda.synchronize()
            out["device_peak_extra_bytes"] = torch.cuda.max_memory_allocated() - base
            # the caching allocator rounds a block up to 512 bytes (2 MiB segments hold it)
            assert out["device_peak_extra_bytes"] <= cap + 512, out
        worst = max((v - before[k]).abs().max().item() for k, v in model.state_dict().items())
        assert worst == 0.0, f"rank 0's weights changed by {worst}"
        return out
    finally:
        dist.destroy_process_group()


def expert_dispatch(where: Where) -> dict:
    """Expert parallelism's all-to-all path on one rank (NCCL on the GPU): a tiny Mixtral and the hand-written
    MoE split over a 1-rank expert-parallel group give the unsplit model's loss and gradients; the split sizes
    are read once per MoE layer call (counted), every tensor stays on the device."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lit_parallel.parallel.expert_parallel import apply_expert_parallel, plan_expert_parallel
    from tests.moe_models import MODELS, VOCAB
    from tests.moe_models import lm_loss as moe_loss

    dist.init_process_group(where.backend, init_method=f"file://{where.tmp / 'pg_ep'}", rank=0, world_size=1)
    try:
        if where.cuda:
            torch.cuda.set_device(0)
        mesh = init_device_mesh(where.device.type, (1,), mesh_dim_names=("expert_parallel",))
        out = {}
        tokens = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0)).to(where.device)
        for name in ("mixtral", "hand"):
            plain = MODELS[name]().to(where.device)
            split = copy.deepcopy(plain)
            plan = plan_expert_parallel(split, 1)
            apply_expert_parallel(plan, mesh)
            with HostSyncCounter() as syncs:
                loss = moe_loss(split, tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            ref = moe_loss(plain, tokens[:, :-1], tokens[:, 1:])
            ref.backward()
            assert torch.allclose(loss, ref, rtol=1e-5), (float(loss), float(ref))
            worst = 0.0
            for (n, p), q in zip(split.named_parameters(), plain.parameters()):
                g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                assert g.device.type == where.device.type, n
                worst = max(worst, float((g - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-12)))
            assert worst < 1e-4, (name, worst)
            out[name] = {
                "loss": float(loss),
                "grad_rel_err": worst,
                "moe_layer_calls": plan.stats.calls,
                "forward_host_syncs": syncs.count,
            }
        return out
    finally:
        dist.destroy_process_group()


def rng_states(where: Where) -> dict:
    """The generator of the rank's own device is saved and restored, whatever else is visible."""
    from lit_parallel.rng import capture_rng_state, restore_rng_state

    torch.manual_seed(7)
    torch.rand(1, device=where.device)  # CUDA's generator exists once something has drawn from it
    state = capture_rng_state()
    a = torch.rand(4, device=where.device)
    torch.rand(100, device=where.device)
    restore_rng_state(state)
    again = torch.rand(4, device=where.device)
    assert torch.equal(a, again), "restoring the saved states did not repeat the draws"
    return {"keys": sorted(state), "repeated": True}


# --- the suite's tests marked `gpu` (tests/strategies/test_fsdp_gpu.py, ...), as pytest runs them ----------


def gpu_tests(where: Where) -> dict:
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "tests"]
    if where.dry:
        args.append("--collect-only")  # they need CUDA: a dry run checks that they import and collect
    proc = subprocess.run(args, cwd=REPO_ROOT, capture_output=True, text=True, timeout=500)
    tail = (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 0, tail
    summary = tail.strip().splitlines()[-1]
    # on a GPU none may skip: a skip there means the test found no CUDA
    assert where.dry or ("passed" in summary and "skipped" not in summary), tail
    return {"returncode": proc.returncode, "summary": summary}


# --- tokens/s of the GPT recipe model in bf16: a plain PyTorch loop and fsdp_blocks / ddp_tuned -----------


def tokens_per_s(where: Where) -> dict:
    cfg, b = where.config(large=True), where.batch_size(large=True)
    steps, warmup = (4, 1) if where.dry else (30, 10)
    tokens = b * cfg.block_size
    out: dict[str, Any] = {"config": vars(cfg), "batch_size": b, "tokens_per_step": tokens}

    torch.manual_seed(0)
    module = GPTModule(cfg)
    model = module.model.to(where.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = [(x.to(where.device), y.to(where.device)) for x, y in loader(cfg, steps * b, b)]
    times = []
    for x, y in data:
        start = _now(where)
        with torch.autocast(where.device.type, dtype=torch.bfloat16):
            loss = lm_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(_now(where) - start)
    del model, opt, data
    out["plain_pytorch"] = _throughput(times[warmup:], tokens)

    for name in ("ddp_tuned", "fsdp_blocks"):
        module = GPTModule(cfg, lr=1e-4)
        timer = StepPeaks(where)
        t = trainer(
            where,
            strategy=make_strategy(name),
            precision="bf16-mixed",
            max_steps=steps,
            gradient_clip_val=1.0,
            callbacks=[_Synchronize(where), timer],
        )
        t.fit(module, loader(cfg, steps * b, b))
        out[name] = _throughput(timer.times[warmup:], tokens)
        out[name]["vs_plain"] = out[name]["tokens_per_s"] / out["plain_pytorch"]["tokens_per_s"]
    return out


class _Synchronize(L.Callback):
    """Waits for the device at each batch's start and end, so StepPeaks' wall times are the step's."""

    def __init__(self, where: Where):
        self.where = where

    def on_train_batch_start(self, *args):
        if self.where.cuda:
            torch.cuda.synchronize()

    def on_train_batch_end(self, *args):
        if self.where.cuda:
            torch.cuda.synchronize()


def _now(where: Where) -> float:
    import time

    if where.cuda:
        torch.cuda.synchronize()
    return time.perf_counter()


def _throughput(times: list[float], tokens: int) -> dict:
    m = median(times)
    return {"median_step_s": m, "tokens_per_s": tokens / m, "steps_timed": len(times)}


SECTIONS: dict[str, Callable[[Where], dict]] = {
    "environment": environment,
    "clip_norm_device": clip_norm_device,
    "expert_dispatch": expert_dispatch,
    "rng_states": rng_states,
    "rank0_sync_memory": rank0_sync_memory,
    **{f"strategy_{name}": strategy_run(name) for name in STRATEGIES},
    "ddp_comm_hooks": ddp_comm_hooks,
    "meta_init": meta_init,
    "compile_last_batch": compile_last_batch,
    "save_resume": save_resume,
    "async_save": async_save,
    "gpu_tests": gpu_tests,
    "tokens_per_s": tokens_per_s,
}
