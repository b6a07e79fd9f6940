"""Step time of one training step, predicted from one block measured on this machine.

Everything is timed on the device the prediction is for (``device``; the CPU by default): a step time
measured on one kind of device says nothing about another, so `advise` gives no step time for a CUDA
target on a machine without CUDA rather than a CPU figure under a GPU's name. :attr:`StepTime.device` says
where the rates were measured.

* compute: the largest transformer block's forward + backward is timed for real (lower quartile of repeats; a
  model built on the meta device gets one block materialised, nothing more) at the per-rank micro-batch
  and at a smaller batch (``pp_dp``'s micro-batch, or half). The two timings give a cost per op and a
  cost per FLOP on this machine that reproduce the time at the micro-batch; the whole
  step's ops and FLOPs are counted on the meta device (``torch.utils.flop_counter.FlopCounterMode``:
  matrix products, convolutions, attention) and priced with them.
* optimizer: AdamW timed on the block's parameters and on many tiny tensors: a cost per tensor and per
  element, priced for the whole model (elements divided by the ranks that shard the optimizer).
* communication: collective calls per step x their latency + the bytes each rank sends
  (:func:`~lit_parallel.parallel.memory.estimate_comm_bytes`, ring collectives) / the bus bandwidth, the
  figures ``lit-parallel doctor`` measures. No overlap with compute is assumed.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from lit_parallel.parallel.example_inputs import meta_example_input, to_meta
from lit_parallel.parallel.memory import estimate_comm_bytes
from lit_parallel.planner.simulation import default_loss, logits_of, meta_copy


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one step's parts on this machine (per rank, before communication).

    Compute is ``ops x seconds_per_op + FLOPs x seconds_per_flop``: both rates come from timing the
    block at the micro-batch and at a smaller batch (the pipeline's micro-batch, or half; twice the
    micro-batch for a batch of one): the FLOPs change, the number of ops does not. The rates reproduce the
    time at the micro-batch. The model's ops and FLOPs are counted on the meta device. AdamW is ``tensors
    x seconds_per_tensor + elements x seconds_per_element``, from timing it on the block's parameters and
    on many tiny tensors.
    """

    block_s: float
    op_s: float
    flop_s: float
    ops: int
    flops: int
    optimizer_tensor_s: float
    optimizer_element_s: float
    tensors: int
    elements: int
    block_description: str
    block_name: str | None = None  # the unit timed: a block's qualified name; None: the whole model
    device: str = "cpu"  # where the unit and AdamW were timed: the rates hold for that device only

    @property
    def compute_s(self) -> float:
        return self.ops * self.op_s + self.flops * self.flop_s

    def optimizer_s(self, shard: int = 1) -> float:
        """AdamW's step with the elements divided over ``shard`` ranks (every rank steps every tensor)."""
        return self.tensors * self.optimizer_tensor_s + self.elements / shard * self.optimizer_element_s


def median_timing(timings: list[StepTime]) -> StepTime:
    """Several timings of the same unit (rounds taken between other measurements) as one: the median of
    every measured rate; the counts are the same in all of them."""
    med = lambda name: statistics.median(getattr(t, name) for t in timings)  # noqa: E731
    rates = ("block_s", "op_s", "flop_s", "optimizer_tensor_s", "optimizer_element_s")
    return replace(timings[0], **{name: med(name) for name in rates})


class _OpCounter:
    """Counts the ops a piece of code dispatches (a TorchDispatchMode made on first use)."""

    def __new__(cls) -> Any:
        from lit_parallel._compat import TorchDispatchMode

        class Counter(TorchDispatchMode):
            ops = 0

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                self.ops += 1
                return func(*args, **(kwargs or {}))

        return Counter()


def _count(fn: Any) -> tuple[int, int]:
    """(ops, FLOPs) of ``fn()``, on any device (meta included: grouped matrix products of MoE experts run
    there in every dtype, as on a real device, with one op each way)."""
    from torch.utils.flop_counter import FlopCounterMode

    from lit_parallel.planner.fused_attention import fused_attention_on_meta

    flops, ops = FlopCounterMode(display=False), _OpCounter()
    with fused_attention_on_meta(attention=False), flops, ops:
        fn()
    return ops.ops, flops.get_total_flops()


def _capture_block_call(
    meta: nn.Module, block: nn.Module, args: tuple
) -> tuple[tuple, dict, tuple[int, int]]:
    """The block's (meta) arguments in one meta forward, and the (ops, FLOPs) of the whole model's step."""
    seen: list[tuple[tuple, dict]] = []
    handle = block.register_forward_pre_hook(lambda m, a, k: seen.append((a, k)), with_kwargs=True)
    try:
        total = _count(lambda: default_loss(meta(*args), args).backward())
    finally:
        handle.remove()

    def fresh(t: Any) -> Any:  # cut from the model's graph, so the block's own step can be counted alone
        if isinstance(t, torch.Tensor):
            return t.detach().requires_grad_(t.is_floating_point())
        if isinstance(t, (tuple, list)):  # e.g. Hugging Face's (cos, sin) position embeddings
            return type(t)(fresh(x) for x in t)
        if t is None or isinstance(t, (bool, int, float, str)):
            return t
        return None  # e.g. a key/value cache object holding the model's graph: the block runs without it

    a, k = seen[0]
    return tuple(fresh(x) for x in a), {n: fresh(v) for n, v in k.items()}, total


def _real(t: Any, dtype: torch.dtype, device: torch.device | str = "cpu") -> Any:
    """A real tensor on ``device`` shaped like meta ``t``: floats random (in ``dtype``), booleans true,
    integers zero."""
    if isinstance(t, (tuple, list)):
        return type(t)(_real(x, dtype, device) for x in t)
    if not isinstance(t, torch.Tensor):
        return t
    if t.is_floating_point():
        return torch.randn(t.shape, dtype=dtype, device=device).requires_grad_(t.requires_grad)
    if t.dtype == torch.bool:
        return torch.ones(t.shape, dtype=torch.bool, device=device)
    return torch.zeros(t.shape, dtype=t.dtype, device=device)


def _materialise(block: nn.Module, dtype: torch.dtype, device: torch.device | str = "cpu") -> nn.Module:
    """A real copy of a meta block on ``device`` with small random weights (the values do not matter for
    timing)."""
    import copy

    real = copy.deepcopy(block).to_empty(device=device).to(dtype)
    with torch.no_grad():
        for t in (*real.parameters(), *real.buffers()):
            if t.is_floating_point():
                t.normal_(0.0, 0.02)
            else:
                t.zero_()
    return real


def typical_seconds(samples: list[float]) -> float:
    """The one figure every repeated timing of the planner reports (predictions and measurements alike):
    the lower quartile. Noise on a shared machine only ever adds time, in bursts that last several
    repeats; the median moves with them, the lower quartile hardly does, and unlike the fastest repeat it
    is not one lucky sample."""
    ordered = sorted(samples)
    return ordered[len(ordered) // 4]


def _block_inputs(module: nn.Module, block_name: str | None, dtype: torch.dtype, batch: int | None, kw: dict):
    """The meta model, the block (or the model), its meta arguments and the whole step's (ops, FLOPs)."""
    if callable(kw.get("given")):  # a function of the batch size (``advise --input-shape``)
        kw = {**kw, "given": kw["given"](batch or 1)}
    example = meta_example_input(module, batch_size=batch, **kw)
    meta = meta_copy(module, dtype)
    args = tuple(to_meta(a, dtype) for a in example.args)
    if block_name is None:  # no blocks: the whole model is the unit (it must fit this machine)
        return meta, meta, args, {}, _count(lambda: default_loss(meta(*args), args).backward()), example
    block = meta.get_submodule(block_name)
    block_args, block_kwargs, total = _capture_block_call(meta, block, args)
    return meta, block, block_args, block_kwargs, total, example


def _real_call(
    args: tuple,
    kwargs: dict,
    whole: bool,
    vocab: int | None,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> tuple[tuple, dict]:
    """Real arguments on ``device`` shaped like the meta ``args`` / ``kwargs`` of the unit timed. The model's
    own inputs (``whole``) get token ids drawn below the vocabulary, as a real batch has them (all zeros is a
    slower step: every gradient of the embedding lands on one row, every target is class 0)."""
    real_args = tuple(_real(a, dtype, device) for a in args)
    if whole:
        from lit_parallel.parallel.example_inputs import real_inputs

        ids = tuple(i.to(device) if isinstance(i, torch.Tensor) else i for i in real_inputs(args, vocab))
        is_ids = [
            isinstance(a, torch.Tensor) and not a.is_floating_point() and a.dtype != torch.bool for a in args
        ]
        real_args = tuple(i if yes else r for i, r, yes in zip(ids, real_args, is_ids, strict=True))
    return real_args, {k: _real(v, dtype, device) for k, v in kwargs.items()}


def _fwd_bwd(m: nn.Module, a: tuple, k: dict, whole: bool) -> None:
    out = m(*a, **k)
    (default_loss(out, a) if whole else logits_of(out).float().sum()).backward()


class PartsTimer:
    """The parts of a step `advise` times, ready to be timed again and again: the unit's forward + backward
    (the largest block, ``block_name``; the whole model without one) at the micro-batch and at a second
    batch (``low_batch``: the pipeline's micro-batch, which the step is predicted at; half the micro-batch
    without it; twice it for a micro-batch of one), AdamW on the unit's parameters and on 64 tiny tensors.
    The unit is materialised once (random weights) and its inputs made once, on ``device`` (default the
    CPU; on CUDA every part is timed between two synchronisations).

    :meth:`sample` times every part once and keeps the seconds; :meth:`timing` turns the samples kept into
    a :class:`StepTime` (the lower quartile of each part). ``advise --verify`` samples between the steps it
    measures, so prediction and measurement see this machine at the same moments."""

    def __init__(
        self,
        module: nn.Module,
        *,
        block_name: str | None,
        dtype: torch.dtype = torch.float32,
        batch_size: int | None = None,
        seq_len: int | None = None,
        example_inputs: Any = None,
        low_batch: int | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        from lit_parallel.parallel.example_inputs import vocabulary

        self.device = torch.device(device)

        kw = {"seq_len": seq_len, "given": example_inputs}
        _, unit, args, kwargs, (self.ops, self.flops), example = _block_inputs(
            module, block_name, dtype, batch_size, kw
        )
        self.whole, self.block_name = block_name is None, block_name
        self.description = f"{block_name} ({type(unit).__name__})" if block_name else "the whole model"
        vocab = vocabulary(unit) if self.whole else None
        calls = [(unit, args, kwargs)]
        if example_inputs is None or callable(example_inputs):  # a second batch: separates the per-op
            # cost from the per-FLOP cost
            batch = example.batch_size
            low = low_batch if low_batch is not None and 1 <= low_batch < batch else batch // 2
            _, unit2, args2, kwargs2, _, _ = _block_inputs(module, block_name, dtype, low or 2 * batch, kw)
            calls.append((unit2, args2, kwargs2))
        # (ops, FLOPs) of each call, counted on the meta unit; the real one is timed. The whole model's
        # first call is the step _block_inputs counted already.
        count = lambda u, a, k: _count(lambda: _fwd_bwd(u, a, k, self.whole))  # noqa: E731
        self.counts = [
            (self.ops, self.flops) if self.whole and i == 0 else count(*c) for i, c in enumerate(calls)
        ]
        self.real = _materialise(unit, dtype, self.device)
        self.inputs = [_real_call(a, k, self.whole, vocab, dtype, self.device) for _, a, k in calls]
        params = [p for p in self.real.parameters() if p.requires_grad]
        self.unit_tensors, self.unit_elements = len(params), sum(p.numel() for p in params)
        self.optimizer = torch.optim.AdamW(params, lr=1e-6) if params else None
        tiny = [torch.zeros(1, device=self.device, requires_grad=True) for _ in range(64)]
        for t in tiny:
            t.grad = torch.zeros_like(t)
        self.tiny_optimizer = torch.optim.AdamW(tiny, lr=1e-6)
        trainable = [p for p in module.parameters() if p.requires_grad]
        self.tensors, self.elements = len(trainable), sum(p.numel() for p in trainable)
        self.samples: list[list[float]] = []
        self._time_once()  # warm-up

    def _time_once(self) -> list[float]:
        """Seconds of each part, once: forward + backward per input, AdamW on the unit, AdamW on 64 tiny
        tensors (the unit's gradients are dropped after its step, as a training step drops them)."""
        seconds = []
        for args, kwargs in self.inputs:
            start = self._now()
            _fwd_bwd(self.real, args, kwargs, self.whole)
            seconds.append(self._now() - start)
        start = self._now()
        if self.optimizer is not None:
            self.optimizer.step()
        seconds.append(self._now() - start)
        self.real.zero_grad(set_to_none=True)
        start = self._now()
        self.tiny_optimizer.step()
        seconds.append(self._now() - start)
        return seconds

    def _now(self) -> float:
        # CUDA kernels run after the Python call returns: wait for them, or the launch is timed, not the work
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def sample(self) -> None:
        """Time every part once and keep the seconds."""
        self.samples.append(self._time_once())

    def timing(self) -> StepTime:
        """The samples kept as one :class:`StepTime` (the lower quartile of each part), and forget them."""
        parts = [typical_seconds(list(column)) for column in zip(*self.samples, strict=True)]
        self.samples = []
        *fwd_bwd, whole_adamw, tiny_adamw = parts
        op_s, flop_s = _rates(self.counts, fwd_bwd)
        tensor_s = tiny_adamw / 64
        element_s = max(0.0, whole_adamw - tensor_s * self.unit_tensors) / max(1, self.unit_elements)
        return StepTime(
            block_s=fwd_bwd[0],
            op_s=op_s,
            flop_s=flop_s,
            ops=self.ops,
            flops=self.flops,
            optimizer_tensor_s=tensor_s,
            optimizer_element_s=element_s,
            tensors=self.tensors,
            elements=self.elements,
            block_description=self.description,
            block_name=self.block_name,
            device=str(self.device),
        )


def _rates(counts: list[tuple[int, int]], seconds: list[float]) -> tuple[float, float]:
    """(seconds per op, seconds per FLOP) through the first (ops, FLOPs) count and its seconds, the slope
    from the second when there is one: the time at the micro-batch is reproduced whatever the second says.
    A second time that does not grow with the FLOPs leaves the ops alone to pay (no per-FLOP cost); one
    that grows faster than in proportion (cache effects, noise) leaves the FLOPs alone (no per-op cost)."""
    (ops1, flops1), t1 = counts[0], seconds[0]
    if len(counts) < 2 or counts[1][1] == flops1:
        return t1 / max(1, ops1), 0.0
    (_, flops2), t2 = counts[1], seconds[1]
    flop_s = (t2 - t1) / (flops2 - flops1)
    if flop_s <= 0:
        return t1 / max(1, ops1), 0.0
    if flop_s * flops1 > t1:
        return 0.0, t1 / flops1
    return (t1 - flop_s * flops1) / max(1, ops1), flop_s


def predict_step_time(module: nn.Module, *, block_name: str | None, repeats: int = 15, **kw: Any) -> StepTime:
    """Time the largest block (``block_name``; the whole model without blocks) at the micro-batch and at a
    second batch, and AdamW on its parameters, ``repeats`` times (:class:`PartsTimer`); scale to the whole
    model by ops and FLOPs. ``kw``: ``dtype``, ``batch_size``, ``seq_len``, ``example_inputs``,
    ``low_batch``, ``device`` (where to time: the device the prediction is for)."""
    timer = PartsTimer(module, block_name=block_name, **kw)
    for _ in range(repeats):
        timer.sample()
    return timer.timing()


def collectives_per_step(
    strategy: str,
    *,
    groups: int,
    grad_bytes: float,
    bucket_bytes: float = 25e6,
    expert_groups: int = 0,
    moe_calls: int = 0,
) -> int:
    """Collective calls per step: DDP one all-reduce per bucket; FSDP2 per group (blocks + root) an
    all-gather in forward, another in backward (ZeRO-3; not for the root), a reduce-scatter; HSDP adds an
    all-reduce of each group's gradient shard across replicas. ``fsdp_blocks_ep`` (expert parallelism) adds
    the experts' own FSDP groups (``expert_groups``, three calls each: they are never the root) and five
    all-to-alls per MoE layer call (forward: the rows per expert, the tokens out, the results back;
    backward: the two of rows again)."""
    if strategy == "ddp_tuned":
        return max(1, -(-int(grad_bytes) // int(bucket_bytes)))
    if strategy == "zero2":
        return 2 * groups
    calls = groups + (groups - 1) + groups
    if strategy == "fsdp_blocks_ep":
        calls += 3 * expert_groups + 5 * moe_calls
    return calls + (groups if strategy == "hsdp" else 0)


def comm_seconds(
    strategy: str,
    params: int,
    *,
    devices: int,
    nodes: int,
    grad_bytes: int,
    busbw_gbps: float,
    latency_s: float = 0.0,
    groups: int = 1,
    root_params: int = 0,
    experts: ExpertExchange | None = None,
) -> float:
    """Seconds of one step's collectives for ``strategy``: calls x latency + bytes sent / bus bandwidth
    (``root_params``: the parameters outside blocks, which FSDP gathers once per step; ``experts``: what
    ``fsdp_blocks_ep`` splits and exchanges)."""
    world = devices * nodes
    if world == 1 or strategy == "one_process":
        return 0.0
    kind = {"ddp_tuned": "ddp", "zero2": "zero2", "fsdp_blocks": "fsdp", "hsdp": "hsdp", "tp_dp": "fsdp"}
    kind["fsdp_blocks_ep"] = "fsdp"
    shard = devices if strategy == "hsdp" else None
    # tp_dp: FSDP over nodes (TP traffic inside a node not counted)
    n = nodes if strategy == "tp_dp" else world
    if n == 1:
        return 0.0
    ep = experts if strategy == "fsdp_blocks_ep" and experts is not None else ExpertExchange()
    sent = estimate_comm_bytes(
        params,
        strategy=kind[strategy],
        world_size=n,
        shard_size=shard,
        grad_dtype=grad_bytes,
        root_params=root_params,
        expert_params=ep.expert_params,
        expert_parallel=ep.expert_parallel,
    )
    sent += ep.all_to_all_bytes
    calls = collectives_per_step(
        strategy,
        groups=groups,
        grad_bytes=params * grad_bytes,
        expert_groups=ep.groups,
        moe_calls=ep.calls,
    )
    return calls * latency_s + sent / (busbw_gbps * 1e9)


@dataclass(frozen=True)
class ExpertExchange:
    """What expert parallelism changes in a step's communication: the expert parameters split over
    ``expert_parallel`` ranks, the FSDP groups the experts add, the MoE layer calls and the bytes their
    all-to-alls send (:func:`~lit_parallel.parallel.memory.estimate_all_to_all_bytes`)."""

    expert_params: int = 0
    expert_parallel: int = 1
    groups: int = 0
    calls: int = 0
    all_to_all_bytes: float = 0.0
