"""``tp_dp``'s cost per all-reduce, timed between the steps it predicts.

On CPU ranks each all-reduce of a tensor-parallel step costs a few milliseconds of scheduling (both ranks
must be running at once), and how many depends on what else the machine runs at that moment: two launches
of Hugging Face's Qwen2 a few minutes apart measured its ``tp_dp`` step at 45 and 63 ms, and the ``paired``
calibration shape (:mod:`~lit_parallel.parallel.calibration`) next to it at 35 and 43 ms. Timed seconds
apart, the two see different machines. :class:`AllReduceTimer` is the ``paired`` and ``thin`` shapes split by the
automatic plan over every rank (plain PyTorch, no Trainer): ``advise --verify`` times one forward +
backward of each between the model's own ``tp_dp`` steps, so the cost per all-reduce is measured at the
same moments as the step it prices. Their difference is ``paired``'s 12 all-reduces and the DTensor work
around its split layers (``thin`` splits none; the optimizer, where their parameter tensors differ, is not
timed: :class:`~lit_parallel.parallel.calibration.StrategyCost` prices tensors on their own).
"""

from __future__ import annotations

import time

import torch

from lit_parallel.parallel.step_time import typical_seconds


class AllReduceTimer:
    """The ``paired`` and ``thin`` calibration shapes tensor-parallel over every rank of the default
    process group; :meth:`sample` times a forward + backward of each once (call it on every rank at once:
    the split layers all-reduce), :meth:`seconds` is the cost per all-reduce over the samples kept."""

    def __init__(self) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from lit_parallel.parallel.calibration import calibration_input, calibration_model
        from lit_parallel.parallel.tp_apply import apply_tp
        from lit_parallel.parallel.tp_infer import infer_tp_plan

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        self.models = {}
        for name in ("paired", "thin"):
            torch.manual_seed(0)
            model = calibration_model(name)
            apply_tp(model, mesh, infer_tp_plan(model, tp_size=mesh.size()))
            self.models[name] = model
        self.input = calibration_input()
        self.samples: list[tuple[float, float]] = []
        self._time_once()  # warm-up

    def _time_once(self) -> tuple[float, float]:
        seconds = []
        for model in self.models.values():
            start = time.perf_counter()
            model(*self.input).square().mean().backward()
            seconds.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
        return seconds[0], seconds[1]

    def sample(self) -> None:
        self.samples.append(self._time_once())

    def seconds(self) -> float | None:
        """Seconds per all-reduce: the lower quartile over the samples of ``(paired - thin) / 12``, each
        sample at its slowest rank's time (every rank calls this; the samples are dropped, so the next run
        starts afresh); ``None`` without samples."""
        import torch.distributed as dist

        from lit_parallel.parallel.calibration import tp_all_reduces

        gathered: list[list[tuple[float, float]]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, self.samples)
        self.samples = []
        diffs = [max(p for p, _ in same) - max(t for _, t in same) for same in zip(*gathered, strict=True)]
        if not diffs:
            return None
        return max(0.0, typical_seconds(diffs)) / tp_all_reduces("paired")
