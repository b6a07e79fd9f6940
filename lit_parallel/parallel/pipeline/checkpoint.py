"""Optimizer states of pipeline stages in distributed checkpoints that load under any layout.

Each pipeline rank holds the optimizer of its own stages, so its ``param_groups`` name only its own
parameters; DCP keeps one copy of that non-tensor entry (rank 0's). Saved as such, a checkpoint would not
load under another pipeline size or strategy. So the saved groups name every parameter of the whole model
(gathered over the pipeline ranks, in model order), and on load each rank keeps its own names.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["globalize_param_groups", "load_full_state_dict_into_stages", "localize_param_groups"]


def globalize_param_groups(state: dict[str, Any], order: dict[str, int], group: Any) -> dict[str, Any]:
    """``state`` (``get_optimizer_state_dict`` of this rank) with every group naming the parameters of all
    pipeline ranks, sorted by their position ``order`` in the whole model."""
    mine = [list(g["params"]) for g in state["param_groups"]]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    if len({len(g) for g in gathered}) != 1:
        raise ValueError(
            "pipeline ranks have different numbers of optimizer parameter groups"
            f" ({[len(g) for g in gathered]}); configure_optimizers must build the same groups on every rank"
        )
    for i, g in enumerate(state["param_groups"]):
        names = {n for per_rank in gathered for n in per_rank[i]}
        g["params"] = sorted(names, key=lambda n: order.get(n, len(order)))
    return state


def localize_param_groups(loaded: dict[str, Any], local: dict[str, Any]) -> dict[str, Any]:
    """A loaded optimizer state whose groups name the whole model's parameters, cut to this rank's
    (``local``: this rank's own ``get_optimizer_state_dict``). Hyperparameters come from the checkpoint."""
    saved = loaded["param_groups"]
    if len(saved) != len(local["param_groups"]):
        raise ValueError(
            f"the checkpoint's optimizer has {len(saved)} parameter groups, this one"
            f" {len(local['param_groups'])}; build the same groups in configure_optimizers"
        )
    groups = []
    for group, own in zip(saved, local["param_groups"]):
        groups.append({**group, "params": list(own["params"])})
    mine = {n for g in groups for n in g["params"]}
    state = {k: v for k, v in loaded.get("state", {}).items() if k in mine}
    return {"state": state, "param_groups": groups}


def load_pipeline_checkpoint(module: Any, optimizers: list, path: Any, strict: bool) -> dict[str, Any]:
    """Load this rank's stages and their optimizer states from a distributed checkpoint of any layout;
    returns Lightning's ``meta.pt`` entries."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    from lit_parallel.checkpoint.load import dcp_load, load_lightning_meta

    module_state = {"state_dict": get_model_state_dict(module)}
    dcp_load(module_state, path)
    module.load_state_dict(module_state["state_dict"], strict=strict)
    for i, optimizer in enumerate(optimizers):
        key = f"optimizer_{i}"
        local = get_optimizer_state_dict(module, optimizer)
        loaded = {key: get_optimizer_state_dict(module, optimizer)}
        dcp_load(loaded, path)
        set_optimizer_state_dict(
            module,
            optimizer,
            optim_state_dict=localize_param_groups(loaded[key], local),
            options=StateDictOptions(cpu_offload=True),
        )
    return load_lightning_meta(path)


def load_full_checkpoint_file(
    module: Any, optimizers: list, path: Any, order: dict[str, int], strict: bool
) -> dict[str, Any]:
    """Load this rank's stages from a full checkpoint file (``ddp_tuned``, ``lit-parallel consolidate``):
    every rank reads the file (memory-mapped) and keeps its own entries; optimizer states saved by index
    are matched to parameter names by their position ``order`` in the whole model. Returns the rest."""
    import torch
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    checkpoint = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    full = checkpoint.pop("state_dict")
    local_keys = set(module.state_dict())
    options = StateDictOptions(full_state_dict=True, strict=strict)
    missing = sorted(local_keys - set(full))
    if strict and missing:
        raise KeyError(
            f"the checkpoint {str(path)!r} lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}"
        )
    set_model_state_dict(module, {k: v for k, v in full.items() if k in local_keys}, options=options)
    names = sorted(order, key=order.get)
    for optimizer, saved in zip(optimizers, checkpoint.pop("optimizer_states", [])):
        local = get_optimizer_state_dict(module, optimizer)
        by_name = {
            "state": {names[i]: v for i, v in saved.get("state", {}).items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in saved["param_groups"]],
        }
        # torch's full-state path needs at least one tensor (SGD without momentum keeps none)
        has_tensors = any(torch.is_tensor(v) for values in by_name["state"].values() for v in values.values())
        set_optimizer_state_dict(
            module,
            optimizer,
            optim_state_dict=localize_param_groups(by_name, local),
            options=options if has_tensors else StateDictOptions(strict=strict),
        )
    return checkpoint


def load_full_state_dict_into_stages(module: Any, path: Any) -> None:
    """``init_from`` for pipeline stages: rank 0 reads the full state dict file (memory-mapped), every rank
    receives it one tensor at a time and keeps its own stages' entries (its shards of them). Every rank's
    keys must be in the file: the ranks that miss some are named, on every rank, before any tensor moves."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full: dict = {}
    if dist.get_rank() == 0:
        full = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    keys: list[Any] = [sorted(full) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(keys, src=0)
    mine = sorted(set(module.state_dict()) - set(keys[0]))
    missing: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(missing, mine)
    if any(missing):
        where = "; ".join(
            f"rank {r}: {m[:5]}{' ...' if len(m) > 5 else ''}" for r, m in enumerate(missing) if m
        )
        raise KeyError(
            f"init_from={str(path)!r} lacks entries of the pipeline stages ({where}); save the whole model's"
            " state_dict (keys of the LightningModule), e.g. with `lit-parallel consolidate`"
        )
    # strict=False: rank 0's dict holds every stage's entries, each rank loads only its own (checked above)
    set_model_state_dict(
        module, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    )
