"""Scenarios for ``lit-parallel advise --verify``'s launch (tests/planner/time/test_calibration.py), its
measured steps under torch's own memory tracker (tests/commands/conftest.py), and the host copy of
``async_checkpoint=True`` (tests/planner/memory/test_host_copy.py)."""

from __future__ import annotations

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.models import Llama, LlamaConfig

# the host-copy scenario's tokens: a vocabulary of odd size gives the embedding and the head an odd dim 0,
# which FSDP2 cuts unevenly (rank 0 holds one row more than rank 1)
HOST_COPY_VOCAB, HOST_COPY_SEQ = 63, 8
# (strategy, its arguments, precision) of each save the host-copy scenario makes
HOST_COPY_RUNS = (
    ("ddp_tuned", {}, "32-true"),
    ("fsdp_blocks", {}, "bf16-mixed"),
    ("hsdp", {"shard_size": 1}, "bf16-true"),  # 2 replicas of 1 shard: every rank saves all of it
    ("tp_dp", {"tensor_parallel_size": 2}, "32-true"),
    ("pp_dp", {"pipeline_parallel_size": 2, "microbatches": 2}, "32-true"),
)


class HostCopyModel(L.LightningModule):
    """A tiny Llama with what a checkpoint's size depends on: odd dims 0, a frozen weight (no optimizer
    state), persistent buffers of a floating and an integer dtype at the root (outside every pipeline stage's
    pieces), and the Llama's non-persistent rotary tables (not saved)."""

    def __init__(self):
        super().__init__()
        self.model = Llama(LlamaConfig(vocab_size=HOST_COPY_VOCAB, max_seq_len=HOST_COPY_SEQ))
        self.model.norm.weight.requires_grad_(False)
        self.register_buffer("loss_scale", torch.ones(5))
        self.register_buffer("seen", torch.zeros(3, dtype=torch.long))

    def forward(self, tokens):
        return self.model(tokens)

    def pipeline_loss(self, output, targets):
        return F.cross_entropy(output.flatten(0, 1).float(), targets.flatten())

    def training_step(self, batch, batch_idx):
        return self.pipeline_loss(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def async_host_copy(ctx) -> dict:
    """Each of :data:`HOST_COPY_RUNS` with ``async_checkpoint=True``: two training steps of
    :class:`HostCopyModel`, then one ``trainer.save_checkpoint``; the bytes of the host copy the save
    allocated, as the package counts its tensors (``reliability.checkpoints.host.nbytes``; 0 where the rank
    staged nothing), and how many times it was allocated."""
    from pathlib import Path

    from torch.utils.data import DataLoader, TensorDataset

    import lit_parallel as lp
    from tests.scenarios.common import quiet_trainer

    classes = {
        "ddp_tuned": lp.TunedDDPStrategy,
        "fsdp_blocks": lp.TransformerFSDPStrategy,
        "hsdp": lp.HybridShardStrategy,
        "tp_dp": lp.TensorParallelStrategy,
        "pp_dp": lp.PipelineParallelStrategy,
    }
    tokens = torch.randint(
        0, HOST_COPY_VOCAB, (8, HOST_COPY_SEQ + 1), generator=torch.Generator().manual_seed(0)
    )
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    folder = Path(ctx.outdir) / "host_copy"
    out = {}
    for name, kwargs, precision in HOST_COPY_RUNS:
        L.seed_everything(0, verbose=False)
        strategy = classes[name](async_checkpoint=True, **kwargs)
        trainer = quiet_trainer(ctx, strategy, max_steps=2, precision=precision)
        trainer.fit(HostCopyModel(), DataLoader(data, batch_size=2))
        trainer.save_checkpoint(folder / f"{name}.ckpt")
        checkpoints = trainer.strategy.reliability.checkpoints
        assert checkpoints.writer.wait(timeout=60), f"{name}: the background write did not finish"
        host = checkpoints.host
        out[name] = {
            "nbytes": host.nbytes if host is not None else 0,
            "allocated_bytes": host.allocated_bytes if host is not None else 0,
        }
    return out


def slowest_rank_timing(ctx) -> dict:
    """A real :class:`PartsTimer` on every rank, given made-up samples (rank r's first part takes r + 1 ms
    in sample 0 and 3 - r ms in sample 1): the timing every rank gets back is the slowest rank's, sample by
    sample."""
    from lit_parallel.commands.advise.measure import slowest_rank_timing
    from lit_parallel.planner.model_summary import build_on_meta, shaped_input
    from lit_parallel.planner.time.step import PartsTimer
    from tests.conformance_models import FEATURES, mlp

    timer = PartsTimer(
        build_on_meta(mlp, {}), block_name=None, batch_size=4, example_inputs=shaped_input((FEATURES,))
    )
    r = dist.get_rank()
    timer.samples = [[(r + 1) * 1e-3, 1e-3, 1e-4, 64e-6], [(3 - r) * 1e-3, 1e-3, 1e-4, 64e-6]]
    timing = slowest_rank_timing(timer)
    return {
        "block_s": timing["block_s"],
        "samples_left": len(timer.samples),
        "none": slowest_rank_timing(None),
    }


def tp_all_reduces(ctx) -> dict:
    """``tp_dp``'s automatic plan applied to real ``mlp`` and ``t5`` over both ranks, as the strategy applies
    it; the all-reduces gloo runs in one forward + backward (torch's profiler records each gloo collective)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from lit_parallel.parallel.example_inputs import meta_example_input, real_inputs, vocabulary
    from lit_parallel.parallel.tensor_parallel.apply import apply_tp
    from lit_parallel.parallel.tensor_parallel.infer import infer_tp_plan
    from lit_parallel.planner.simulation import default_loss
    from tests import conformance_models as cm

    mesh = init_device_mesh("cpu", (2,))
    out = {}
    for name, given in (("mlp", torch.empty(4, cm.FEATURES, device="meta")), ("t5", None)):
        torch.manual_seed(0)
        model = getattr(cm, name)()
        args = real_inputs(
            meta_example_input(model, batch_size=4, seq_len=8, given=given).args, vocabulary(model)
        )
        apply_tp(model, mesh, infer_tp_plan(model, tp_size=2))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            default_loss(model(*args), args).backward()
        out[name] = sum(e.name == "gloo:all_reduce" for e in prof.events())
    return out


def all_reduce_timer(ctx) -> dict:
    """tp_dp's :class:`AllReduceTimer` on both ranks: four real samples, then made-up ones (rank r's paired
    forward + backward takes 10 + r, 20 - r, 30 and 40 ms, its thin one 1, 2, 3 + r and 4 ms)."""
    from lit_parallel.commands.advise.cost_timers import AllReduceTimer

    timer = AllReduceTimer()
    for _ in range(4):
        timer.sample()
    real = timer.seconds()
    r = dist.get_rank()
    timer.samples = [(a * 1e-3, b * 1e-3) for a, b in [(10 + r, 1), (20 - r, 2), (30, 3 + r), (40, 4)]]
    made_up = timer.seconds()
    return {"real": real, "made_up": made_up, "left": timer.samples, "none": timer.seconds()}


def fsdp_cost_timer(ctx) -> dict:
    """The :class:`FSDPCostTimer` ``advise --verify`` builds for each FSDP strategy: three real samples, its
    costs, and the gloo collectives torch's profiler records in one training step of each sharded shape."""
    import torch

    from lit_parallel.commands.advise.measure import between_step_timer

    out = {}
    for name in ("zero2", "fsdp_blocks", "hsdp"):
        timer = between_step_timer(name, dist.get_world_size())
        for _ in range(3):
            timer.sample()
        counted = []
        for model, optimizer in timer.steps[: len(timer.shapes)]:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                model(*timer.input).square().mean().backward()
                optimizer.step()
            counted.append(sum(e.name.startswith("gloo:") for e in prof.events()))
        out[name] = {
            "costs": timer.costs(),
            "collectives": dict(zip(timer.shapes, counted, strict=True)),
            "left": timer.samples,
        }
    # made up, one sample (ms): sharded reference, thin, wide, then whole; rank 1's sharded reference is 1 ms
    # slower than rank 0's
    timer.samples = [[x * 1e-3 for x in (12 + dist.get_rank(), 30, 60, 1, 2, 7)]]
    out["made_up"] = timer.costs()
    return out


def memory_with_torch_tracker(ctx) -> dict:
    """The steps ``advise --verify`` and ``lit-parallel lab memory`` measure on 2 ranks, built as they build
    them, each measured by LiveMemory and by torch's MemTracker at once (tests/memory_reference.py): GPT (one
    sequence) under ddp_tuned, ZeRO-2, fsdp_blocks and hsdp, Hugging Face's Llama (8 sequences) under tp_dp,
    the lab's BlockMLP of widths 32 and 128 (16 samples) under all five. pp_dp is left out: torch's tracker
    refuses a module run more than once in a step (a pipeline stage runs once per micro-batch)."""
    import torch

    from lit_parallel.commands.advise.measure import peak_dict, strategy_object
    from lit_parallel.commands.lab.memory import BATCH, BlockMLP
    from lit_parallel.parallel.example_inputs import meta_example_input, real_inputs, vocabulary
    from tests import conformance_models, models
    from tests.memory_reference import measure_step_with_torch_tracker

    def tokens(build, batch):  # as advise --verify's launch makes its model and input
        def make():
            model = build()
            ex = meta_example_input(model, batch_size=batch, seq_len=None)
            return model, real_inputs(ex.args, vocabulary(model))

        return make

    def block_mlp(width):  # as the lab makes them
        return lambda: (BlockMLP(width), (torch.randn(BATCH, width),))

    five = ("ddp_tuned", "zero2", "fsdp_blocks", "hsdp", "tp_dp")
    cases = {
        "gpt": (tokens(models.GPT, 1), five[:4]),
        "llama": (tokens(conformance_models.llama, 8), ("tp_dp",)),
        "block_mlp_32": (block_mlp(32), five),
        "block_mlp_128": (block_mlp(128), five),
    }
    out = {}
    for name, (make, strategies) in cases.items():
        for strategy in strategies:
            torch.manual_seed(0)
            model, inputs = make()
            peak, _, by_torch = measure_step_with_torch_tracker(
                model, inputs, strategy=strategy_object(strategy, 2), devices=2, repeats=1
            )
            out[f"{name}/{strategy}"] = {"live": peak_dict(peak), "torch": by_torch}
    return out
