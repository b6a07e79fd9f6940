"""PitfallReport scenarios: a healthy run, and runs built to show each pitfall."""

from __future__ import annotations

import gc
import time

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, Dataset

from lit_parallel.callbacks import (
    ParallelTrainingError,
    ParallelTrainingWarning,
    PitfallReport,
    per_rank_seed,
    scaled_learning_rate,
)
from tests.scenarios.callbacks_common import captured_warnings, make_trainer

BASE_LR = 0.05


class BatchedData(Dataset):
    """Whole batches per item (one __getitem__ per step keeps loading cheap), with random noise added.
    ``calls``: each ``__getitem__``'s start and end (``time.perf_counter()``), measured here."""

    def __init__(self, n_batches: int, batch: int, dim: int, sleep_s: float = 0.0):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n_batches, batch, dim, generator=g)
        self.y = torch.randn(n_batches, batch, 1, generator=g)
        self.sleep_s = sleep_s
        self.calls: list[tuple[float, float]] = []

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        start = time.perf_counter()
        if self.sleep_s:
            time.sleep(self.sleep_s)
        item = self.x[i] + 0.01 * torch.randn(self.x[i].shape), self.y[i]
        self.calls.append((start, time.perf_counter()))
        return item


class StepStarts(Callback):
    """When each training step starts (``time.perf_counter()``), measured here."""

    def __init__(self):
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.starts.append(time.perf_counter())


def loading_share(data: BatchedData, steps: StepStarts) -> float:
    """This rank's share of the time from its first step's start to its last's spent in ``__getitem__``."""
    first, last = steps.starts[0], steps.starts[-1]
    inside = sum(end - start for start, end in data.calls if first <= start and end <= last)
    return inside / (last - first)


# the straggler's extra time: this many times its own forward pass of the step (so the slowdown is the same
# factor whatever the machine's load: compute ~3 forwards, the straggler's steps ~2x the others')
SLOW_FACTOR = 3.0


class MLP(L.LightningModule):
    """``repeat`` passes through one shared hidden layer: much compute for few parameters (or, with
    ``repeat=1`` and a wide layer, many parameters for little compute)."""

    def __init__(
        self, dim, hidden, repeat, lr, *, rank_local_buffer=False, slow_rank=None, seed_per_rank=False
    ):
        super().__init__()
        self.inp = torch.nn.Linear(dim, hidden)
        self.hidden = torch.nn.Linear(hidden, hidden)
        self.out = torch.nn.Linear(hidden, 1)
        self.repeat = repeat
        self.lr = lr
        self.rank_local_buffer = rank_local_buffer
        self.slow_rank = slow_rank
        self.seed_per_rank = seed_per_rank
        self.register_buffer("input_mean", torch.zeros(dim))

    def on_train_start(self):
        if self.seed_per_rank:
            torch.manual_seed(per_rank_seed(0, self.trainer))

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.rank_local_buffer:
            # a running statistic of this rank's data only: it drifts apart across ranks
            self.input_mean.mul_(0.9).add_(0.1 * x.mean(0))
        start = time.perf_counter()
        h = torch.tanh(self.inp(x))
        for _ in range(self.repeat):
            h = torch.tanh(self.hidden(h))
        loss = torch.nn.functional.mse_loss(self.out(h), y)
        if self.slow_rank is not None and dist.get_rank() == self.slow_rank:
            time.sleep(SLOW_FACTOR * (time.perf_counter() - start))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _run(ctx, module, data, report, **trainer_kwargs) -> dict:
    steps = StepStarts()
    trainer = make_trainer(ctx, callbacks=[report, steps], max_epochs=1, **trainer_kwargs)
    raised = None
    with captured_warnings(ParallelTrainingWarning) as caught:
        try:
            trainer.fit(module, DataLoader(data, batch_size=None, shuffle=True))
        except ParallelTrainingError as err:
            raised = str(err)
    findings, table = report.findings, report.table()
    del trainer, report
    gc.collect()  # free this run's DDP reducer while the process group is alive
    return {
        "status": {f.check: f.status for f in findings},
        "evidence": {f.check: f.evidence for f in findings},
        "table": table,
        "warnings": caught,
        "raised": raised,
        "loading_share": loading_share(data, steps),
    }


# A healthy run: compute-bound MLP (~50 ms per step), learning rate scaled by the linear rule,
# per-rank seeds.
DIM, HIDDEN, REPEAT, BATCH = 128, 256, 8, 512


# the faulty-communication runs are judged against a quarter of the default limit (see faulty_communication)
COMM_LIMIT = 0.05

TIMING_CHECKS = {"data loading", "exposed communication", "stragglers"}


def _healthy(run) -> dict:
    """A healthy run (``run()``), judged with the default limits and ``mode="raise"``. The timing checks judge
    wall-clock shares and ratios, which load from outside the run (other processes on a shared machine) can
    push over a limit: a run whose only problems are timing ones runs once more, and the second run stands
    (``retried_after`` names the first's problems). A detector that fires on a healthy run every time still
    fails; any other problem is never retried. Every rank judges the same gathered figures, so all retry."""
    out = run()
    problems = {check for check, status in out["status"].items() if status == "problem"}
    if problems and problems <= TIMING_CHECKS:
        out = {**run(), "retried_after": sorted(problems)}
    return out


def _faulty(run) -> dict:
    """A run built to expose its communication (``run()``): the share judged is a wall-clock one, which load from
    outside the run can push down as well as up, so a run where the exposed-communication check did not fire
    runs once more and the second run stands (``retried_after`` says so). A detector that never fires still
    fails. Every rank judges the same gathered figures, so all retry."""
    out = run()
    if out["status"].get("exposed communication") != "problem":
        out = {**run(), "retried_after": out["status"].get("exposed communication")}
    return out


def healthy(ctx) -> dict:
    def run():
        lr = scaled_learning_rate(BASE_LR, BATCH, BATCH * ctx.world_size, rule="linear")
        module = MLP(DIM, HIDDEN, REPEAT, lr, seed_per_rank=True)
        report = PitfallReport(base_lr=BASE_LR, base_batch_size=BATCH, check_every_n_steps=4, mode="raise")
        return _run(ctx, module, BatchedData(24, BATCH, DIM), report)

    return _healthy(run)


def faulty_model_and_data(ctx) -> dict:
    """Rank-local buffer, unscaled learning rate, the same seed on every rank, a slow dataset."""
    L.seed_everything(0)
    module = MLP(DIM, HIDDEN, REPEAT, BASE_LR, rank_local_buffer=True)
    report = PitfallReport(base_lr=BASE_LR, base_batch_size=BATCH, check_every_n_steps=4, mode="raise")
    return _run(ctx, module, BatchedData(24, BATCH, DIM, sleep_s=0.06), report)


def faulty_communication(ctx) -> dict:
    """6M parameters and 8 samples per step: the gradient all-reduce takes a large share of the step on 2
    CPU ranks, whatever the model's size (the optimizer's pass over the parameters grows with it). That share
    varies with the load on the machine: 11 % to 37 % over four launches on an idle 2-core machine
    (2026-12-05), under 10 % once in a full suite run; so the report is judged against a quarter of the
    default limit (5 %), over 24 steps (37 % to 45 % over three launches then). The healthy runs are judged
    against the default 20 % (13 % measured for the DDP one)."""

    def run():
        module = MLP(1024, 2048, 1, 0.01, seed_per_rank=True)
        report = PitfallReport(check_every_n_steps=4, comm_share_limit=COMM_LIMIT)
        return _run(ctx, module, BatchedData(24, 8, 1024), report)

    return _faulty(run)


def faulty_straggler(ctx) -> dict:
    module = MLP(DIM, HIDDEN, REPEAT, 0.01, slow_rank=1, seed_per_rank=True)
    return _run(ctx, module, BatchedData(24, BATCH, DIM), PitfallReport(check_every_n_steps=4))


# --- sharded strategies: collectives run inside forward and backward, where DDP's reducer timings do
# not reach; the wait timer measures them.
class Block(torch.nn.Module):
    def __init__(self, width: int, hidden: int, repeat: int):
        super().__init__()
        self.fc1 = torch.nn.Linear(width, hidden)
        self.fc2 = torch.nn.Linear(hidden, width)
        self.repeat = repeat

    def forward(self, x):
        for _ in range(self.repeat):
            x = x + self.fc2(torch.tanh(self.fc1(x)))
        return x


class BlockNet(MLP):
    """``blocks`` residual blocks (fsdp_blocks shards each; tp_dp splits fc1 by columns, fc2 by rows)."""

    def __init__(self, dim, width, hidden, blocks, repeat, lr, *, slow_rank=None):
        L.LightningModule.__init__(self)
        self.inp = torch.nn.Linear(dim, width)
        self.blocks = torch.nn.ModuleList([Block(width, hidden, repeat) for _ in range(blocks)])
        self.out = torch.nn.Linear(width, 1)
        self.lr = lr
        self.slow_rank = slow_rank
        self.seed_per_rank = True

    def training_step(self, batch, batch_idx):
        x, y = batch
        start = time.perf_counter()  # the straggler arrives last at forward's gathers: it waits only for them
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        loss = torch.nn.functional.mse_loss(self.out(h).mean(-2) if h.dim() == 3 else self.out(h), y)
        if self.slow_rank is not None and dist.get_rank() == self.slow_rank:
            time.sleep(SLOW_FACTOR * (time.perf_counter() - start))
        return loss


def fsdp_healthy(ctx) -> dict:
    """fsdp_blocks on a compute-bound model: ~0.5 MB of parameters, 512 samples x 12 passes per block."""
    from lit_parallel import TransformerFSDPStrategy

    def run():
        lr = scaled_learning_rate(BASE_LR, BATCH, BATCH * ctx.world_size, rule="linear")
        module = BlockNet(DIM, HIDDEN, HIDDEN, 2, 12, lr)
        report = PitfallReport(base_lr=BASE_LR, base_batch_size=BATCH, check_every_n_steps=4, mode="raise")
        return _run(ctx, module, BatchedData(12, BATCH, DIM), report, strategy=TransformerFSDPStrategy())

    return _healthy(run)


def fsdp_faulty_communication(ctx) -> dict:
    """fsdp_blocks gathering and reduce-scattering 4 blocks of 2M parameters for 8 samples a step: 40 % to 70 %
    of the step on an idle or busy 2-core machine (2026-12-05), yet under 20 % once in a full suite run, so it
    is judged against ``COMM_LIMIT`` as the DDP run is, over 16 steps."""
    from lit_parallel import TransformerFSDPStrategy

    def run():
        module = BlockNet(1024, 1024, 1024, 4, 1, 0.01)
        report = PitfallReport(check_every_n_steps=4, comm_share_limit=COMM_LIMIT)
        return _run(ctx, module, BatchedData(16, 8, 1024), report, strategy=TransformerFSDPStrategy())

    return _faulty(run)


def fsdp_straggler(ctx) -> dict:
    from lit_parallel import TransformerFSDPStrategy

    module = BlockNet(DIM, HIDDEN, HIDDEN, 2, 4, 0.01, slow_rank=1)
    report = PitfallReport(check_every_n_steps=4)
    return _run(ctx, module, BatchedData(16, BATCH, DIM), report, strategy=TransformerFSDPStrategy())


def tp_faulty_communication(ctx) -> dict:
    """tp_dp (tensor_parallel_size=2): 8 narrow blocks, an all-reduce of the activations in each
    block's forward and backward for little compute."""
    from lit_parallel import TensorParallelStrategy

    def run():
        module = BlockNet(16, 16, 16, 8, 1, 0.01)
        data = BatchedData(10, 8, 16)
        data.x = data.x.unsqueeze(2).expand(-1, -1, 512, -1).contiguous()  # (batch, 512 tokens, 16)
        report = PitfallReport(check_every_n_steps=4, comm_share_limit=COMM_LIMIT)
        strategy = TensorParallelStrategy(data_parallel_size=1, tensor_parallel_size=2)
        return _run(ctx, module, data, report, strategy=strategy)

    return _faulty(run)


def wait_timer(ctx) -> dict:
    """CollectiveWaitTimer without Lightning: rank 1 arrives ~1 s late at a blocking all-reduce, then an
    asynchronous all-reduce is waited on inside an outer timed wait (counted once), then a collective on
    another thread (timed too: on CUDA, autograd's device thread waits for FSDP2's collectives). ``arrived`` / ``returned``: ``time.perf_counter()`` just before and after the
    blocking all-reduce, measured here."""
    import threading

    from lit_parallel.measure.collective_waits import CollectiveWaitTimer

    originals = (dist.all_reduce, dist.Work.__dict__["wait"])
    timer = CollectiveWaitTimer("cpu").install()
    wrapped = [dist.all_reduce is not originals[0], dist.Work.__dict__["wait"] is not originals[1]]
    t = torch.ones(1000)
    dist.barrier()  # outside the window: the ranks start it together
    timer.open()
    if ctx.rank == 1:
        time.sleep(1.0)
    arrived = time.perf_counter()  # the timer's clock (CLOCK_MONOTONIC: one clock for the whole machine)
    dist.all_reduce(t)
    returned = time.perf_counter()
    work = dist.all_reduce(t, async_op=True)
    dist.barrier(async_op=True).wait()
    work.wait()
    timer.close()
    timer.open()
    other = threading.Thread(target=lambda: dist.all_reduce(torch.ones(10)))
    other.start()
    other.join()
    timer.close()
    timer.uninstall()
    restored = [dist.all_reduce is originals[0], dist.Work.__dict__["wait"] is originals[1]]
    windows = timer.windows()
    return {
        "wrapped": wrapped,
        "restored": restored,
        "spans": [w.span for w in windows],
        "waits": [list(w.waits) for w in windows],
        "sum": t[0].item(),
        "arrived": arrived,
        "returned": returned,
    }
