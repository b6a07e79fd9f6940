"""Random number generator states as plain tensors and numbers, so ``torch.load(weights_only=True)`` accepts them.

``numpy.random.get_state()`` returns a tuple holding a numpy array, and ``random.getstate()`` a tuple of 625
Python ints; neither loads with ``weights_only=True``. :func:`capture_rng_state` stores every generator a
training step draws from (torch CPU, the rank's own CUDA device when CUDA is initialised, numpy's global
generator, Python's ``random``) as tensors, ints, floats and strings; :func:`restore_rng_state` puts them back
exactly.

CUDA: a rank draws from the generator of its own device (the current one, which Lightning sets) and no other,
so that one state is saved, as ``{"device": index, "state": tensor}``, and restored into the rank's current
device, whatever index it had when saved and however many devices are visible now (8 visible at save and
one per rank at resume, as under SLURM's ``--gpus-per-task``, or the reverse). Checkpoints of earlier
versions hold a list with one state per visible device (``torch.cuda.get_rng_state_all()``):
:func:`cuda_state_for_device` picks the rank's entry where the list says which one it is, and otherwise
leaves the generator alone with a warning.

:func:`state_to_bytes` / :func:`state_from_bytes` turn a state into one ``uint8`` tensor and back (a small JSON
header for the structure, numbers and strings, then every tensor's bytes), so ranks exchange their states with
a tensor collective instead of pickling them (``gather_object`` pickles every tensor through ``torch.save``).
"""

from __future__ import annotations

import json
import logging
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

RNGState = dict[str, Any]


@dataclass(frozen=True)
class DeviceGenerators:
    """How :func:`capture_rng_state` / :func:`restore_rng_state` reach the accelerator's generators; the
    default is ``torch.cuda``'s (:data:`CUDA`). Tests give another to run the selection on CPU."""

    initialized: Callable[[], bool]
    current_device: Callable[[], int]
    device_count: Callable[[], int]
    get_state: Callable[[int], torch.Tensor]
    set_state: Callable[[torch.Tensor, int], None]


CUDA = DeviceGenerators(
    initialized=lambda: torch.cuda.is_available() and torch.cuda.is_initialized(),
    current_device=lambda: torch.cuda.current_device(),
    device_count=lambda: torch.cuda.device_count() if torch.cuda.is_available() else 0,
    get_state=lambda device: torch.cuda.get_rng_state(device),
    set_state=lambda state, device: torch.cuda.set_rng_state(state, device),
)


def capture_rng_state(cuda: DeviceGenerators = CUDA) -> RNGState:
    """This process's torch, CUDA (its current device's), numpy and Python RNG states, in a
    ``weights_only``-loadable form."""
    version, words, gauss_next = random.getstate()
    state: RNGState = {
        "torch": torch.get_rng_state(),
        "python": {
            "version": int(version),
            "state": torch.tensor(words, dtype=torch.int64),
            "gauss_next": gauss_next,
        },
    }
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency of Lightning
        np = None
    if np is not None:
        name, key, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state["numpy"] = {
            "bit_generator": str(name),
            "key": torch.from_numpy(key.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    if cuda.initialized():
        device = cuda.current_device()
        state["cuda"] = {"device": int(device), "state": cuda.get_state(device)}
    return state


def restore_rng_state(state: RNGState, cuda: DeviceGenerators = CUDA) -> None:
    """Set this process's generators to ``state`` (from :func:`capture_rng_state`); the CUDA state goes
    into this rank's current device (:func:`cuda_state_for_device`)."""
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py["version"], tuple(int(w) for w in py["state"].tolist()), py["gauss_next"]))
    if "numpy" in state:
        import numpy as np

        npy = state["numpy"]
        key = npy["key"].numpy().astype(np.uint32)
        np.random.set_state((npy["bit_generator"], key, npy["pos"], npy["has_gauss"], npy["cached_gaussian"]))
    saved = state.get("cuda")
    if saved is None:
        return
    count = cuda.device_count()
    if count == 0:  # a GPU run resumed on CPU: there is no CUDA generator to restore
        return
    device = cuda.current_device()
    chosen, problem = cuda_state_for_device(saved, device, count)
    if chosen is not None:
        cuda.set_state(chosen, device)
    else:
        # the package's logger, reached by name: rng.py sits in the base layer beside _logging.py
        logging.getLogger("lit_parallel").warning(problem)


def cuda_state_for_device(saved: Any, device: int, device_count: int) -> tuple[torch.Tensor | None, str]:
    """The saved CUDA generator state that belongs to the rank now on ``device`` (of ``device_count``
    visible), or ``(None, why not)``.

    ``saved`` is what :func:`capture_rng_state` stored: ``{"device": i, "state": tensor}``, the rank's own
    generator wherever it ran; or, from earlier versions, a list of every visible device's state. A list
    tells which entry was the rank's only when it has one entry (the rank saw only its own device) or as
    many as are visible now (the same devices: the rank's device has the same index).
    """
    if isinstance(saved, dict):
        return saved["state"], ""
    states = list(saved)
    if len(states) == 1:
        return states[0], ""
    if len(states) == device_count and 0 <= device < device_count:
        return states[device], ""
    return None, (
        f"the checkpoint holds the CUDA RNG states of {len(states)} visible devices (saved by an earlier"
        f" lit_parallel, one state per visible device) and this rank runs on cuda:{device} of {device_count}"
        " visible: which of them was this rank's generator is unknown, so the CUDA generator is not restored"
        " (dropout masks differ from an uninterrupted run). Resume with as many visible devices per rank as"
        " when it was saved, or save a checkpoint with this version, which stores the rank's own device only"
    )


def _header(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, dict):
        return {"d": {str(k): _header(v, tensors) for k, v in value.items()}}
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return {"t": [str(value.dtype).removeprefix("torch."), list(value.shape)]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"v": value}
    raise TypeError(f"an RNG state holds a {type(value).__name__}, which state_to_bytes cannot encode")


def state_to_bytes(state: RNGState) -> torch.Tensor:
    """``state`` (from :func:`capture_rng_state`) as one CPU ``uint8`` tensor: the header's length (8 bytes),
    the header (JSON: structure, numbers, strings, each tensor's dtype and shape), then the tensors' bytes."""
    tensors: list[torch.Tensor] = []
    header = json.dumps(_header(state, tensors)).encode()
    parts = [
        torch.tensor([len(header)], dtype=torch.int64).view(torch.uint8),
        torch.frombuffer(bytearray(header), dtype=torch.uint8),
    ]
    parts += [t.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    return torch.cat(parts)


def state_from_bytes(data: torch.Tensor) -> RNGState:
    """The state :func:`state_to_bytes` encoded (``data`` may be longer: padding after the end is ignored)."""
    data = data.cpu()  # a row of the gathered ranks' bytes: its offset need not be a multiple of 8
    size = int(data[:8].clone().view(torch.int64).item())
    header = json.loads(bytes(data[8 : 8 + size].numpy().tobytes()).decode())
    offset = 8 + size

    def build(node: dict) -> Any:
        nonlocal offset
        if "d" in node:
            return {k: build(v) for k, v in node["d"].items()}
        if "v" in node:
            return node["v"]
        dtype_name, shape = node["t"]
        dtype = getattr(torch, dtype_name)
        nbytes = math.prod(shape) * dtype.itemsize
        chunk = data[offset : offset + nbytes].clone()
        offset += nbytes
        return chunk.view(dtype).reshape(shape)

    return build(header)
