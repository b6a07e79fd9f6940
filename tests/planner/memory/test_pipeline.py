"""The planner's pp_dp terms: schedule arithmetic, the layout advise shows, a stage's peak by hand.

The measured side (a real two-stage launch under LiveMemory, predicted within 10 %) runs inside the lab's
memory launch: tests/commands/test_lab.py::_check_memory.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lit_parallel._compat import MemTracker
from lit_parallel.commands.lab.memory import BlockMLP
from lit_parallel.measure.live_memory import LiveMemory
from lit_parallel.planner.memory.pipeline import backward_moment, in_flight, stage_peaks
from lit_parallel.planner.memory.pipeline_simulation import simulate_micro_batch
from lit_parallel.planner.pipeline_layout import pipeline_layout, pipeline_microbatches, pipeline_plan
from lit_parallel.planner.precision import precision_bytes
from lit_parallel.planner.simulation import default_loss
from lit_parallel.planner.time.pipeline import pipeline_step_time
from tests.memory_reference import torch_peak


def test_pipeline_step_time_is_the_bubble_plus_one_transfer_each_way_per_slot():
    # 2 stages, 4 micro-batches, 0.8 s of compute per stage per step: 0.2 s per micro-batch slot; the
    # bubble is P - 1 = 1 idle slot (1/5 = (P-1)/(M+P-1) of the compute time); each of the M + P - 1 = 5 slots
    # sends 1 MB forward and its gradient back at 100 us latency + 1e6 B / 10 GB/s = 100 us each
    t = pipeline_step_time(
        0.8, microbatches=4, stages=2, boundary_bytes=1e6, latency_s=1e-4, bandwidth_gbps=10.0
    )
    assert t.compute_s == pytest.approx(0.8)
    assert t.bubble_s == pytest.approx(0.2)
    assert t.bubble_s / (t.compute_s + t.bubble_s) == pytest.approx(1 / 5)
    assert t.p2p_s == pytest.approx(5 * 2 * 2e-4)
    assert t.step_s == pytest.approx(1.002)
    busy = pipeline_step_time(0.8, microbatches=4, stages=2, slot_overhead_s=0.01)
    assert busy.overhead_s == pytest.approx(5 * 0.01) and busy.step_s == pytest.approx(1.05)
    gpipe = pipeline_step_time(0.8, microbatches=4, stages=2, schedule="GPipe")
    assert gpipe.step_s == pytest.approx(1.0)  # same bubble, no transfer cost without latency/bandwidth
    assert pipeline_step_time(0.8, microbatches=4, stages=1, latency_s=1.0).step_s == pytest.approx(0.8)
    with pytest.raises(ValueError, match="schedule='DualPipeV' is not predicted; choose one of 1F1B, GPipe"):
        pipeline_step_time(0.8, microbatches=4, stages=2, schedule="DualPipeV")


def test_micro_batches_in_flight_follow_the_schedule():
    assert [in_flight("1F1B", s, 4, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight("1F1B", s, 4, 2) for s in range(4)] == [2, 2, 2, 1]
    assert [in_flight("GPipe", s, 4, 8) for s in range(4)] == [8, 8, 8, 8]
    with pytest.raises(ValueError, match="Interleaved1F1B"):
        in_flight("Interleaved1F1B", 0, 2, 4)


def test_the_worst_moment_of_a_backward_over_the_stage_blocks():
    """3 blocks of 100 saved bytes and 50 gathered, 10 bytes before them, root 5, 2 micro-batches in flight:
    the other micro-batch's 310 bytes stay; the oldest one's blocks free as its backward passes them."""
    # small parameters: the start of the last block's backward (root + that block; all 620 bytes live)
    assert backward_moment(2, 10.0, [100.0] * 3, 0.0, 5.0, [50.0] * 3, prefetch=False) == (55.0, 620.0)
    # large parameters: the first block's backward (all gathered; 310 + 10 + 100 live)
    assert backward_moment(2, 10.0, [100.0] * 3, 0.0, 5.0, [500.0] * 3, prefetch=False) == (1505.0, 420.0)
    # sharded over d > 1: the middle block's backward also holds the first block's prefetched all-gather
    assert backward_moment(2, 10.0, [100.0] * 3, 0.0, 5.0, [500.0] * 3, prefetch=True) == (1505.0, 520.0)
    # a last stage's head and loss go back first: only the root gathered, the suffix's 1000 bytes live
    assert backward_moment(1, 0.0, [100.0], 1000.0, 5.0, [50.0], prefetch=False) == (5.0, 1100.0)


def test_the_layout_advise_predicts():
    # one node: a stage per device; 4 x P micro-batches when the batch divides
    assert pipeline_layout(2, 1, 16) == pipeline_layout(2, 1, 16, stages=2)
    lay = pipeline_layout(2, 1, 16)
    assert (lay.stages, lay.microbatches, lay.data_parallel, lay.micro_batch) == (2, 8, 1, 2)
    # several nodes: a stage per node, the node's devices data-parallel; the most micro-batches dividing 6
    lay = pipeline_layout(8, 2, 6)
    assert (lay.stages, lay.microbatches, lay.data_parallel, lay.micro_batch) == (2, 6, 8, 1)
    assert pipeline_layout(1, 1, 16) is None  # one rank: no pipeline
    # fewer samples than stages
    assert pipeline_layout(4, 1, 3) is None and pipeline_microbatches(3, 4) is None


def test_a_stage_peak_adds_the_terms_written_in_the_module_docstring():
    """BlockMLP(width 8, depth 2), fp32, 2 stages (a block each), batch 16 -> 8 micro-batches of 2."""
    torch.manual_seed(0)
    w, b, m = 8, 2, 8
    model = BlockMLP(w, depth=2)
    names = ["blocks.0", "blocks.1"]
    lay = pipeline_layout(2, 1, 16)
    sim = simulate_micro_batch(model, names, (torch.empty(b, w, device="meta"),))
    # what a block saves, per sample, in fp32: LayerNorm's input, mean and rstd (w + 2), the first Linear's
    # input (w), GELU's input and output (4w + 4w)
    assert sim.blocks == [4 * b * (10 * w + 2)] * 2
    act, logits = 4 * b * w, 4 * b * 4  # a block's output (and the model's input); the head's output
    assert sim.outputs == [act] * 2
    # block 0's LayerNorm saves the model's input, block 1's the residual sum block 0 returns
    assert sim.block_inputs == [act, 0.0] and sim.input_saved == [0.0, act] and sim.output_saved == [0.0] * 2
    assert (sim.inputs, sim.model_output, sim.model_output_saved) == (act, logits, 0.0)
    peaks = stage_peaks(
        model,
        pipeline_plan(model, names, lay),
        names,
        lay,
        sim,
        precision_bytes("32-true"),
        device_type="cpu",
    )
    first = peaks[0]
    n = 2 * w + (w * 4 * w + 4 * w) + (4 * w * w + w)  # one block's parameters; 6 tensors
    assert first.phase == "backward"
    assert first.params == n * (4 + 4)  # its (one-rank) shard + FSDP2's gathered copy, kept all step
    assert first.grads == n * (4 + 4)  # last step's, held, + the ones accumulating over micro-batches
    assert first.optimizer == n * 8 + 6 * 4  # AdamW's two states + a step counter per tensor
    # 1F1B: stage 0 of 2 holds 2 micro-batches; their inputs are slices of the batch, counted once below
    assert first.activations == 2 * (sim.blocks[0] - act)
    # the step's batch and one gradient receive buffer per micro-batch; the outputs of the 2 micro-batches
    # in flight; the output of the first, which its send keeps until the cooldown
    assert first.temporaries - sim.temporaries == m * act + m * act + 2 * act + act
    last = peaks[1]
    head = 4 * w + 4
    assert sim.suffix < n * 4
    assert last.params == (n + head) * (4 + 4)
    # its backward: the head and the loss go back first (only the head gathered, every activation live),
    # then the block (gathered as well, the head's and the loss's activations freed): here the second; the
    # block's input is the activation receive buffer, counted with the buffers
    assert last.activations == sim.blocks[1] - act
    # the batch; receive buffers per micro-batch for the activation and for the model's input passed along;
    # every micro-batch's output (returned merged); the gradient the previous backward sent back
    assert last.temporaries - sim.temporaries == m * act + m * (act + act) + m * logits + act


class TinyConvNet(nn.Module):
    """A convolution, two blocks of convolution, BatchNorm and ReLU (each keeps 2 channels), a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 2, 3, padding=1)
        self.blocks = nn.Sequential(
            *(nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.BatchNorm2d(2), nn.ReLU()) for _ in range(2))
        )
        self.head = nn.Linear(2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def test_a_conv_stage_counts_its_batch_norm_buffers_once_and_the_gradients_a_later_micro_batch_adds():
    """TinyConvNet, fp32, 2 stages (the stem and a block; a block and the head), batch 8 of 1 x 4 x 4 ->
    8 micro-batches of one sample."""
    model, names, m = TinyConvNet(), ["blocks.0", "blocks.1"], 8
    lay = pipeline_layout(2, 1, m)
    x = torch.randn(1, 1, 4, 4)
    sim = simulate_micro_batch(model, names, (x.to("meta"),))
    # the input, a block's activation, one statistic of 2 channels
    inp, act, stats = 4 * 16, 4 * 2 * 16, 4 * 2
    # the stem saves the input; block 0's convolution its input (the stem's output); each block saves its
    # BatchNorm's input, BatchNorm's batch mean and inverse deviation and running mean and variance, and its
    # ReLU's output (which is the block's output; block 1's convolution input is block 0's ReLU output)
    assert sim.prefix == sim.prefix_inputs == inp
    assert sim.blocks == [act + act + 4 * stats + act, act + 4 * stats + act]
    assert sim.input_saved == [act, 0.0] and sim.output_saved == [act, act] and sim.outputs == [act, act]
    assert sim.block_inputs == [0.0, 0.0] and sim.inputs == inp and sim.model_output == 4 * 3
    # a micro-batch after the first: each gradient is computed into a new tensor, then added to the .grad
    # already there; the simulation's temporaries are those of a real second micro-batch's backward on CPU,
    # measured by LiveMemory and, in the same micro-batch, by torch's own MemTracker
    real = TinyConvNet()
    real.load_state_dict(model.state_dict())
    default_loss(real(x), (x,)).backward()
    tracker = MemTracker()
    tracker.track_external(real, x)
    with LiveMemory(real) as live, tracker:
        loss = default_loss(real(x), (x,))
        forward = live.peak_so_far().by_category["temporaries"]
        live.reset_peak()
        loss.backward()
        del loss
    assert sim.temporaries == max(forward, live.peak.by_category["temporaries"])
    # torch's peak of the micro-batch less what is not a temporary, by hand: the parameters and last
    # micro-batch's gradients (4 bytes each: the stem 1 x 2 x 3 x 3 + 2, each block's convolution 2 x 2 x 3 x 3
    # + 2 and BatchNorm 2 + 2, the head 2 x 3 + 3) and every tensor saved for backward (as above)
    n = (18 + 2) + 2 * (36 + 2 + 2 + 2) + (6 + 3)
    saved = inp + (act + act + 4 * stats + act) + (act + 4 * stats + act)
    assert torch_peak(tracker)["total"] - (4 * n + 4 * n + saved) == sim.temporaries
    assert sim.temporaries >= 4 * 2 * 2 * 9  # the new gradient of a block's convolution weight among them
    first, last = stage_peaks(
        model,
        pipeline_plan(model, names, lay),
        names,
        lay,
        sim,
        precision_bytes("32-true"),
        device_type="cpu",
    )
    # stage 0 holds 2 micro-batches: the stem's saved input is a slice of the batch, block 0's ReLU output
    # the stage output (both counted below)
    assert first.activations == 2 * (act + act + 4 * stats)
    # the batch; a gradient receive buffer per micro-batch; the outputs in flight; the one the first send keeps
    assert first.temporaries - sim.temporaries == m * inp + m * act + 2 * act + act
    # stage 1 holds one micro-batch, its worst moment the block's backward (the head's and the loss's saved
    # tensors freed, the block gathered): its BatchNorm's and ReLU's; its convolution's input is the
    # activation receive buffer (counted below)
    assert last.activations == act + 4 * stats + act
    # the batch; receive buffers for the activation and the input passed along; every micro-batch's output;
    # the gradient the previous backward sent back
    assert last.temporaries - sim.temporaries == m * inp + m * (act + inp) + m * 4 * 3 + act


def test_live_memory_does_not_count_meta_tensors_of_a_real_run_and_counts_what_an_op_reads():
    buffer = torch.zeros(256)  # made before tracking, like torch's pipeline receive buffers (1 kB)
    with LiveMemory() as live:
        shape_only = torch.empty(1000, device="meta")  # a shape computation: no memory
        (buffer * 2).sum()  # reads the buffer: it is live, 1 kB, next to the product's 1 kB
    assert live.peak.total == 2 * 1024 + 4
    with LiveMemory(meta=True) as simulated:
        torch.empty(1000, device="meta")
    assert simulated.peak.total == 4000
    del shape_only


def test_live_memory_rereads_a_storage_resized_in_place_when_an_op_writes_it():
    """FSDP2 frees gathered parameters by resizing their storage to 0 and gathers them again into it."""
    with LiveMemory() as live:
        gathered = torch.zeros(256)  # 1 kB
        gathered.untyped_storage().resize_(0)  # resharded
        other = torch.zeros(512)  # 2 kB: a new peak, for which every live storage's size is read again
        gathered.untyped_storage().resize_(1024)  # gathered again ...
        gathered.fill_(1.0)  # ... and written: 3 kB live
    assert live.peak.total == 3 * 1024
    del other


def test_live_memory_counts_buffers_made_before_tracking_from_the_start_when_told():
    """torch's pipeline receive buffers are made at the first step and first used late in the next ones."""
    buffers = [torch.zeros(256), torch.zeros(256)]  # 1 kB each
    with LiveMemory() as live:
        live.count([*buffers, "not a tensor"])
        peak_before_use = live.snapshot().total
        buffers[0].fill_(1.0)  # used: already counted, not twice
    assert peak_before_use == live.peak.total == 2 * 1024
