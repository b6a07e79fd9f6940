"""Sharded -> full conversion: a sharded (DCP) checkpoint as one file that plain PyTorch loads.

:func:`consolidate` turns one into a single full ``state_dict`` file that plain PyTorch loads without
Lightning or a process group::

    lit-parallel consolidate checkpoints/epoch=3 model.pt --strip-prefix model.

    state = torch.load("model.pt", weights_only=True)
    my_model.load_state_dict(state)

:func:`consolidate_checkpoint` writes a full *Lightning* checkpoint instead (weights, optimizer state keyed by
parameter index, loops, RNG states): ``Trainer(strategy="ddp_tuned").fit(..., ckpt_path=that_file)`` resumes
a run that was saved by ``fsdp_blocks``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lit_parallel.checkpoint.load import load_lightning_meta, load_sharded, model_entry, verify_checkpoint
from lit_parallel.checkpoint.write import ForeignDestinationError, atomic_save


def consolidate(
    checkpoint_dir: str | Path,
    output: str | Path,
    *,
    key: str = "state_dict",
    strip_prefix: str | None = None,
    overwrite: bool = False,
) -> dict[str, torch.Tensor]:
    """Convert a sharded checkpoint into one full ``state_dict`` file (``torch.save``, plain tensors).

    Args:
        checkpoint_dir: the sharded checkpoint folder.
        output: file to write; loads with ``torch.load(output, weights_only=True)``.
        key: the entry holding the model weights (Lightning: ``"state_dict"``); ``""`` takes every tensor.
        strip_prefix: keep only keys starting with it, without it (``"model."`` turns LightningModule keys
            into those of the ``nn.Module`` stored as ``self.model``).
        overwrite: replace an existing file at ``output`` (never a folder); without it an existing
            ``output`` is refused. ``output`` may never be ``checkpoint_dir`` or inside it.

    Returns the state dict written.
    """
    check_output(checkpoint_dir, output, overwrite=overwrite)
    raw = load_sharded(checkpoint_dir, keys={key} if key else None)
    if key:
        if key not in raw:
            raise ValueError(f"the checkpoint has no {key!r} entry; pass key= one of {sorted(raw)} or ''")
        raw = raw[key]
    state = {k: v for k, v in _flatten(raw).items() if isinstance(v, torch.Tensor)}
    if strip_prefix:
        kept = {k[len(strip_prefix) :]: v for k, v in state.items() if k.startswith(strip_prefix)}
        if not kept:
            sample = ", ".join(sorted(state)[:5])
            raise ValueError(f"no key starts with strip_prefix={strip_prefix!r}; keys look like: {sample}")
        state = kept
    state = {k: v.detach().contiguous().clone() for k, v in state.items()}
    atomic_save(lambda tmp: torch.save(state, tmp), output, overwrite=overwrite)
    return state


def check_output(checkpoint_dir: str | Path, output: str | Path, *, overwrite: bool = False) -> None:
    """Refuse a conversion's ``output`` that is ``checkpoint_dir`` or inside it, a folder, or an existing
    file without ``overwrite``: converting never destroys its source or anything it did not write."""
    source, out = Path(checkpoint_dir), Path(output)
    if source.exists() and (out.resolve() == source.resolve() or source.resolve() in out.resolve().parents):
        raise ValueError(
            f"the output {str(out)!r} is the checkpoint {str(source)!r} itself or inside it: writing there would"
            " destroy the checkpoint being converted; choose a path outside it"
        )
    if out.is_dir() and not out.is_symlink():
        raise ForeignDestinationError(
            f"the output {str(out)!r} is an existing folder: a conversion writes one file and never replaces a"
            f" folder (even with --overwrite); choose a file path, e.g. {str(out / 'model.pt')!r}"
        )
    if (out.exists() or out.is_symlink()) and not overwrite:
        raise ForeignDestinationError(
            f"the output {str(out)!r} already exists ({out.stat().st_size if out.exists() else 0} bytes);"
            " pass --overwrite (overwrite=True) to replace it, or choose another path"
        )


def consolidate_checkpoint(
    checkpoint_dir: str | Path, output: str | Path, *, overwrite: bool = False
) -> dict[str, Any]:
    """Convert a sharded *Lightning* checkpoint into one full Lightning checkpoint file.

    The file holds the full weights (``state_dict``), every optimizer's state keyed by parameter index as
    ``torch.optim.Optimizer.state_dict()`` writes it (``optimizer_states``), and everything else the sharded
    checkpoint's ``meta.pt`` holds (loops, callbacks, learning-rate schedulers, RNG states). Resume from it
    with any strategy that loads full checkpoints, e.g. ``Trainer(strategy="ddp_tuned").fit(...,
    ckpt_path=output)``: a run saved by ``fsdp_blocks`` continues under DDP with the same model and optimizer
    state. The optimizer's parameter order must be the LightningModule's (``configure_optimizers`` built
    from ``self.parameters()``), as for any optimizer state dict.

    ``output`` rules as :func:`consolidate` (``overwrite``). Returns the checkpoint written.
    """
    check_output(checkpoint_dir, output, overwrite=overwrite)
    checkpoint = full_checkpoint(checkpoint_dir)
    atomic_save(lambda tmp: torch.save(checkpoint, tmp), output, overwrite=overwrite)
    return checkpoint


def full_checkpoint(checkpoint_dir: str | Path) -> dict[str, Any]:
    """A sharded *Lightning* checkpoint read into one process as the full Lightning checkpoint
    :func:`consolidate_checkpoint` writes (no process group needed). Strategies that hold whole models
    (``ddp_tuned``) load sharded checkpoints through it. Reads those of ``ModelParallelStrategy`` and the
    lit_parallel strategies, and those of Lightning's ``FSDPStrategy(state_dict_type="sharded")`` (FSDP1),
    which keeps the weights under ``"model"``."""
    checkpoint_dir = Path(checkpoint_dir)
    verify_checkpoint(checkpoint_dir)
    raw = load_sharded(checkpoint_dir)
    checkpoint = load_lightning_meta(checkpoint_dir)
    weights = raw.pop(model_entry(checkpoint_dir))  # "model" when Lightning's FSDPStrategy (FSDP1) wrote it
    checkpoint["state_dict"] = {k: v.detach().contiguous().clone() for k, v in weights.items()}
    optimizers = sorted((k for k in raw if k.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
    checkpoint["optimizer_states"] = [_optimizer_state_by_index(raw[k]) for k in optimizers]
    return checkpoint


def _optimizer_state_by_index(state: dict) -> dict:
    """DCP's optimizer state (keyed by parameter name) keyed by parameter index, in ``param_groups`` order."""
    names = [name for group in state["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(names)}
    return {
        "state": {index[name]: dict(values) for name, values in state.get("state", {}).items()},
        "param_groups": [
            {**group, "params": [index[name] for name in group["params"]]} for group in state["param_groups"]
        ],
    }


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, name + "."))
        else:
            out[name] = v
    return out
