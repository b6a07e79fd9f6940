"""pp_dp on real gloo ranks against one plain PyTorch process on the same global batches.

Launch A (2 ranks): every schedule at pp2 (parity, reported loss, validation through the stages), the
missing-hook error, checkpoints across pipeline sizes and strategies. Launch B (4 ranks, shared with tp_dp and the
callbacks: tests/conftest.py): pp2 x dp2 for the schedules that run with FSDP2, and the recipe
(recipes/configs/gpt_pp.yaml) as written, through its first validation. Launch C (8 ranks on two loopback torchrun
nodes, shared with tp_dp's 3-D layout: tests/conftest.py): pp2 x dp2 x tp2. Expected values come from tests/reference.py, never from the code under test.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import launch
from tests.models import GPT, GPTConfig
from tests.reference import assert_rel_close, collate, rank_orders, reference_training
from tests.scenarios import pipeline as sc
from tests.scenarios.recipes import single_machine_command

pytestmark = pytest.mark.multiprocess
BATCH = 4  # per data-parallel rank


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A full state dict file (keys of the LightningModule) for ``init_from``."""
    state = {f"model.{k}": v for k, v in sc.build_model(seed=123).state_dict().items()}
    path = tmp_path_factory.mktemp("pretrained") / "weights.pt"
    torch.save(state, path)
    return path, state


@pytest.fixture(scope="module")
def run2(tmp_path_factory, pretrained):
    names = ["parity_pp2", "missing_hook", "memory_and_p2p", "options", "smaller_last_batch", "checkpoints"]
    names.append("meta_init")
    return launch(
        [f"tests.scenarios.pipeline:{n}" for n in names],
        2,
        tmp_path_factory.mktemp("pp2"),
        args={"pretrained": str(pretrained[0])},
        timeout=1500,
    )


def _reference(dp: int, name: str = "gpt") -> dict:
    return reference_training(
        sc.build_model(name=name),
        sc.lm_dataset(),
        sc.lm_loss,
        world_size=dp,
        per_rank_batch=BATCH,
        max_steps=3,
        lr=0.1,
        accumulate_grad_batches=2,
        gradient_clip_val=0.5,
    )


def _merged(per_rank: list[dict]) -> dict:
    """Every rank's stage parameters together: the whole model (stages hold disjoint keys)."""
    merged: dict = {}
    for out in per_rank:
        for k, v in out["params"].items():
            if k in merged:
                assert torch.equal(merged[k], v), f"{k}: ranks of one stage disagree"
            merged[k] = v
    return merged


def _assert_parity(per_rank: list[dict], ref: dict, what: str) -> None:
    for rank, out in enumerate(per_rank):
        # the reported loss is the whole step's mean, identical on every rank
        assert_rel_close(
            torch.tensor(out["losses"]), torch.tensor(ref["losses"]), what=f"{what} rank {rank} losses"
        )
    merged = _merged(per_rank)
    assert set(merged) == {f"model.{k}" for k in ref["params"]}
    for name, expected in ref["params"].items():
        assert_rel_close(merged[f"model.{name}"], expected, what=f"{what}: {name}")


@pytest.mark.timeout(1600)
@pytest.mark.parametrize("schedule", sc.SCHEDULES_2RANKS)
def test_pp2_matches_single_process_with_accumulation_and_clipping(run2, schedule):
    per_rank = [out[schedule] for out in run2.scenario("parity_pp2")]
    _assert_parity(per_rank, _reference(dp=1), f"pp2 {schedule}")
    stages_per_rank = 1 if schedule in ("GPipe", "1F1B") else 2
    assert [len(out["stages"]) for out in per_rank] == [stages_per_rank, stages_per_rank]


@pytest.mark.timeout(1600)
def test_validation_runs_through_the_stages(run2):
    per_rank = [out["1F1B"] for out in run2.scenario("parity_pp2")]
    ref = _reference(dp=1)
    model = sc.build_model()
    model.load_state_dict(ref["params"])
    val = sc.lm_dataset(16, seed=1)
    with torch.no_grad():
        expected = [
            sc.lm_loss(model, collate(val, range(i * BATCH, (i + 1) * BATCH))).item() for i in range(2)
        ]
    for out in per_rank:
        assert_rel_close(torch.tensor(out["val"]), torch.tensor(expected), what="validation loss")


@pytest.mark.timeout(1600)
def test_plan_table_puts_embeddings_first_and_head_last(run2):
    table = run2.scenario("parity_pp2")[0]["1F1B"]["table"].splitlines()
    assert len(table) == 4  # title, header, two stages
    assert "wte,wpe" in table[2] and "model.h.0..1" in table[2]
    assert "ln_f,lm_head" in table[3] and "model.h.2..3" in table[3]


@pytest.mark.timeout(1600)
def test_module_without_pipeline_loss_gets_error_naming_the_hook(run2):
    for out in run2.scenario("missing_hook"):
        assert out["error"] is not None and "pipeline_loss(self, output, targets)" in out["error"]


@pytest.mark.timeout(1600)
@pytest.mark.parametrize("schedule", sc.SCHEDULES_DP)
def test_pp2_dp2_matches_single_process(four_ranks, schedule):
    per_rank = [out[schedule] for out in four_ranks.scenario("parity_pp2_dp2")]
    _assert_parity(per_rank, _reference(dp=2), f"pp2 x dp2 {schedule}")


def _merged_params(per_rank: list[dict], key: str) -> dict:
    return _merged(
        [{"params": out[key] if "params" not in out[key] else out[key]["params"]} for out in per_rank]
    )


def _assert_equal(actual: dict, expected: dict, what: str) -> None:
    assert set(actual) == set(expected), f"{what}: keys differ"
    for k, v in expected.items():
        assert torch.equal(actual[k], v), f"{what}: {k} differs"


@pytest.mark.timeout(1600)
@pytest.mark.parametrize("target", ["pp1", "fsdp_blocks", "ddp_tuned"])
def test_pp2_checkpoint_loads_bitwise_under(run2, target):
    per_rank = run2.scenario("checkpoints")
    saved = _merged_params(per_rank, "saved")
    _assert_equal(_merged_params(per_rank, target), saved, f"pp2 -> {target}")
    assert all(out[target]["trained"] == 0 for out in per_rank)  # restored at the epoch's end


@pytest.mark.timeout(1600)
@pytest.mark.parametrize("source", ["fsdp", "ddp"])
def test_checkpoint_of_other_strategy_loads_bitwise_under_pp2(run2, source):
    per_rank = run2.scenario("checkpoints")
    _assert_equal(
        _merged_params(per_rank, f"pp2_from_{source}"), _merged_params(per_rank, f"{source}_saved"), source
    )


@pytest.mark.timeout(1600)
def test_resumed_pp2_continues_the_uninterrupted_loss_curve_bitwise(run2):
    for out in run2.scenario("checkpoints"):
        first = len(out["first_epoch"])
        assert out["uninterrupted"][:first] == out["first_epoch"]
        assert out["resumed"] == out["uninterrupted"][first:] and len(out["resumed"]) == first


@pytest.mark.timeout(1600)
def test_consolidate_turns_the_pp2_checkpoint_into_the_whole_model(run2):
    per_rank = run2.scenario("checkpoints")
    _assert_equal(per_rank[0]["consolidated"], _merged_params(per_rank, "saved"), "consolidated")


@pytest.mark.timeout(1600)
def test_pp2_dp2_tp2_on_two_nodes_matches_single_process(eight_ranks):
    per_rank = [out["1F1B"] for out in eight_ranks.scenario("parity_pp2_dp2_tp2")]
    assert len(per_rank) == 8
    _assert_parity(per_rank, _reference(dp=2, name="llama"), "pp2 x dp2 x tp2")


@pytest.mark.timeout(1600)
@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_micro_batches_in_flight_per_stage_gpipe_all_1f1b_at_most_p_minus_stage(run2, schedule):
    p, m = 2, 4
    peaks = {}
    for out in run2.scenario("memory_and_p2p"):
        peaks.update(out[schedule]["peaks"])
    # GPipe runs every forward before any backward: all M micro-batches' activations are held at once.
    # 1F1B starts backward as soon as the last stage has one: stage s holds at most P - s.
    expected = {s: m if schedule == "GPipe" else min(m, p - s) for s in range(p)}
    assert peaks == expected


@pytest.mark.timeout(1600)
@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_point_to_point_bytes_per_step_are_activations_forward_and_their_gradients_back(run2, schedule):
    m, b, t, c = 4, BATCH, sc.SEQ, 32  # micro-batches, samples per step, sequence, width (GPTConfig.n_embd)
    first, last = (out[schedule]["sends"] for out in run2.scenario("memory_and_p2p"))
    activation = (b // m) * t * c * 4  # one micro-batch's fp32 hidden states at the stage boundary
    tokens = (b // m) * t * 8  # its int64 token ids, which later stages read for shapes
    assert sorted(first) == sorted([(1, activation, "torch.float32"), (1, tokens, "torch.int64")] * m)
    assert last == [(0, activation, "torch.float32")] * m  # gradients of the activations; none for tokens


@pytest.mark.timeout(1600)
def test_activation_checkpointing_per_block_keeps_parity(run2):
    per_rank = [out["checkpointing"] for out in run2.scenario("options")]
    assert [out["checkpointed"] for out in per_rank] == [[True, True], [True, True]]  # each rank's 2 blocks
    _assert_parity(per_rank, _reference(dp=1), "pp2 1F1B activation checkpointing")


@pytest.mark.timeout(1600)
def test_bf16_mixed_trains_close_to_fp32_with_clipping_across_stages(run2):
    per_rank = [out["bf16_mixed"] for out in run2.scenario("options")]
    ref = _reference(dp=1)
    assert all(out["plugin"] == "PipelinePrecision" for out in per_rank)
    for out in per_rank:
        # bf16 compute: about 3 significant digits
        assert_rel_close(
            torch.tensor(out["losses"]), torch.tensor(ref["losses"]), rel=2e-2, what="bf16 losses"
        )
    assert per_rank[0]["losses"] != ref["losses"]  # the policy really computed in bf16


def _last_batch_reference(samples: int) -> dict:
    """One process over ``samples`` samples in batches of 8 (the last one shorter), as the smaller_last_batch
    scenario trains them."""
    return reference_training(
        sc.build_model(),
        sc.lm_dataset(samples),
        sc.lm_loss,
        world_size=1,
        per_rank_batch=8,
        max_steps=8,
        lr=0.1,
        gradient_clip_val=0.5,
    )


@pytest.mark.timeout(1600)
def test_a_smaller_last_batch_gets_its_own_stage_shapes_and_stays_exact(run2):
    ref = _last_batch_reference(60)
    _assert_parity(run2.scenario("smaller_last_batch"), ref, "smaller last batch")


@pytest.mark.timeout(1600)
@pytest.mark.parametrize("schedule", list(sc.LAST_BATCH_FALLBACKS))
def test_a_last_batch_too_short_for_the_schedule_runs_under_one_of_the_same_layout_exactly(run2, schedule):
    samples, runner, count = sc.LAST_BATCH_FALLBACKS[schedule]
    ref = _last_batch_reference(samples)
    per_rank = [out["fallbacks"][schedule] for out in run2.scenario("smaller_last_batch")]
    _assert_parity(per_rank, ref, f"{schedule} short last batch")
    for out in per_rank:
        assert out["pipelines"] == sorted([(schedule, 4), (runner, count)])


def _eval_losses(model: torch.nn.Module, data, world_size: int, batch: int) -> list[float]:
    """The loss of each global evaluation batch: every rank's part of it in order (unshuffled
    DistributedSampler), its mean over all of its samples."""
    orders = rank_orders(len(data), world_size, 0, shuffle=False)
    with torch.no_grad():
        return [
            sc.lm_loss(model, collate(data, [i for order in orders for i in order[s : s + batch]])).item()
            for s in range(0, len(orders[0]), batch)
        ]


@pytest.mark.timeout(1600)
def test_pp2_dp2_runs_short_last_batches_exactly_in_training_validation_and_test(four_ranks):
    per_rank = four_ranks.scenario("partial_batches")
    sizes = sc.PARTIAL
    ref = reference_training(
        sc.build_model(),
        sc.lm_dataset(sizes["train"], seed=0),
        sc.lm_loss,
        world_size=2,
        per_rank_batch=BATCH,
        max_steps=3,
        lr=0.1,
        accumulate_grad_batches=2,
        gradient_clip_val=0.5,
    )
    # the sixth (last) batch of the epoch has 23 - 5 * 4 = 3 samples per rank: 3 micro-batches, not 4
    assert len(ref["losses"]) == 6
    _assert_parity(per_rank, ref, "pp2 x dp2 short last batch")
    model = sc.build_model()
    model.load_state_dict(ref["params"])
    val = _eval_losses(model, sc.lm_dataset(sizes["val"], seed=1), 2, BATCH)
    test = _eval_losses(model, sc.lm_dataset(sizes["test"], seed=2), 2, BATCH)
    for out in per_rank:
        assert_rel_close(torch.tensor(out["val"]), torch.tensor(val), what="validation losses")
        assert_rel_close(torch.tensor(out["test"]), torch.tensor(test), what="test losses")
        # full batches: 1F1B x 4; 3 samples: 1F1B x 3; 1 sample: 1F1B needs 2 micro-batches at pp2, GPipe x 1
        assert out["pipelines"] == [("1F1B", 3), ("1F1B", 4), ("GPipe", 1)]


@pytest.mark.timeout(1600)
def test_gpt_pp_recipe_runs_as_written_through_its_validation_and_its_checkpoint_consolidates(
    four_ranks, tmp_path
):
    """recipes/configs/gpt_pp.yaml as its header's torchrun command, shortened only by max_steps: 100 steps of
    pp2 x dp2 and the first validation over its 20 batches (or the whole set), a short last batch included."""
    import math
    import subprocess
    import sys

    from tests.scenarios.recipes import column, load_config

    config = load_config("gpt_pp")
    out = four_ranks.scenario("recipe_gpt_pp")[0]
    interval = config["trainer"]["val_check_interval"]
    assert out["strategy"] == "PipelineParallelStrategy" and out["global_step"] == interval
    assert out["dims"].startswith("pipeline_parallel=2 x data_parallel_replicate=1 x data_parallel_shard=2")
    losses = column(out["rows"], "train_loss")
    assert all(math.isfinite(v) for _, v in losses) and losses[-1][1] < losses[0][1] - 1.0, losses
    assert [step for step, _ in column(out["rows"], "val_loss")] == [interval - 1]
    # the validation's batches per rank: the set split over the data-parallel ranks, capped by the config
    per_rank = math.ceil(out["val_set"] / out["data_parallel"])
    batches = math.ceil(per_rank / out["val_batch"])
    assert out["num_val_batches"] == [min(batches, config["trainer"]["limit_val_batches"])]
    last = per_rank - (batches - 1) * out["val_batch"]
    if batches <= config["trainer"]["limit_val_batches"] and last % out["microbatches"]:
        # the validation reached its short last batch: fewer micro-batches, each of equal size
        assert any(count != out["microbatches"] and last % count == 0 for _, count in out["pipelines"])
    (checkpoint,) = out["checkpoints"]
    target = tmp_path / "gpt.pt"
    cmd = [
        sys.executable,
        "-m",
        "lit_parallel.commands.cli",
        "consolidate",
        checkpoint,
        str(target),
        "--strip-prefix",
        "model.",
    ]
    subprocess.run(cmd, check=True, capture_output=True)
    state = torch.load(target, weights_only=True)
    n_layer = config["model"]["n_layer"]
    assert {
        "wte.weight",
        f"h.{n_layer - 1}.attn.c_attn.weight",
        "h.1.mlp.c_proj.weight",
        "lm_head.weight",
    } <= set(state)


def test_gpt_pp_config_parses_and_its_header_shows_every_launch(monkeypatch):
    import shlex
    import sys
    from contextlib import redirect_stdout
    from io import StringIO

    import yaml

    from tests.harness import REPO_ROOT

    config = REPO_ROOT / "recipes/configs/gpt_pp.yaml"
    header = [line[1:].strip() for line in config.read_text().splitlines() if line.startswith("#")]
    commands = [shlex.split(h) for h in header if h.startswith(("python ", "torchrun ", "srun "))]
    assert any(c[0] == "torchrun" and "--nnodes=2" in c and "--trainer.num_nodes=2" in c for c in commands)
    assert any(c[0] == "srun" and "--trainer.num_nodes=2" in c for c in commands)
    assert all("recipes/gpt.py" in c and "recipes/configs/gpt_pp.yaml" in c for c in commands)
    assert single_machine_command("gpt_pp", 4)[0] == "recipes/gpt.py"
    sys.path.insert(0, str(REPO_ROOT / "recipes"))
    import gpt

    monkeypatch.setattr(sys, "argv", ["gpt.py"])
    out = StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit):
        gpt.main(["fit", "--config", str(config), "--print_config"])
    parsed = yaml.safe_load(out.getvalue())
    assert parsed["trainer"]["strategy"]["class_path"] == "lit_parallel.PipelineParallelStrategy"
    assert parsed["trainer"]["strategy"]["init_args"]["pipeline_parallel_size"] == 2
    assert parsed["trainer"]["devices"] == 4


@pytest.mark.timeout(1600)
def test_test_runs_through_the_stages_and_reports_the_mean_loss_on_every_rank(run2):
    ref = _reference(dp=1)
    model = sc.build_model()
    model.load_state_dict(ref["params"])
    data = sc.lm_dataset(16, seed=1)
    with torch.no_grad():
        per_batch = [
            sc.lm_loss(model, collate(data, range(i * BATCH, (i + 1) * BATCH))).item() for i in range(4)
        ]
    for out in run2.scenario("options"):
        assert_rel_close(
            torch.tensor(out["checkpointing"]["test_loss"]), torch.tensor(sum(per_batch) / 4), what="test"
        )


@pytest.mark.timeout(1600)
def test_meta_device_model_gets_the_weights_of_the_model_built_normally_on_its_stages(run2):
    per_rank = [out["reset"] for out in run2.scenario("meta_init")]
    # every rank drew rank 0's random numbers in the whole model's order: the weights of building it normally
    torch.set_rng_state(per_rank[0]["rng_state"])
    built = GPT(GPTConfig(n_layer=sc.N_LAYER, block_size=sc.SEQ))
    expected = {f"model.{k}": v for k, v in built.state_dict().items()}
    merged = _merged([{"params": out["params"]} for out in per_rank])
    assert set(merged) == set(expected)
    assert all(out["params"] and len(out["params"]) < len(expected) for out in per_rank)  # stages only
    for k, v in expected.items():
        torch.testing.assert_close(merged[k], v, rtol=0, atol=0, msg=k)


@pytest.mark.timeout(1600)
def test_meta_device_model_is_filled_from_init_from_read_on_rank_0_only(run2, pretrained):
    _, state = pretrained
    merged = _merged([{"params": out["init_from"]["params"]} for out in run2.scenario("meta_init")])
    assert set(merged) == set(state)
    for k, v in state.items():
        torch.testing.assert_close(merged[k], v, rtol=0, atol=0, msg=k)
