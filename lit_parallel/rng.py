"""Random number generator states as plain tensors and numbers, so ``torch.load(weights_only=True)`` accepts them.

``numpy.random.get_state()`` returns a tuple holding a numpy array, and ``random.getstate()`` a tuple of 625
Python ints; neither loads with ``weights_only=True``. :func:`capture_rng_state` stores every generator a
training step draws from (torch CPU, CUDA when initialised, numpy's global generator, Python's ``random``)
as tensors, ints, floats and strings; :func:`restore_rng_state` puts them back exactly.
"""

from __future__ import annotations

import random
from typing import Any

import torch

RNGState = dict[str, Any]


def capture_rng_state() -> RNGState:
    """This process's torch, CUDA, numpy and Python RNG states, in a ``weights_only``-loadable form."""
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
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def restore_rng_state(state: RNGState) -> None:
    """Set this process's generators to ``state`` (from :func:`capture_rng_state`)."""
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py["version"], tuple(int(w) for w in py["state"].tolist()), py["gauss_next"]))
    if "numpy" in state:
        import numpy as np

        npy = state["numpy"]
        key = npy["key"].numpy().astype(np.uint32)
        np.random.set_state((npy["bit_generator"], key, npy["pos"], npy["has_gauss"], npy["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
