"""TunedDDPStrategy on real gloo ranks, against a single-process plain PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from lit_parallel.parallel.ddp.buckets import MiB
from tests.harness import launch
from tests.reference import assert_rel_close, reference_training
from tests.scenarios import ddp as sc

pytestmark = pytest.mark.multiprocess
WORLD = 2
PER_RANK_BATCH = 4


def _reference(net, steps, accumulate=1, clip=None):
    return reference_training(
        net,
        sc.make_dataset(),
        sc.net_loss,
        world_size=WORLD,
        per_rank_batch=PER_RANK_BATCH,
        max_steps=steps,
        lr=sc.LR,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
    )


def _assert_parity(per_rank: list[dict], ref: dict, what: str) -> None:
    # each rank's micro-batch loss is the mean over its 4 samples; the global loss is their mean
    losses = torch.tensor([r["losses"] for r in per_rank]).mean(0)
    assert_rel_close(losses, torch.tensor(ref["losses"]), what=f"{what}: losses")
    for rank, r in enumerate(per_rank):
        for name, expected in ref["params"].items():
            assert_rel_close(r["params"][name], expected, what=f"{what}: rank {rank} {name}")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One launch of 2 ranks runs every scenario."""
    names = [
        "parity",
        "unused_head",
        "probe_leaves_no_trace",
        "comm_bytes",
        "powersgd_bytes",
        "bucket_choice",
        "compile_parity",
        "unused_on_later_step",
        "static_graph_unused_head",
        "probe_memory",
        "average_gradients_in_place",
    ]
    return launch(
        [f"tests.scenarios.ddp:{n}" for n in names], WORLD, tmp_path_factory.mktemp("ddp"), timeout=400
    )


@pytest.mark.timeout(450)
def test_ddp_tuned_matches_single_process_with_accumulation_and_clipping(run):
    out = run.scenario("parity")
    assert out[0]["strategy"] == "TunedDDPStrategy" and out[0]["world"] == WORLD
    # 2 epochs (set_epoch reshuffles) of 5 micro-batches: steps after batches 2, 4, 5 of each epoch
    assert len(out[0]["losses"]) == 10
    _assert_parity(out, _reference(sc.make_net(0), steps=6, accumulate=2, clip=0.05), "parity")


@pytest.mark.timeout(450)
def test_every_parameter_used_means_find_unused_parameters_false(run):
    out = run.scenario("parity")
    assert all(r["find_unused"] is False for r in out)
    assert any("used every trainable parameter: find_unused_parameters=False" in m for m in out[0]["logs"])


@pytest.mark.timeout(450)
def test_unused_auxiliary_head_trains_under_defaults_and_is_logged(run):
    out = run.scenario("unused_head")
    assert all(r["find_unused"] is True for r in out)
    assert out[0]["unused"] == ["net.aux.weight", "net.aux.bias"]
    assert any(
        "net.aux.weight, net.aux.bias" in m and "find_unused_parameters=True" in m for m in out[0]["logs"]
    )
    ref = _reference(sc.make_net(0, aux_head=True), steps=5, accumulate=2, clip=0.05)
    _assert_parity(out, ref, "unused head")
    for r in out:
        for name, before in r["aux_before"].items():
            assert torch.equal(r["params"][f"aux.{name}"], before)


@pytest.mark.timeout(450)
def test_probe_leaves_rng_buffers_and_metrics_untouched(run):
    for r in run.scenario("probe_leaves_no_trace"):
        probed, plain = r["auto"], r["False"]
        assert probed["find_unused"] is False and plain["find_unused"] is False
        # bitwise: dropout masks (RNG), BatchNorm running stats and metric updates must all match
        assert probed["losses"] == plain["losses"]
        assert probed["metric_updates"] == plain["metric_updates"] == 4
        for key, value in plain["state"].items():
            assert torch.equal(probed["state"][key], value), key


def _expected_seen(steps_find_unused: list, wrappers: list[int]) -> list[tuple]:
    """(hook, class, is strategy.model, wraps the LightningModule, wrapper number, find_unused) per hook."""
    rows = [("on_fit_start", 0, steps_find_unused[0]), ("on_train_start", 0, steps_find_unused[0])]
    for b in range(3):
        for hook in ("on_train_batch_start", "on_before_backward"):
            rows.append((f"{hook}:{b}", wrappers[b], steps_find_unused[b]))
    return [(hook, "DistributedDataParallel", True, True, w, f) for hook, w, f in rows]


@pytest.mark.timeout(450)
def test_trainer_model_is_the_ddp_wrapper_from_fit_start_under_the_probe(run):
    """Lightning's contract after configure_ddp: trainer.model is the DDP wrapper at on_fit_start, on_train_start
    and every step, also while the probe decides (find_unused_parameters reads None until then)."""
    for r in run.scenario("probe_leaves_no_trace"):
        # all parameters used: after the probe's optimizer step a new wrapper of the same LightningModule runs
        # without DDP's unused-parameter detection (the probe's wrapper had it on)
        assert r["auto"]["seen"] == _expected_seen([None, False, False], [0, 1, 1])
        assert r["False"]["seen"] == _expected_seen([False, False, False], [0, 0, 0])
    for r in run.scenario("unused_head"):
        # accumulation 2: batches 0 and 1 are the probe step; unused parameters found, so the probe's wrapper
        # (detection on) stays for the whole run
        assert r["seen"] == _expected_seen([None, None, True], [0, 0, 0])


@pytest.mark.timeout(450)
def test_the_probe_steps_peak_memory_is_a_plain_ddp_steps(run):
    for r in run.scenario("probe_memory"):
        probe, plain, grads = r["auto"]["peaks"], r["False"]["peaks"], r["grad_bytes"]
        # a plain DDP step holds the parameters, the gradients (DDP's buckets) and the momentum: 3x the gradients
        assert plain[0] >= 3 * grads
        # the first step (the probe, and the new wrapper built after its optimizer step), then every step
        assert probe[0] <= 1.10 * plain[0], (probe, plain)
        assert max(probe) <= 1.10 * max(plain), (probe, plain)
        assert r["auto"]["find_unused"] is False


@pytest.mark.timeout(450)
def test_static_graph_skips_the_probe_and_trains_a_model_with_an_unused_head(run):
    out = run.scenario("static_graph_unused_head")
    assert any("static_graph=True detects unused parameters itself" in m for m in out[0]["logs"])
    for r in out:
        assert r["seen"] == _expected_seen([False, False, False], [0, 0, 0])
    _assert_parity(out, _reference(sc.make_net(0, aux_head=True), steps=4, clip=0.05), "static graph")


@pytest.mark.timeout(450)
def test_bytes_all_reduced_per_step_fp32_and_fp16(run):
    out = run.scenario("comm_bytes")
    for hook, bytes_per_param in (("allreduce", 4), ("fp16", 2)):
        for r in (rank_out[hook] for rank_out in out):
            per_batch = r["per_batch"]
            assert len(per_batch) == 6
            n_buckets = len(r["bucket_sizes"].split(","))
            assert n_buckets > 1, r["bucket_sizes"]
            for i, b in enumerate(per_batch):
                if i % 2 == 0:  # accumulation micro-batch: no communication at all (no_sync)
                    assert b == {"calls": 0, "bytes": 0, "other_calls": 0}, (hook, i, b)
                else:  # optimizer step: one all-reduce per bucket, every gradient once
                    assert b["bytes"] == bytes_per_param * r["n_params"], (hook, i, b)
                    assert b["calls"] == n_buckets, (hook, i, b)
            # explicit per-bucket caps reach DDP unchanged
            assert r["caps"] == [int(0.01 * MiB), int(0.02 * MiB)]


@pytest.mark.timeout(450)
def test_powersgd_bytes_after_warmup_are_the_low_rank_factors(run):
    for r in run.scenario("powersgd_bytes"):
        assert len(r["bucket_sizes"].split(",")) == 1  # gloo: one bucket
        rank, compressed, uncompressed = 2, 0, 0
        for shape in r["shapes"]:
            rows = shape[0]
            cols = int(torch.tensor(shape[1:]).prod().item()) if len(shape) > 1 else 1
            r_eff = min(rows, cols, rank)
            # PowerSGD compresses a matrix when (rows + cols) * rank * min_compression_rate(2) < rows * cols
            if len(shape) > 1 and (rows + cols) * r_eff * 2 < rows * cols:
                compressed += 4 * r_eff * (rows + cols)
            else:
                uncompressed += 4 * rows * cols
        n_params = sum(int(torch.tensor(s).prod().item()) for s in r["shapes"])
        per_batch = r["per_batch"]
        # warm-up steps (2): plain all-reduce of every gradient
        assert [b["bytes"] for b in per_batch[:2]] == [4 * n_params] * 2
        # then: uncompressed tensors, P factors and Q factors -> three all-reduces
        for b in per_batch[2:]:
            assert b["bytes"] == compressed + uncompressed, (b, compressed, uncompressed)
            assert b["calls"] == 3
        assert all(torch.isfinite(torch.tensor(r["losses"])))


@pytest.mark.timeout(450)
def test_auto_bucket_plan_is_identical_on_ranks_and_used_by_ddp(run):
    out = run.scenario("bucket_choice")
    assert out[0]["plan"] == out[1]["plan"]
    assert out[0]["measurement"] == out[1]["measurement"]  # rank 0's measurement decided
    for r in out:
        assert r["ddp_caps"] == r["plan"]
        assert r["gradient_as_bucket_view"] is True
        first_cap, rest_cap = r["plan"]
        assert first_cap <= rest_cap
        sizes = [int(s) for s in r["bucket_sizes"].split(",")]
        assert sum(sizes) == sum(r["grad_bytes"])
        assert len(sizes) >= 2
        # the first bucket holds the gradients ready first; a bucket exceeds its cap only by its last tensor
        largest = max(r["grad_bytes"])
        assert sizes[0] <= first_cap + largest and all(s <= rest_cap + largest for s in sizes[1:])


@pytest.mark.timeout(450)
def test_compile_before_ddp_keeps_parity(run):
    out = run.scenario("compile_parity")
    assert all(r["compiled_during_fit"] and r["restored_after_fit"] for r in out)
    _assert_parity(out, _reference(sc.make_net(0), steps=6, accumulate=2, clip=0.05), "compile")


@pytest.mark.timeout(450)
def test_parameter_unused_after_the_probe_gets_an_error_naming_the_fix(run):
    for r in run.scenario("unused_on_later_step"):
        assert r["error"] is not None
        assert "Expected to have finished reduction" in r["error"]
        assert "TunedDDPStrategy(find_unused_parameters=True)" in r["error"]


@pytest.mark.timeout(460)
def test_registry_name_under_lightnings_own_launcher_matches_single_process(lightning_launcher_two_ranks):
    """`python train.py` with Trainer(devices=2, strategy="ddp_tuned"): Lightning starts the second rank (the
    strategies' launch through Lightning's launcher, tests/strategies/conftest.py)."""
    out = lightning_launcher_two_ranks.scenario("parity")
    assert [r["strategy"] for r in out] == ["TunedDDPStrategy"] * WORLD
    _assert_parity(out, _reference(sc.make_net(0), steps=6, accumulate=2, clip=0.05), "lightning launcher")


@pytest.mark.timeout(450)
def test_average_gradients_averages_in_place_and_reports_use(run):
    for rank, r in enumerate(run.scenario("average_gradients_in_place")):
        assert r["used"] == [True, True, True, False]
        torch.testing.assert_close(r["grads"][0], torch.full((3,), 1.5))  # (1 + 2) / 2
        torch.testing.assert_close(r["grads"][1], torch.arange(5.0) / 2)  # rank 0 contributed zeros
        torch.testing.assert_close(r["grads"][2], torch.full((40,), 3.0))  # 160 bytes: all-reduced alone
        assert r["grads"][3] is None
        assert r["in_place"] == [True, rank == 1, True, False]
