"""fsdp_blocks (and hsdp) on 2 real gloo ranks, against a single-process plain PyTorch reference.

Two launches: one torchrun launch runs every scenario of tests/scenarios/fsdp.py for 2 ranks; one
launch goes through Lightning's own launcher. Expected values come from the reference loop, ZeRO's
formulas and measured DDP, never from the code under test.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import launch
from tests.models import GPT, GPTConfig, tanh_mlp
from tests.reference import assert_rel_close, collate, reference_training
from tests.scenarios import fsdp as sc
from tests.scenarios import materialize as msc

pytestmark = pytest.mark.multiprocess
WORLD = 2
BATCH = 2  # per rank
GPT_PARAMS = sum(p.numel() for p in GPT().parameters())
GROUPS = GPTConfig().n_layer + 1  # one FSDP group per block, plus the root (embeddings, final norm, head)
# the root group's parameters: token and position embeddings, final LayerNorm (weight, bias), untied head
_CFG = GPTConfig()
ROOT_PARAMS = (_CFG.vocab_size + _CFG.block_size + 2 + _CFG.vocab_size) * _CFG.n_embd
MLP_PARAMS = sum(p.numel() for p in tanh_mlp().parameters())


def fsdp2_adamw_bytes(model: torch.nn.Module, shards: int, rank: int) -> dict[str, int]:
    """What ``rank`` of an FSDP2 shard group of ``shards`` holds after an fp32 AdamW step, from the parameter
    shapes: FSDP2 pads dimension 0 of every parameter to a multiple of ``shards`` and gives each rank one
    chunk of ceil(rows / shards) rows (the last ranks fewer, or none: the padding is not the rank's tensor).
    The rank's rows are 4 bytes per element as parameter and as gradient, 8 as AdamW's two moments, plus a
    4-byte step counter per parameter tensor."""
    local = tensors = 0
    for p in model.parameters():
        rows = p.shape[0]
        chunk = -(-rows // shards)
        held = min(chunk, max(0, rows - rank * chunk))
        local += held * (p.numel() // rows)
        tensors += 1
    return {"params": 4 * local, "grads": 4 * local, "optimizer": 8 * local + 4 * tensors,
            "total": 16 * local + 4 * tensors}  # fmt: skip


SCENARIOS = [
    "parity_zero3",
    "parity_zero2",
    "parity_llama_seq2seq",
    "comm_vs_ddp",
    "memory_adamw",
    "meta_init",
    "pretrained_load",
    "evaluation",
    "precision_modes",
    "checkpointing_compile_offload",
    "clip_mixed_dtensor",
    "prebuilt_dtensors",
    "parallelize_without_trainer",
    "no_blocks_mlp",
    "live_memory_categories",
]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    torch.manual_seed(123)
    state = {f"model.{k}": v for k, v in GPT().state_dict().items()}
    path = tmp_path_factory.mktemp("pretrained") / "weights.pt"
    torch.save(state, path)
    return path, state


@pytest.fixture(scope="module")
def run(tmp_path_factory, pretrained):
    """One torchrun launch of 2 ranks runs every scenario."""
    return launch(
        # the rank-0 copy's memory under fsdp_blocks, tp_dp and pp_dp (tests/scenarios/materialize.py) too
        [*(f"tests.scenarios.fsdp:{n}" for n in SCENARIOS), "tests.scenarios.materialize:sync_memory"],
        WORLD,
        tmp_path_factory.mktemp("fsdp"),
        args={"pretrained": str(pretrained[0])},
        timeout=420,
    )


def _reference(name="gpt", steps=5, accumulate=2, clip=0.5, world=WORLD):
    return reference_training(
        sc.build_model(name),
        sc.DATASETS[name](),
        sc.LOSSES[name],
        world_size=world,
        per_rank_batch=BATCH,
        max_steps=steps,
        lr=0.1,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
    )


def assert_parity(per_rank: list[dict], ref: dict, what: str) -> None:
    # every rank's micro-batch loss is the mean over its samples; the global batch loss is their mean
    losses = torch.stack([r["losses"] for r in per_rank]).mean(0)
    assert_rel_close(losses, torch.tensor(ref["losses"]), what=f"{what}: losses")
    gathered = per_rank[0]["params"]
    assert set(gathered) == {f"model.{k}" for k in ref["params"]}
    for name, expected in ref["params"].items():
        assert_rel_close(gathered[f"model.{name}"], expected, what=f"{what}: {name}")


@pytest.mark.timeout(480)
def test_fsdp_blocks_zero3_matches_single_process_with_accumulation_and_clipping(run):
    out = run.scenario("parity_zero3")
    assert_parity(out, _reference(), "fsdp_blocks reshard_after_forward=True")
    assert all(p == "(Shard(dim=0),)" for p in out[0]["placements"].values())
    assert len(out[0]["placements"]) == len(list(GPT().parameters()))


@pytest.mark.timeout(480)
def test_fsdp_blocks_zero2_matches_single_process_with_accumulation_and_clipping(run):
    assert_parity(run.scenario("parity_zero2"), _reference(), "fsdp_blocks reshard_after_forward=False")


@pytest.mark.timeout(480)
def test_gradient_accumulation_reduce_scatters_only_on_the_last_micro_batch(run):
    accumulate = 2
    # per micro-batch, ZeRO-3 gathers every group in forward and every block again in backward (the root is
    # not resharded after forward: backward needs it first); ZeRO-2 only in forward
    for label, gathers, gathered in (
        ("parity_zero3", 2 * GROUPS - 1, 2 * GPT_PARAMS - ROOT_PARAMS),
        ("parity_zero2", GROUPS, GPT_PARAMS),
    ):
        for rank, r in enumerate(run.scenario(label)):
            for i, step in enumerate(r["steps"]):
                what = f"{label} rank {rank} optimizer step {i}"
                assert step["all_gather"] == accumulate * gathers, what
                assert step["all_gather_bytes"] == accumulate * 4 * gathered, what
                # one reduce-scatter per group per optimizer step, not per micro-batch
                assert step["reduce_scatter"] == GROUPS, what
                assert step["reduce_scatter_bytes"] == 4 * GPT_PARAMS, what
                # gradient clipping: one scalar all-reduce of the sharded norm
                assert step["all_reduce"] == 1 and step["all_reduce_bytes"] < 4 * 64, what


@pytest.mark.timeout(480)
def test_communication_per_step_is_zero3_1_5x_less_the_root_and_zero2_1_0x_of_ddp(run):
    out = run.scenario("comm_vs_ddp")[0]

    def sent(step):  # ring collectives: all-gather / reduce-scatter (N-1)/N, all-reduce 2(N-1)/N
        ring = (WORLD - 1) / WORLD
        return ring * (step["all_gather_bytes"] + step["reduce_scatter_bytes"] + 2 * step["all_reduce_bytes"])

    ddp, zero3, zero2 = out["ddp"], out["zero3"], out["zero2"]
    assert ddp["all_reduce_bytes"] == 4 * GPT_PARAMS  # DDP all-reduces every fp32 gradient once
    assert ddp["all_gather"] == 0 and ddp["reduce_scatter"] == 0
    # ZeRO: DDP moves 2 units, ZeRO-3 3 (gather twice, reduce-scatter once) less the root's second gather
    # (it stays gathered from forward into backward), ZeRO-2 2 (gather once)
    assert sent(zero3) / sent(ddp) == pytest.approx(1.5 - ROOT_PARAMS / (2 * GPT_PARAMS), rel=1e-12)
    assert sent(zero2) / sent(ddp) == pytest.approx(1.0, rel=1e-12)
    assert zero3["all_gather"] == 2 * GROUPS - 1 and zero2["all_gather"] == GROUPS
    assert zero3["reduce_scatter"] == zero2["reduce_scatter"] == GROUPS


@pytest.mark.timeout(480)
def test_memory_per_rank_is_16_bytes_per_parameter_over_n(run):
    for rank, m in enumerate(run.scenario("memory_adamw")):
        # fp32 parameters 4P/N, gradients 4P/N, AdamW's two moments 8P/N (plus a scalar step per tensor)
        assert m["params"] == 4 * GPT_PARAMS // WORLD, rank
        assert m["grads"] == 4 * GPT_PARAMS // WORLD, rank
        assert m == fsdp2_adamw_bytes(GPT(), WORLD, rank), rank  # exactly, shape by shape


@pytest.mark.timeout(480)
def test_live_memory_counts_fsdp2_gathered_parameters_as_params_and_unsharded_gradients_as_grads(run):
    """The categories `advise --verify` measures mean what the planner predicts (lit_parallel/planner/memory/peak.py):
    FSDP2's gathered parameters are parameters (not the activations autograd saves, nor temporaries), its
    unsharded gradients before the reduce-scatter are gradients, its flat all-gather output a temporary."""
    f32, n_in, n_out, batch = 4, sc.LIVE_IN, sc.LIVE_OUT, sc.LIVE_BATCH
    weight, bias = n_out * n_in, n_out  # dim 0 (n_out rows) splits evenly over the ranks: no padding
    shards = (weight + bias) // WORLD * f32  # each rank's shard of the weight and of the bias
    gathered = (weight + bias) * f32  # the unsharded parameters, and also the flat all-gather output
    x, y = batch * n_in * f32, batch * n_out * f32  # the input (saved by the Linear), the block's output
    for rank, seen in enumerate(run.scenario("live_memory_categories")):
        assert seen["forward"] == {
            "params": shards + gathered,
            "grads": 0,
            "optimizer": 0,
            "activations": x,
            "temporaries": gathered + y,  # the flat all-gather output, the Linear's output
        }, rank
        # backward, both unsharded gradients computed: still gathered; Tanh saved its output (y bytes)
        unsharded = {k: seen["unsharded grads"][k] for k in ("params", "grads", "activations")}
        assert unsharded == {"params": shards + gathered, "grads": gathered, "activations": x + y}, rank
        # after backward: resharded (the gathered storages freed), one reduce-scatter output holds both
        # sharded gradients
        after = {k: seen["after backward"][k] for k in ("params", "grads", "activations")}
        assert after == {"params": shards, "grads": shards, "activations": x + y}, rank


@pytest.mark.timeout(480)
def test_meta_device_model_is_materialised_shard_by_shard_with_identical_weights(run):
    from lightning.fabric.utilities.init import _materialize_distributed_module

    out = run.scenario("meta_init")
    with torch.device("meta"):
        model = torch.nn.ModuleDict({"model": GPT(GPTConfig(n_layer=4))})
    full_bytes = 4 * sum(p.numel() for p in model.parameters())
    for rank, r in enumerate(out):
        assert 0 < r["largest_alloc"] < full_bytes, f"rank {rank}: an allocation as large as the model"
        assert r["peak"] < full_bytes, (
            f"rank {rank}: {r['peak']} live bytes during setup >= model {full_bytes}"
        )
        assert r["shard_numel"] * 4 * WORLD == full_bytes
    # every rank draws rank 0's random numbers: the same weights as materialising the whole model in one
    # process (Lightning's to_empty + reset_parameters) from rank 0's generator state
    torch.set_rng_state(out[0]["rng_state"])
    _materialize_distributed_module(model, torch.device("cpu"))
    expected = model.state_dict()
    for rank, r in enumerate(out):
        assert set(r["full"]) == set(expected)
        for k, v in expected.items():
            torch.testing.assert_close(r["full"][k], v, rtol=0, atol=0, msg=f"rank {rank} {k}")


@pytest.mark.timeout(480)
def test_pretrained_full_state_dict_loads_into_sharded_meta_model_from_rank_0(run, pretrained):
    _, state = pretrained
    out = run.scenario("pretrained_load")
    assert out[1]["full"] == {}  # rank 1 was given a path that does not exist: it never read it
    assert set(out[0]["full"]) == set(state)
    for k, v in state.items():
        torch.testing.assert_close(out[0]["full"][k], v, rtol=0, atol=0)


@pytest.mark.timeout(480)
def test_validate_test_and_predict_under_fsdp_blocks_and_hsdp(run):
    data = sc.lm_dataset(n=16, seed=1)
    model = sc.build_model("gpt").eval()
    out = run.scenario("evaluation")
    for label in ("fsdp", "fsdp_zero2", "hsdp"):
        for rank, r in enumerate(out):
            # evaluation samplers do not shuffle: rank r reads r, r + N, ...
            indices = list(range(rank, len(data), WORLD))
            batches = [indices[i : i + BATCH] for i in range(0, len(indices), BATCH)]
            with torch.no_grad():
                expected = [sc.lm_loss(model, collate(data, b)).item() for b in batches]
                expected_out = model(data.tensors[0][indices])
            assert_rel_close(
                torch.tensor(r[label]["val"]), torch.tensor(expected), what=f"{label} val {rank}"
            )
            assert_rel_close(
                torch.tensor(r[label]["test"]), torch.tensor(expected), what=f"{label} test {rank}"
            )
            assert r[label]["pred_idx"].tolist() == indices
            assert_rel_close(r[label]["pred_out"], expected_out, what=f"{label} predict {rank}")


@pytest.mark.timeout(480)
def test_llama_and_encoder_decoder_models_match_single_process(run):
    out = run.scenario("parity_llama_seq2seq")
    for name, blocks in (("llama", 2), ("seq2seq", 4)):
        per_rank = [r[name] for r in out]
        assert per_rank[0]["num_blocks"] == blocks
        assert_parity(per_rank, _reference(name, steps=2, accumulate=1, clip=None), name)


@pytest.mark.timeout(480)
def test_bf16_mixed_casts_once_through_fsdp_policy_and_bf16_true_stores_bf16(run):
    out = run.scenario("precision_modes")[0]
    mixed, true = out["bf16-mixed"], out["bf16-true"]
    # FSDP's policy casts: blocks compute in bf16, shards and gradient reduction stay fp32, no autocast
    assert mixed["compute"] == {
        "weight": "torch.bfloat16",
        "input": "torch.bfloat16",
        "output": "torch.bfloat16",
    }
    assert mixed["sharded_param"] == mixed["grad"] == "torch.float32"
    assert mixed["autocast"] is False and mixed["trainer_precision"] == "bf16-mixed"
    assert true["sharded_param"] == true["grad"] == "torch.bfloat16"
    assert true["compute"]["weight"] == "torch.bfloat16" and true["autocast"] is False
    for r in (mixed, true):
        assert all(torch.isfinite(torch.tensor(r["losses"])))


@pytest.mark.timeout(480)
def test_activation_checkpointing_and_compile_per_block_leave_training_unchanged(run):
    out = run.scenario("checkpointing_compile_offload")[0]
    assert_rel_close(out["fancy"], out["plain"], rel=1e-6, what="losses")
    for k, v in out["plain_params"].items():
        assert_rel_close(out["fancy_params"][k], v, rel=1e-6, what=k)
    # cpu_offload on a CPU-only run is a no-op, and says so
    assert out["warnings"] and "no effect on a CPU-only run" in out["warnings"][0]


@pytest.mark.timeout(480)
def test_clip_grad_norm_handles_sharded_and_plain_gradients_together(run):
    for r in run.scenario("clip_mixed_dtensor"):
        assert "mixed torch.Tensor and DTensor" in r["torch_error"]  # what torch's clip_grad_norm_ does
        expected_total = torch.linalg.vector_norm(torch.stack([g.norm() for g in r["grads"]]))
        assert_rel_close(r["total"], expected_total, what="total norm")
        coef = min(1.0, 1.0 / (expected_total.item() + 1e-6))
        for got, g in zip(r["clipped"], r["grads"]):
            assert_rel_close(got, g * coef, what="clipped gradient")


@pytest.mark.timeout(460)
def test_lightning_launcher_string_names_and_repeated_trainers(lightning_launcher_two_ranks):
    # the strategies' launch through Lightning's launcher (tests/strategies/conftest.py)
    res = lightning_launcher_two_ranks
    out = res.scenario("lightning_launcher")
    # the plan is logged on rank 0: classes, number of blocks, parameters per block, bytes per rank
    assert "fsdp_blocks: FSDP2 plan (auto block discovery): block classes GPTBlock" in res.output
    assert "2 x GPTBlock (12,704 params each)" in res.output and "per rank (fsdp" in res.output
    assert [r["first"]["rank"] for r in out] == [0, 1]
    assert all(r["first"]["world"] == WORLD for r in out)
    for r in out:
        assert len(r["first"]["losses"]) == 2 and len(r["first"]["val"]) == 2
        # same model, data and order under hsdp as under fsdp_blocks: the same first two losses
        assert r["second_strategy"] == "HybridShardStrategy"
        assert_rel_close(torch.tensor(r["second_losses"]), torch.tensor(r["first"]["losses"]), rel=1e-6)
        # hsdp on one node has a single replica: the same (data_parallel, tensor_parallel) mesh, reused
        assert r["same_mesh"] is True


@pytest.mark.multiprocess
@pytest.mark.timeout(480)
def test_model_sharded_in_configure_model_is_refused_with_the_fix(run):
    out = run.scenario("prebuilt_dtensors")[0]
    assert out["TransformerFSDPStrategy"].startswith(
        "TransformerFSDPStrategy shards the model itself, but configure_model already produced DTensor"
    )
    assert (
        "Remove that code from configure_model, or use Lightning's ModelParallelStrategy"
        in (out["TransformerFSDPStrategy"])
    )
    assert out["TensorParallelStrategy"].startswith("TensorParallelStrategy parallelizes the model itself")
    assert "configure_model (pass your own plan=... instead), or use" in out["TensorParallelStrategy"]


@pytest.mark.timeout(480)
def test_parallelize_without_a_trainer_matches_single_process_and_syncs_rank0_weights(run):
    out = run.scenario("parallelize_without_trainer")
    model = sc.build_model("gpt", seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y, _ = sc.lm_dataset(n=12).tensors
    ref_losses = []
    for step in range(3):
        loss = torch.nn.functional.cross_entropy(
            model(x[4 * step : 4 * step + 4]).flatten(0, 1), y[4 * step : 4 * step + 4].flatten()
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    # each rank's loss is the mean over its half of the batch; the global loss is their mean
    losses = torch.stack([r["losses"] for r in out]).mean(0)
    assert_rel_close(losses, torch.tensor(ref_losses, dtype=torch.float64), what="parallelize: losses")
    for name, expected in model.state_dict().items():
        assert_rel_close(out[0]["params"][name], expected, what=f"parallelize: {name}")
    for r in out:
        assert r["blocks"] == GPTConfig().n_layer and r["fsdp_groups"] == GROUPS
        assert r["checkpointed"] == GPTConfig().n_layer


@pytest.mark.timeout(480)
def test_model_without_repeated_blocks_is_sharded_in_size_groups_exactly_and_holds_16_bytes_per_param_over_n(
    run,
):
    out = run.scenario("no_blocks_mlp")
    # nn.Sequential(Linear 16->64, Tanh, Linear 64->64, Tanh, Linear 64->128, Tanh, Linear 128->4)
    sizes = [16 * 64 + 64, 64 * 64 + 64, 64 * 128 + 128, 128 * 4 + 4]
    assert MLP_PARAMS == sum(sizes)
    threshold = -(-MLP_PARAMS // 8)  # the documented default: an eighth of the model, rounded up
    # post-order: the 1st layer is below the threshold, the 2nd and 3rd close a group each, the 4th is
    # left over: the root group holds the 1st and the 4th
    expected_groups = ["model.2", "model.4"]
    assert sizes[0] < threshold <= min(sizes[1], sizes[2]) and sizes[3] < threshold
    assert_parity(out, _reference("mlp"), "fsdp_blocks on a plain MLP")
    for r in out:
        assert r["how"] == "size" and r["groups"] == expected_groups
        assert r["fsdp_modules"] == ["", *expected_groups]  # the groups, then the root
        avg = (sizes[1] + sizes[2]) // 2
        assert (
            f"no repeated blocks: 2 size-based groups of ~{avg:,} params (threshold {threshold:,})"
            in (r["summary"])
        )
        # every parameter is sharded; every group is gathered in forward and again in backward, the root (the
        # 1st and 4th layers) in forward only; two micro-batches
        assert len(r["placements"]) == 2 * len(sizes)
        assert all(p == "(Shard(dim=0),)" for p in r["placements"].values())
        gathered = 2 * MLP_PARAMS - sizes[0] - sizes[3]
        for step in r["steps"]:
            assert step["all_gather"] == 2 * (2 * 3 - 1) and step["all_gather_bytes"] == 2 * 4 * gathered
            assert step["reduce_scatter"] == 3 and step["reduce_scatter_bytes"] == 4 * MLP_PARAMS
    for rank, r in enumerate(out):
        m = r["memory"]
        assert m["params"] == 4 * MLP_PARAMS // WORLD, rank
        assert m["grads"] == 4 * MLP_PARAMS // WORLD, rank
        assert m == fsdp2_adamw_bytes(tanh_mlp(), WORLD, rank), rank  # exactly, shape by shape


def _block_half_bytes(block: torch.nn.Module) -> int:
    """What a rank newly holds of a block split in two: FSDP2's dim-0 chunk of every tensor (ceil(rows / 2)
    rows), at least the tensor-parallel half (a replicated bias is smaller than a row chunk of its weight)."""
    return sum(4 * -(-p.shape[0] // 2) * (p.numel() // p.shape[0]) for p in block.parameters())


@pytest.mark.timeout(480)
def test_rank0_copy_of_a_model_not_on_meta_holds_at_most_one_chunk_beyond_the_block_being_split(run):
    model = msc.build(seed=0)
    blocks = list(model.h)
    block_bytes = [4 * sum(p.numel() for p in b.parameters()) for b in blocks]
    model_bytes = 4 * sum(p.numel() for p in model.parameters())
    assert msc.CHUNK * 4 <= min(block_bytes)  # the cap is well below a block: a whole-block copy shows
    bound = msc.CHUNK + max(_block_half_bytes(b) for b in blocks)
    assert bound < max(block_bytes) < model_bytes / 4
    expected = model.state_dict()
    for rank, out in enumerate(run.scenario("sync_memory")):
        for layout in ("fsdp_blocks", "tp_dp", "pp_dp"):
            extra = out[layout]["extra"]
            assert 0 < extra <= bound, f"rank {rank} {layout}: {extra} extra bytes > {bound}"
        # rank 0's weights won (every rank built its own from its seed)
        for layout in ("fsdp_blocks", "tp_dp"):
            if rank == 0:
                assert set(out[layout]["params"]) == set(expected)
            for k, v in out[layout]["params"].items():
                torch.testing.assert_close(v, expected[k], rtol=0, atol=0, msg=f"{layout} {k}")
        held = out["pp_dp"]["params"]
        assert held and set(held) <= set(expected)
        for k, v in held.items():
            torch.testing.assert_close(v, expected[k], rtol=0, atol=0, msg=f"pp_dp rank {rank} {k}")
