"""TunedDDPStrategy and its pure functions without process groups: choices, registry, bad input."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import StrategyRegistry
from torch.utils.data import DataLoader

import lit_parallel
from lit_parallel import TunedDDPStrategy
from lit_parallel.parallel.ddp.buckets import AllReduceMeasurement, MiB, choose_bucket_sizes
from lit_parallel.parallel.ddp.comm_hooks import build_comm_hook, validate_comm_hook
from tests.scenarios.ddp import NetModule, make_dataset, make_net


def _m(latency_us: float, gbps: float) -> AllReduceMeasurement:
    return AllReduceMeasurement(
        latency_s=latency_us * 1e-6,
        bandwidth_bytes_per_s=gbps * 1e9,
        world_size=8,
        backend="nccl",
        small_bytes=4096,
        large_bytes=4 * MiB,
        small_s=0.0,
        large_s=0.0,
    )


BIG_MODEL = [4 * MiB] * 100  # 400 MiB of gradients


def test_bucket_size_follows_the_latency_bound():
    # latency 50 us, 10 GB/s: latency <= 10% of a call needs n >= 50e-6 * 10e9 * 0.9 / 0.1 = 4.5e6 bytes
    plan = choose_bucket_sizes(_m(50, 10), BIG_MODEL)
    assert plan.rest_bytes == -(-4_500_000 // 4096) * 4096
    # the first bucket is where latency equals transfer time: 50e-6 * 10e9 = 500 kB
    assert plan.first_bytes == -(-500_000 // 4096) * 4096
    assert plan.cap_mb_list == [plan.first_bytes / MiB, plan.rest_bytes / MiB]
    assert "latency" in plan.reason


def test_bucket_size_grows_with_latency_and_bandwidth():
    base = choose_bucket_sizes(_m(50, 10), BIG_MODEL)
    slower_calls = choose_bucket_sizes(_m(200, 10), BIG_MODEL)
    faster_links = choose_bucket_sizes(_m(50, 40), BIG_MODEL)
    assert slower_calls.rest_bytes > base.rest_bytes and slower_calls.first_bytes > base.first_bytes
    assert faster_links.rest_bytes > base.rest_bytes
    stricter = choose_bucket_sizes(_m(50, 10), BIG_MODEL, latency_share=0.02)
    assert stricter.rest_bytes > base.rest_bytes


def test_bucket_size_is_clamped_and_keeps_two_buckets_for_overlap():
    # 1 ms latency at 100 GB/s asks for 900 MB buckets: capped at max_bytes (1.6 GiB of gradients)
    huge = choose_bucket_sizes(_m(1000, 100), [4 * MiB] * 400)
    assert huge.rest_bytes == 256 * MiB and "max_bytes" in huge.reason
    # tiny latency asks for a few kB: raised to min_bytes
    assert choose_bucket_sizes(_m(1, 1), BIG_MODEL).rest_bytes == 256 * 1024
    # a 4 MiB model never gets a single bucket: at most half its gradients
    small = choose_bucket_sizes(_m(50, 10), [1 * MiB] * 4)
    assert small.rest_bytes == 2 * MiB and "two-bucket overlap" in small.reason
    assert small.first_bytes <= small.rest_bytes


def test_bucket_choice_is_deterministic():
    assert choose_bucket_sizes(_m(73, 3.3), BIG_MODEL) == choose_bucket_sizes(_m(73, 3.3), BIG_MODEL)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"latency_share": 0.0}, "latency_share=0.0"),
        ({"min_bytes": 0}, "min_bytes=0"),
    ],
)
def test_bucket_choice_rejects_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        choose_bucket_sizes(_m(50, 10), BIG_MODEL, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"comm_hook": "int8"}, r"comm_hook='int8' is not a known .* 'fp16'"),
        ({"bucket_cap_mb": -5}, r"bucket_cap_mb=-5 must be 'auto', a positive number"),
        ({"bucket_cap_mb": 0}, r"bucket_cap_mb=0 must be"),
        ({"bucket_cap_mb": []}, r"non-empty list"),
        ({"bucket_cap_mb": "big"}, r"bucket_cap_mb='big'"),
        ({"find_unused_parameters": "yes"}, r"find_unused_parameters='yes' must be 'auto', True or False"),
        ({"comm_hook": "powersgd", "powersgd_rank": 0}, r"powersgd_rank=0 must be an integer >= 1"),
        ({"comm_hook": "powersgd", "powersgd_warmup_steps": 1}, r"powersgd_warmup_steps=1 must be .* >= 2"),
        ({"compile": "yes"}, r"compile='yes' must be True, False or a dict"),
        ({"broadcast_buffers": False, "forward_sync_buffers": True}, "pass only forward_sync_buffers"),
        ({"comm_hook": "fp16", "ddp_comm_hook": print}, "pass only one of them"),
    ],
)
def test_bad_arguments_are_refused_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TunedDDPStrategy(**kwargs)


def test_bf16_hook_is_refused_on_gloo_but_fine_for_nccl():
    validate_comm_hook("bf16", backend="nccl")
    with pytest.raises(ValueError, match=r"comm_hook='bf16' needs the NCCL .* backend is 'gloo'.*'fp16'"):
        validate_comm_hook("bf16", backend="gloo")


def test_comm_hooks_map_to_torch_hooks():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    assert build_comm_hook("fp16")[1] is default_hooks.fp16_compress_hook
    assert build_comm_hook("allreduce")[1] is default_hooks.allreduce_hook
    state, hook = build_comm_hook("powersgd", powersgd_rank=3, powersgd_warmup_steps=7)
    assert hook is powerSGD_hook.powerSGD_hook
    assert state.matrix_approximation_rank == 3 and state.start_powerSGD_iter == 7


def test_broadcast_buffers_is_mapped_to_forward_sync_buffers():
    with pytest.deprecated_call(match="use forward_sync_buffers=False"):
        s = TunedDDPStrategy(broadcast_buffers=False)
    assert s._forward_sync_buffers is False


def test_strategy_names_are_registered_with_descriptions_and_no_clash():
    assert StrategyRegistry["ddp_tuned"]["strategy"] is TunedDDPStrategy
    assert "bucket" in StrategyRegistry["ddp_tuned"]["description"]
    assert StrategyRegistry["ddp_tuned_find_unused_parameters_true"]["init_params"] == {
        "find_unused_parameters": True
    }
    # Lightning's own names still mean Lightning's strategies
    from lightning.pytorch.strategies import DDPStrategy

    assert StrategyRegistry["ddp"]["strategy"] is DDPStrategy
    for name in ("ddp_tuned",):
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=name, logger=False)
        assert isinstance(trainer.strategy, lit_parallel.TunedDDPStrategy)


def _fit_one_process(strategy, **trainer_kwargs):
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        **trainer_kwargs,
    )
    trainer.fit(NetModule(make_net(0)), DataLoader(make_dataset(), batch_size=4))


@pytest.mark.timeout(60)
def test_backend_dependent_errors_come_before_any_process_group():
    with pytest.raises(ValueError, match="comm_hook='bf16' needs the NCCL"):
        _fit_one_process(TunedDDPStrategy(comm_hook="bf16"))
    assert not dist.is_initialized()
    with pytest.raises(
        ValueError, match=r"static_graph=True with accumulate_grad_batches=2 .* static_graph=False"
    ):
        _fit_one_process(TunedDDPStrategy(static_graph=True), accumulate_grad_batches=2)
    assert not dist.is_initialized()


def test_gradient_bytes_follow_ddp_bucket_order():
    from lit_parallel.parallel.ddp.buckets import gradient_bytes_in_ready_order

    net = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2))
    net[0].bias.requires_grad_(False)
    # last registered first: 2nd bias (2), 2nd weight (10), 1st weight (15); the frozen bias is skipped
    assert gradient_bytes_in_ready_order(net) == [8, 40, 60]
