"""What a strategy adds to a step, timed between the steps it prices.

On CPU ranks each collective of a sharded or tensor-parallel step costs milliseconds of scheduling (both
ranks must be running at once), and how many depends on what else the machine runs at that moment: timed
seconds apart, a model's step and the calibration shapes (:mod:`~lit_parallel.planner.time.calibration`)
see different machines. So ``advise --verify`` times calibration shapes, parallelized as the strategy does
it (plain PyTorch, no Trainer), once after each of the model's own measured steps, and prices the step with
what it measured there:

* :class:`AllReduceTimer` (``tp_dp``): a forward + backward of ``paired`` and ``thin`` split by the
  automatic plan; ``paired`` has 12 all-reduces (and the DTensor work around its split layers), ``thin``
  none: the cost per all-reduce.
* :class:`FSDPCostTimer` (ZeRO-2, ``fsdp_blocks``, ``hsdp``): a training step of ``reference``, ``thin`` and
  ``wide`` sharded per block with the strategy's mesh and resharding, and of each whole: what sharding adds
  to each shape gives the fixed cost and the cost per FSDP group, as the calibration fits them from Trainer
  runs. The costs per tensor and per byte stay the calibration's.

``ddp_tuned`` has no timer here: its costs stay the calibration's. Timed between the model's steps, its
first all-reduce waits for the other rank to finish the model's step, and that wait would count as its
fixed cost; with a barrier before each timed step it is the calibration's, so timing it adds nothing. (The
FSDP shapes' first collective waits in the same way; an FSDP step synchronises its ranks at every group,
and the timed figures predict its steps better.) What each choice did to the errors:
``docs/explanations/advise-accuracy.md`` (Noise).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from torch import nn

from lit_parallel.planner.time.step import typical_seconds

if TYPE_CHECKING:
    from lit_parallel.parallel.mesh import ParallelDims


def _shape(name: str) -> nn.Module:
    from lit_parallel.planner.time.calibration import calibration_model

    torch.manual_seed(0)  # the same weights on every rank
    return calibration_model(name)


class AllReduceTimer:
    """``tp_dp``'s cost per all-reduce: ``paired`` and ``thin`` tensor-parallel over every rank of the default
    process group; :meth:`sample` times a forward + backward of each once (call it on every rank at once: the
    split layers all-reduce), :meth:`seconds` is the cost of one of the 12 all-reduces ``paired`` adds."""

    def __init__(self) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from lit_parallel.parallel.tensor_parallel.apply import apply_tp
        from lit_parallel.parallel.tensor_parallel.infer import infer_tp_plan
        from lit_parallel.planner.time.calibration import calibration_input, tp_all_reduces

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        self.models = []
        for name in ("paired", "thin"):
            model = _shape(name)
            apply_tp(model, mesh, infer_tp_plan(model, tp_size=mesh.size()))
            self.models.append(model)
        self.calls = tp_all_reduces("paired")
        self.input = calibration_input()
        self.samples: list[tuple[float, float]] = []
        self._time_once()  # warm-up

    def _time_once(self) -> tuple[float, float]:
        seconds = []
        for model in self.models:
            start = time.perf_counter()
            model(*self.input).square().mean().backward()
            seconds.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
        return seconds[0], seconds[1]

    def sample(self) -> None:
        self.samples.append(self._time_once())

    def costs(self) -> dict[str, float] | None:
        """``{"all_reduce_s": seconds()}`` (``None`` without samples): the field of
        :class:`~lit_parallel.planner.time.calibration.StrategyCost` it measures."""
        seconds = self.seconds()
        return None if seconds is None else {"all_reduce_s": seconds}

    def seconds(self) -> float | None:
        """Seconds per all-reduce: the lower quartile over the samples of ``(paired - thin) / 12``, each sample
        at its slowest rank's time (every rank calls this; the samples are dropped, so the next run starts
        afresh); ``None`` without samples."""
        import torch.distributed as dist

        gathered: list[list[tuple[float, float]]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, self.samples)
        self.samples = []
        diffs = [max(m for m, _ in same) - max(s for _, s in same) for same in zip(*gathered, strict=True)]
        if not diffs:
            return None
        return max(0.0, typical_seconds(diffs)) / self.calls


class FSDPCostTimer:
    """What an FSDP strategy adds to a step, at the moment: the ``reference``, ``thin`` and ``wide``
    calibration shapes, each sharded per block over ``dims``' FSDP mesh (2-D for HSDP), resharded after
    forward or not (ZeRO-3 or ZeRO-2) as the strategy does, and each whole in one process; :meth:`sample`
    runs one training step of each (forward, backward, AdamW; call it on every rank at once), :meth:`costs`
    is the fixed cost and the cost per group that sharding added."""

    shapes = ("reference", "thin", "wide")

    def __init__(self, dims: ParallelDims, reshard_after_forward: bool) -> None:
        from lit_parallel.parallel.fsdp import apply_fsdp
        from lit_parallel.planner.time.calibration import calibration_input

        dims.build_mesh("cpu")  # reuses the mesh (and its process groups) of an equal layout built before
        self.steps = []  # (model, optimizer): each shape sharded, then each shape whole
        for sharded in (True, False):
            for name in self.shapes:
                model = _shape(name)
                if sharded:
                    mesh = dims.fsdp_mesh()
                    apply_fsdp(model, mesh, list(model.blocks), reshard_after_forward=reshard_after_forward)
                self.steps.append((model, torch.optim.AdamW(model.parameters(), lr=1e-5)))
        self.input = calibration_input()
        self.samples: list[list[float]] = []
        self._time_once()  # warm-up (AdamW makes its state)

    def _time_once(self) -> list[float]:
        seconds = []
        for model, optimizer in self.steps:
            start = time.perf_counter()
            model(*self.input).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            seconds.append(time.perf_counter() - start)
        return seconds

    def sample(self) -> None:
        self.samples.append(self._time_once())

    def costs(self) -> dict[str, float] | None:
        """``fixed_s`` (what sharding added to ``reference``) and ``group_s`` (``thin``'s 4 more groups, less
        its 8 more tensors at ``(wide - thin) / 132`` each), from the lower quartile over the samples of
        sharded minus whole, each at its slowest rank's time (every rank calls this; the samples are dropped);
        ``None`` without samples."""
        import torch.distributed as dist

        from lit_parallel.planner.time.calibration import counts

        gathered: list[list[list[float]]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, self.samples)
        self.samples = []
        slowest = [[max(t) for t in zip(*same, strict=True)] for same in zip(*gathered, strict=True)]
        if not slowest:
            return None
        n = len(self.shapes)
        extra = [typical_seconds([s[i] - s[n + i] for s in slowest]) for i in range(n)]
        (g_ref, t_ref, _), (g_thin, t_thin, _), (_, t_wide, _) = (counts(name) for name in self.shapes)
        per_tensor = max(0.0, (extra[2] - extra[1]) / (t_wide - t_thin))
        per_group = max(0.0, (extra[1] - extra[0] - per_tensor * (t_thin - t_ref)) / (g_thin - g_ref))
        return {"fixed_s": max(0.0, extra[0]), "group_s": per_group}
