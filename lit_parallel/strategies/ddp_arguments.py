"""TunedDDPStrategy's arguments, checked when it is built (before any process group)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_deprecation

from lit_parallel.parallel.ddp.buckets import MiB
from lit_parallel.parallel.ddp.comm_hooks import validate_comm_hook
from lit_parallel.strategies.arguments import START_METHODS, check_ddp_kwargs

# torch._dynamo's DDPOptimizer (compiled modules inside DDP) assumes DDP's default 1 MiB first bucket and
# asserts that DDP's largest bucket cap is at least that.
DYNAMO_MIN_CAP = MiB


def check_arguments(
    *,
    bucket_cap_mb: Any,
    find_unused_parameters: Any,
    static_graph: Any,
    comm_hook: str | None,
    powersgd_rank: int,
    powersgd_warmup_steps: int,
    compile: Any,
    forward_sync_buffers: bool | None,
    broadcast_buffers: bool | None,
    start_method: Any,
    ddp_kwargs: dict[str, Any],
    own_names: Any,
) -> bool | None:
    """TunedDDPStrategy's own arguments (the common ones are checked by
    :class:`~lit_parallel.strategies.arguments.CommonArguments`), checked when it is built; returns
    ``forward_sync_buffers`` (the deprecated ``broadcast_buffers`` mapped onto it). ``ddp_kwargs`` loses
    ``bucket_cap_mb_list=None`` (LightningCLI passes DDPStrategy's defaults); ``own_names``: the strategy's
    own parameters."""
    validate_bucket_cap(bucket_cap_mb)
    if find_unused_parameters not in ("auto", True, False):
        raise ValueError(f"find_unused_parameters={find_unused_parameters!r} must be 'auto', True or False")
    if not isinstance(static_graph, bool):
        raise ValueError(f"static_graph={static_graph!r} must be True or False")
    validate_comm_hook(comm_hook, powersgd_rank=powersgd_rank, powersgd_warmup_steps=powersgd_warmup_steps)
    if comm_hook is not None and ddp_kwargs.get("ddp_comm_hook") is not None:
        raise ValueError(
            f"comm_hook={comm_hook!r} and ddp_comm_hook={ddp_kwargs['ddp_comm_hook']!r} were both given;"
            " pass only one of them"
        )
    if not isinstance(compile, (bool, dict)):
        raise ValueError(f"compile={compile!r} must be True, False or a dict of torch.compile options")
    caps = bucket_cap_mb if isinstance(bucket_cap_mb, list) else [bucket_cap_mb]
    if compile is not False and bucket_cap_mb != "auto" and max(caps) < DYNAMO_MIN_CAP / MiB:
        raise ValueError(
            f"bucket_cap_mb={bucket_cap_mb!r} with compile: torch's compiled-DDP graph splitter needs the largest"
            " bucket cap to be at least 1 MiB (its first bucket); use bucket_cap_mb='auto' or a cap >= 1"
        )
    if broadcast_buffers is not None:
        if forward_sync_buffers is not None:
            raise ValueError(
                "broadcast_buffers and forward_sync_buffers were both given; pass only forward_sync_buffers"
                " (broadcast_buffers is its deprecated name)"
            )
        rank_zero_deprecation(
            "TunedDDPStrategy(broadcast_buffers=...) is deprecated (as in torch 2.13's DDP);"
            f" use forward_sync_buffers={broadcast_buffers}"
        )
        forward_sync_buffers = broadcast_buffers
    if start_method not in START_METHODS:
        raise ValueError(
            f"start_method={start_method!r} must be one of {', '.join(map(repr, START_METHODS))}"
            " ('popen' runs the script again per rank; the others start processes from this one)"
        )
    check_ddp_kwargs("TunedDDPStrategy", ddp_kwargs, own_names=own_names)
    return forward_sync_buffers


def validate_bucket_cap(value: Any) -> None:
    if value == "auto":
        return
    values = value if isinstance(value, list) else [value]
    ok = bool(values) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 and v == v for v in values
    )
    if not ok:
        raise ValueError(
            f"bucket_cap_mb={value!r} must be 'auto', a positive number of MiB (e.g. 25) or a non-empty list"
            " of positive MiB per bucket (e.g. [1, 25])"
        )
