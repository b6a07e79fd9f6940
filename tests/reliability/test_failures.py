"""Reliability on real gloo ranks: failures, hangs, resume, preemption, integrity, resharding.

Twelve launches: resume + preemption + refusals (torchrun, 2 ranks); hangs (torchrun, 2 ranks, the last
case failing on purpose); recovery after failures (Lightning's launcher, 2 ranks); a rank raising during a
checkpoint save (torchrun, fails); rank 0 raising, and rank 0 killed, while rank 1 is stuck (Lightning's
launcher, two failing launches); resharding (4 ranks save, then 3 ranks load: two launches); rank 1 raising
in on_train_end after an epoch-end checkpoint (three short failing launches: torchrun, Lightning's ddp
launcher, ddp_spawn), which also spies on torch.save in every rank; rank 1 reading its empty fsdp_blocks shard
in test_step (torchrun, fails). Expected values are computed
independently: an uninterrupted run for resumed runs, the state gathered at save time for restored ones,
the wall clock for deadlines.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch

from lit_parallel.checkpoint.convert import consolidate, consolidate_checkpoint
from lit_parallel.checkpoint.load import LIGHTNING_META, IncompleteCheckpointError, verify_checkpoint
from lit_parallel.reliability import RNG_KEY
from tests.harness import launch, launch_failing
from tests.reference import assert_bitwise
from tests.scenarios import reliability as sc

pytestmark = pytest.mark.multiprocess
STRATEGIES = ["ddp_tuned", "fsdp_blocks", "hsdp", "tp_dp"]
TIMEOUT = sc.TIMEOUT_S
# How long after a hang starts its error may come: the strategy's TIMEOUT, the waiting rank reaching its
# collective and the report gathering where every rank is. Counted from the moment the hang starts (the
# hanging rank's own time stamp), so start-up and the steps before it do not count; far below the 120 s of
# the process groups' own timeout (tests/scenarios/reliability.py), which is what fires if TIMEOUT does not.
HANG_TO_ERROR_S = TIMEOUT + 10


def _after_the_hang(result: dict) -> float:
    """Seconds from the moment the hang started to this rank's error (both time stamps taken in the ranks)."""
    since = result["since_hang"]
    assert since is not None, result
    print(f"hang to error: {since:.2f}s (fit to error: {result['elapsed']:.1f}s)")
    # the error comes from the strategy's timeout: after waiting about TIMEOUT (the waiting rank may reach its
    # collective a moment before the hanging rank's stamp), and not much later
    assert TIMEOUT / 2 < since < HANG_TO_ERROR_S, result
    return since


SC = "tests.scenarios.reliability"


def _stamp(path: Path) -> float:
    return float(path.read_text())


# --- resume, mid-epoch, preemption, refusals ------------------------------------------------------------


@pytest.fixture(scope="module")
def resume(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    data = root / "data"
    data.mkdir()
    scenarios = [f"{SC}:resume_{n}" for n in STRATEGIES] + [f"{SC}:refusals", f"{SC}:mark_end"]
    res = launch(scenarios, 2, root, args={"dir": str(data)}, timeout=500)
    return res, data, time.time()


@pytest.mark.timeout(560)
@pytest.mark.parametrize("name", STRATEGIES)
def test_resume_from_an_epoch_end_checkpoint_is_bitwise_identical_with_dropout(resume, name):
    res, _, _ = resume
    for rank, out in enumerate(res.scenario(f"resume_{name}")):
        full, n = out["full"]["losses"], out["full"]["batches_per_epoch"]
        assert len(full) == sc.EPOCHS * n
        # dropout (torch), numpy and Python draws all continue exactly where the first epoch left them
        assert_bitwise(out["from_epoch_end"]["losses"], full[n:], f"{name} rank {rank} losses")
        if rank == 0:
            assert_bitwise(out["from_epoch_end"]["params"], out["full"]["params"], f"{name} final weights")


@pytest.mark.timeout(560)
@pytest.mark.parametrize("name", STRATEGIES)
def test_resume_from_a_mid_epoch_checkpoint_continues_with_the_next_unseen_batch(resume, name):
    res, _, _ = resume
    for rank, out in enumerate(res.scenario(f"resume_{name}")):
        # step6.ckpt: after 6 optimizer steps; the run continues with batch 7 of 8 (or 16), never repeating one
        assert_bitwise(
            out["from_mid_epoch"]["losses"], out["full"]["losses"][6:], f"{name} rank {rank} losses"
        )
        if rank == 0:
            assert_bitwise(out["from_mid_epoch"]["params"], out["full"]["params"], f"{name} final weights")


@pytest.mark.timeout(560)
@pytest.mark.parametrize("name", STRATEGIES)
def test_preemption_signal_saves_requeues_and_the_requeued_job_resumes_exactly(resume, name):
    res, _, _ = resume
    outs = res.scenario(f"resume_{name}")
    for rank, out in enumerate(outs):
        p, n = out["preempted"], out["full"]["batches_per_epoch"]
        # torchrun inside a SLURM job: Lightning picks TorchElasticEnvironment, the job is still SLURM's
        assert p["cluster"] == "TorchElasticEnvironment"
        # rank 0 got SIGUSR1 at epoch 1 batch 0, rank 1 only later: the flags of that batch's step boundary are
        # all-reduced without waiting and read at the next boundary, where both ranks save (one step later)
        assert p["stopped_at_step"] == n + 2
        assert_bitwise(
            torch.cat([p["first"], p["second"]]), out["full"]["losses"], f"{name} rank {rank} losses"
        )
    p = outs[0]["preempted"]
    assert_bitwise(p["params"], outs[0]["full"]["params"], f"{name} final weights")
    hpc = Path(p["dir"]) / "hpc_ckpt_1.ckpt"
    assert verify_checkpoint(hpc) == ("file" if name == "ddp_tuned" else "sharded")
    # `scontrol requeue <job>` ran once, on rank 0 only
    assert Path(p["scontrol_log"]).read_text().splitlines() == ["requeue 4242"]


@pytest.mark.timeout(560)
@pytest.mark.parametrize("name", STRATEGIES)
def test_every_ranks_rng_states_are_stored_in_a_weights_only_loadable_form(resume, name):
    res, data, _ = resume
    path = data / name / "epoch" / "epoch0.ckpt"
    meta = path if name == "ddp_tuned" else path / LIGHTNING_META
    entry = torch.load(meta, weights_only=True)[RNG_KEY]
    assert entry["world_size"] == 2 and len(entry["ranks"]) == 2
    for state in entry["ranks"]:
        assert set(state) == {"torch", "python", "numpy"}
        assert state["numpy"]["bit_generator"] == "MT19937" and state["numpy"]["key"].shape == (624,)
        assert state["python"]["state"].shape == (625,)
    if name != "tp_dp":  # the ranks drew different numbers, so a swapped state would change the losses
        assert not torch.equal(entry["ranks"][0]["torch"], entry["ranks"][1]["torch"])


@pytest.mark.timeout(560)
def test_mid_epoch_checkpoints_that_cannot_continue_exactly_are_refused_before_training(resume):
    out = resume[0].scenario("refusals")[0]
    for name in ("ddp_tuned", "fsdp_blocks"):
        r = out[f"{name}_own_sampler"]
        assert r["trained"] == 0
        assert (
            "cannot resume exactly from this mid-epoch checkpoint (epoch 0 after 3 of 4 batches)"
            in r["error"]
        )
        assert "sampler EveryOtherSampler" in r["error"] and "Fix:" in r["error"]
    r = out["in_accumulation_window"]
    assert r["trained"] == 0
    assert "in the middle of a gradient accumulation window of 2 batches" in r["error"]


@pytest.mark.timeout(560)
def test_loading_an_incomplete_checkpoint_names_what_is_missing(resume):
    out = resume[0].scenario("refusals")[0]
    r = out["missing_shard"]
    assert r["trained"] == 0 and r["error"].startswith("IncompleteCheckpointError")
    assert "missing __1_0.distcp (a shard file listed in .metadata)" in r["error"]
    r = out["truncated_file"]
    assert r["trained"] == 0 and r["error"].startswith("IncompleteCheckpointError")
    assert "is truncated or not a torch.save archive" in r["error"]


@pytest.mark.timeout(560)
def test_saved_checkpoints_are_complete_with_dcp_metadata_written_last(resume):
    _, data, _ = resume
    assert not list(data.rglob(".lit_parallel_partial_*")), "a temporary save was left behind"
    # (refusals/ holds checkpoints broken on purpose)
    sharded = [p for p in data.rglob("*.ckpt") if p.is_dir() and p.parent.name != "refusals"]
    assert len(sharded) >= 15
    for ckpt in sharded:
        assert verify_checkpoint(ckpt) == "sharded"
        index = (ckpt / ".metadata").stat().st_mtime_ns
        assert all(f.stat().st_mtime_ns <= index for f in ckpt.iterdir()), ckpt


# --- hangs ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hangs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hangs")
    data = root / "data"
    data.mkdir()
    cases = ["hang_in_data_loading", "skipped_backward", "collective_on_one_rank", "stuck_in_training_step"]
    start = time.time()
    res = launch(
        [f"{SC}:{c}" for c in cases] + [f"{SC}:hang_until_exit"],
        2,
        root,
        args={"dir": str(data)},
        timeout=300,
        expect_failure=True,
    )
    end = start + res.wall_s

    def case(tag: str) -> list[dict]:
        return [torch.load(data / f"{tag}_rank{r}.pt", weights_only=True) for r in range(2)]

    return res, case, data, end


@pytest.mark.timeout(360)
def test_rank_stuck_in_data_loading_is_reported_with_where_it_is(hangs):
    _, case, _, _ = hangs
    r0, r1 = case("data")  # ddp_tuned
    _after_the_hang(r0)
    err = r0["error"]
    assert "collectives timed out (the strategy's timeout: 4 s) on rank(s) 0:" in err
    assert "rank 1 is alive and did not fail: it is in after training batch 1 (epoch 0)" in err
    assert "in __getitem__" in err  # the stuck rank's main thread, in the dataset
    assert "rank(s) 1 have not reached training batch 2 yet" in err
    assert r1["error"] is not None  # released later, rank 1 finds its peer gone


@pytest.mark.timeout(360)
def test_rank_that_skips_backward_is_detected_and_the_waiting_rank_names_it(hangs):
    _, case, _, _ = hangs
    r0, r1 = case("skip")  # fsdp_blocks
    assert (
        "rank 1: the loss of training batch 1 (epoch 0) was not computed from the model's parameters"
        in (r1["error"])
    )
    _after_the_hang(r0)
    assert "rank 0: torch.distributed.all_gather_single, during backward of training batch 1" in r0["error"]
    assert (
        "rank 1 failed too" in r0["error"] and "was not computed from the model's parameters" in r0["error"]
    )


@pytest.mark.timeout(360)
def test_collective_called_on_one_rank_times_out_on_the_mesh_sub_group_with_the_strategy_timeout(hangs):
    _, case, _, _ = hangs
    r0, r1 = case("sync")  # hsdp: rank 1's gradient all-reduce runs on the replicate group of the mesh
    for r in (r0, r1):
        _after_the_hang(r)
    errors = r0["error"] + r1["error"]
    assert "(the strategy's timeout: 4 s)" in errors
    assert "on training batch 1 the ranks waited in different collectives" in errors
    assert "self.log(..., sync_dist=True)" in errors


@pytest.mark.timeout(360)
def test_tensor_parallel_rank_stuck_in_training_step_is_reported(hangs):
    _, case, _, _ = hangs
    r0, _ = case("tp")  # tp_dp: rank 0 waits in the forward pass's first tensor-parallel collective
    _after_the_hang(r0)
    assert "collectives timed out (the strategy's timeout: 4 s) on rank(s) 0:" in r0["error"]
    assert (
        "rank 1 is alive and did not fail: it is in training_step of training batch 1 (epoch 0)"
        in r0["error"]
    )
    assert "in block: _wait_for(release, 60)" in r0["error"]


@pytest.mark.timeout(360)
def test_every_process_exits_within_the_timeout_plus_ten_seconds_of_a_hang(hangs):
    res, _, data, end = hangs
    assert res.failed and res.returncode != 0 and not res.timed_out
    started = _stamp(data / "hang_started")
    assert end - started < TIMEOUT + 10, f"processes outlived the hang by {end - started:.1f}s"
    assert "collectives timed out (the strategy's timeout: 4 s) on rank(s) 0" in res.output


# --- Lightning's launcher: the strategy owns the process group ------------------------------------------


@pytest.fixture(scope="module")
def recovery(tmp_path_factory):
    root = tmp_path_factory.mktemp("recovery")
    res = launch(f"{SC}:recovery_under_lightning_launcher", 2, root, launcher="lightning", timeout=300)
    return res.scenario("recovery_under_lightning_launcher")


@pytest.mark.timeout(360)
def test_debug_level_detail_names_mismatched_collectives_at_once(recovery):
    for rank, out in enumerate(recovery):
        err = out["mismatch"]["error"]
        assert "Detected mismatch between collectives on ranks" in err, err
        assert "TensorShape=[3]" in err  # rank 1's extra all-reduce
        assert f"lit_parallel: rank {rank} failed in" in err
        assert "timed out" not in err  # caught when the collectives were called, not after the timeout
        assert out["mismatch"]["initialized_after"] is False  # the failed run's own group is destroyed


@pytest.mark.timeout(360)
def test_timeout_of_a_strategy_created_process_group(recovery):
    out = recovery[0]["timeout"]  # fsdp_blocks; rank 1 blocks in training_step
    _after_the_hang(out)
    assert "collectives timed out (the strategy's timeout: 4 s) on rank(s) 0:" in out["error"]
    assert "rank 1 is alive and did not fail" in out["error"]
    assert all(r["timeout"]["initialized_after"] is False for r in recovery)


@pytest.mark.timeout(360)
def test_the_same_processes_train_again_on_a_fresh_process_group(recovery):
    for out in recovery:
        clean = out["clean"]
        assert clean["error"] is None and clean["owns"] is True and clean["world"] == 2
        assert len(clean["losses"]) == 4 and torch.isfinite(clean["losses"]).all()


# --- ranks that raise -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def raise_in_save(tmp_path_factory):
    return launch_failing(
        tmp_path_factory, "raise_torchrun", f"{SC}:raise_during_checkpoint_save", timeout=300
    )


@pytest.mark.timeout(360)
def test_a_rank_that_raises_stops_every_rank_promptly_and_is_named(raise_in_save, resume):
    res, data, end = raise_in_save
    assert res.failed and res.returncode != 0 and not res.timed_out
    assert sorted(res.errors) == [0, 1]  # every rank exited non-zero: rank 1 raised, rank 0 saw it
    assert "ValueError: failure injected on rank 1 while writing its checkpoint shard" in res.errors[1]
    for rank in (0, 1):
        assert f"lit_parallel: rank {rank} failed in saving the checkpoint" in res.output
    assert "failed on rank 1: ValueError: failure injected on rank 1" in res.output
    raised = _stamp(data / "raised_1")
    assert end - raised < 10, f"the ranks outlived the failure by {end - raised:.1f}s"
    # a clean launch needs some time to shut down too: the failure adds only a little to it
    _, resume_data, resume_end = resume
    clean_tail = resume_end - max(_stamp(resume_data / f"end_rank{r}") for r in range(2))
    added = (end - raised) - clean_tail
    print(f"failure to exit: {end - raised:.2f}s; clean shutdown: {clean_tail:.2f}s; added: {added:.2f}s")
    assert added < 2.0


@pytest.mark.timeout(360)
def test_an_interrupted_save_leaves_the_previous_checkpoint_whole(raise_in_save, tmp_path):
    _, data, _ = raise_in_save
    path = data / "last.ckpt"
    assert verify_checkpoint(path) == "sharded"
    state = consolidate(path, tmp_path / "model.pt")  # loads without a process group, weights_only
    assert_bitwise(state, torch.load(data / "expected_model.pt", weights_only=True), "last.ckpt")
    for partial in data.glob(".lit_parallel_partial_*"):  # if the failed save left anything, it is refused
        with pytest.raises(IncompleteCheckpointError, match="missing"):
            verify_checkpoint(partial)


@pytest.fixture(scope="module")
def rank0_raises(tmp_path_factory):
    return launch_failing(
        tmp_path_factory,
        "raise_lightning",
        f"{SC}:rank0_raises_while_rank1_is_stuck",
        launcher="lightning",
        timeout=200,
    )


@pytest.mark.timeout(260)
def test_rank0_failing_under_lightnings_launcher_stops_the_other_ranks(rank0_raises):
    res, data, end = rank0_raises
    assert res.failed and res.returncode != 0 and not res.timed_out
    assert (data / "rank1_stuck").exists()  # rank 1 was blocked for two minutes when rank 0 raised
    raised = _stamp(data / "rank0_raised")
    assert end - raised < 10, f"a rank outlived the failed run by {end - raised:.1f}s"
    assert "ValueError: failure injected on rank 0" in res.errors[0]
    assert (
        "lit_parallel: rank 0 (the launching process) failed with ValueError: failure injected on rank 0;"
        " stopped rank(s) 1" in res.output
    )
    assert 1 not in res.results


@pytest.fixture(scope="module")
def rank0_killed(tmp_path_factory):
    return launch_failing(
        tmp_path_factory,
        "kill_lightning",
        f"{SC}:rank0_killed_while_rank1_is_stuck",
        launcher="lightning",
        timeout=200,
    )


@pytest.mark.timeout(260)
def test_ranks_started_by_lightnings_launcher_exit_when_the_launching_process_is_killed(rank0_killed):
    res, data, end = rank0_killed
    assert res.failed and not res.timed_out
    assert (data / "rank1_stuck").exists()
    killed = _stamp(data / "rank0_killed")
    assert end - killed < 10, f"rank 1 outlived the killed launching process by {end - killed:.1f}s"
    assert "lit_parallel: local rank 1" in res.output and "is gone; exiting" in res.output
    assert res.results == {}


# --- resharding -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reshard(tmp_path_factory, four_ranks, reshard_dir):
    # saved on 4 ranks by the shared 4-rank launch (tests/conftest.py)
    data = reshard_dir
    saved = four_ranks.scenario("reshard_save")[0]
    # fsdp_blocks -> ddp_tuned goes through a full Lightning checkpoint, written without a process group
    consolidate_checkpoint(data / "fsdp.ckpt", data / "fsdp_consolidated.ckpt")
    root = tmp_path_factory.mktemp("reshard_load")
    loaded = launch(f"{SC}:reshard_load", 3, root, args={"dir": str(data)}, timeout=400).scenario(
        "reshard_load"
    )[0]
    return saved, loaded


@pytest.mark.timeout(860)
@pytest.mark.parametrize(
    "label, source, strategy",
    [
        ("fsdp_to_fsdp", "fsdp_blocks", "TransformerFSDPStrategy"),
        ("hsdp_to_hsdp_1x3", "hsdp", "HybridShardStrategy"),
        ("hsdp_to_hsdp_3x1", "hsdp", "HybridShardStrategy"),
        ("tp_to_fsdp", "tp_dp", "TransformerFSDPStrategy"),
        ("fsdp_to_ddp", "fsdp_blocks", "TunedDDPStrategy"),
    ],
)
def test_checkpoint_saved_on_4_ranks_restores_bitwise_on_3_in_another_layout(
    reshard, label, source, strategy
):
    saved, loaded = reshard
    out, expected = loaded[label], saved[source]
    assert out["strategy"] == strategy and out["world"] == 3
    assert out["trained"] == 0 and out["global_step"] == expected["global_step"]
    assert_bitwise(out["model"], expected["model"], f"{label} model")
    assert_bitwise(out["optimizer"], expected["optimizer"], f"{label} optimizer")


# --- rank 1 raises in on_train_end, under each launcher --------------------------------------------------

LAUNCHERS = {
    "torchrun": ("torchrun", "popen"),
    "ddp": ("lightning", "popen"),
    "ddp_spawn": ("lightning", "spawn"),
}


@pytest.fixture(scope="module", params=list(LAUNCHERS))
def train_end_failure(request, tmp_path_factory):
    launcher, start_method = LAUNCHERS[request.param]
    res, data, _ = launch_failing(
        tmp_path_factory,
        f"train_end_{request.param}",
        f"{SC}:rank1_raises_in_on_train_end",
        launcher=launcher,
        args={"start_method": start_method},
        timeout=200,
    )
    return request.param, res, data


@pytest.mark.timeout(260)
def test_a_rank_failing_in_on_train_end_is_named_with_its_hook_under_every_launcher(train_end_failure):
    name, res, _ = train_end_failure
    assert res.failed and not res.timed_out, res.describe_failure()
    labels = re.findall(r"lit_parallel: rank (\d+) failed in (\w+)", res.output)
    assert ("1", "on_train_end") in labels, res.output[-4000:]
    # no other rank, and no other hook, is named as the one that failed (rank 0's setup under ddp_spawn was)
    assert set(labels) == {("1", "on_train_end")}, labels


@pytest.mark.timeout(260)
def test_a_rank_reading_its_empty_shard_in_test_step_is_named_with_the_step_and_the_fix(tmp_path_factory):
    res, _, _ = launch_failing(
        tmp_path_factory, "test_step_shard", f"{SC}:rank1_reads_an_empty_shard_in_test_step", timeout=200
    )
    assert res.failed and not res.timed_out, res.describe_failure()
    labels = re.findall(r"lit_parallel: rank (\d+) failed in (\w+)", res.output)
    assert ("1", "test_step") in labels and ("0", "setup") not in labels, labels
    assert "failed in test_step of test batch 0" in res.output
    # the error rank 1 raised carries the fix (docs/explanations/compatibility.md, "Parameters read outside a forward")
    assert "param.full_tensor()" in res.output, res.output[-4000:]


@pytest.mark.timeout(260)
def test_no_rank_but_0_calls_torch_save_for_a_single_file_checkpoint(train_end_failure):
    name, _, data = train_end_failure
    rank0 = (data / "saves_rank0").read_text().splitlines()
    rank1 = (data / "saves_rank1").read_text().splitlines()
    # the RNG states of both ranks went into the epoch-end checkpoint without rank 1 pickling anything
    assert rank1 == [], (name, rank1)
    written = sorted((data / "ckpt").glob("*.ckpt"))
    assert [p.name for p in written] == ["epoch0.ckpt"]
    assert len(rank0) == 1, (name, rank0)  # the spy sees rank 0's one checkpoint write
    entry = torch.load(written[0], weights_only=True)[RNG_KEY]
    assert entry["world_size"] == 2 and not torch.equal(
        entry["ranks"][0]["torch"], entry["ranks"][1]["torch"]
    )
