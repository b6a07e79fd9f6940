"""Tensor-parallel plans without any process group: inference, checks, errors, strategy configuration."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import lit_parallel as lp
from lit_parallel.parallel import TPPlanError, check_tp_plan, infer_tp_plan
from lit_parallel.parallel.tensor_parallel.plan import fused_permutation as _fused_permutation
from tests.models import GPT, Llama, LlamaConfig
from tests.tp_models import TPGPT, FlatLlama

COL, ROW, FUSED, REP = "colwise", "rowwise", "colwise (fused)", "replicated"


def styles(plan) -> dict[str, str]:
    return {layer.path: layer.style for layer in plan.layers}


def _fail(model):
    raise RuntimeError("no input for this model")


# --- what the plan splits -------------------------------------------------------------------------------


def test_llama_block_attention_inputs_column_outputs_row_with_head_counts_halved():
    plan = infer_tp_plan(Llama(), 2)
    assert plan.how == "traced"
    expected = {}
    for i in range(2):
        a, f = f"layers.{i}.attention", f"layers.{i}.feed_forward"
        expected |= {f"{a}.wq": COL, f"{a}.wk": COL, f"{a}.wv": COL, f"{a}.wo": ROW}
        expected |= {f"{f}.w1": COL, f"{f}.w3": COL, f"{f}.w2": ROW}
    assert styles(plan) == expected
    assert sorted(plan.head_attributes) == sorted(
        [
            (f"layers.{i}.attention", a, n, n // 2)
            for i in range(2)
            for a, n in (("n_heads", 4), ("n_kv_heads", 2))
        ]
    )
    assert plan.replicated == []


def test_fused_qkv_is_split_chunk_by_chunk():
    plan = infer_tp_plan(TPGPT(), 2)
    s = styles(plan)
    for i in range(2):
        assert s[f"h.{i}.attn.c_attn"] == FUSED and s[f"h.{i}.attn.c_proj"] == ROW
        assert s[f"h.{i}.mlp.c_fc"] == COL and s[f"h.{i}.mlp.c_proj"] == ROW
        assert plan.fused[f"h.{i}.attn.c_attn"] == [32, 32, 32]
    assert ("h.0.attn", "n_head", 4, 2) in plan.head_attributes
    # the same fused layer seen through view(b, t, 3, heads, head_dim) instead of chunk(3)
    from tests.scenarios.tp import bench_model

    plan = infer_tp_plan(bench_model(), 2)
    assert styles(plan)["blocks.0.attn.qkv"] == FUSED and plan.fused["blocks.0.attn.qkv"] == [32, 32, 32]
    assert ("blocks.0.attn", "heads", 4, 2) in plan.head_attributes
    # rank r's contiguous half holds rows r*2..r*2+1 of each chunk of 4 (worked out by hand)
    assert _fused_permutation([4, 4, 4], 2).tolist() == [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]


@pytest.mark.parametrize("traced", [True, False], ids=["traced", "structural"])
def test_linears_named_l1_to_l7_get_the_same_plan_as_conventional_names(traced):
    kwargs = {} if traced else {"example_inputs": _fail}
    conventional = infer_tp_plan(Llama(), 2, **kwargs)
    anonymous = infer_tp_plan(FlatLlama(), 2, **kwargs)
    assert conventional.how == anonymous.how == ("traced" if traced else "structural")
    rename = {"attention.wq": "l1", "attention.wk": "l2", "attention.wv": "l3", "attention.wo": "l4"}
    rename |= {"feed_forward.w1": "l5", "feed_forward.w3": "l6", "feed_forward.w2": "l7"}
    translated = {}
    for path, style in styles(conventional).items():
        prefix, _, rest = path.partition(".")
        index, _, tail = rest.partition(".")
        translated[f"{prefix}.{index}.{rename[tail]}"] = style
    assert styles(anonymous) == translated


def test_meta_device_model_is_planned_without_computing():
    with torch.device("meta"):
        model = Llama()
    assert styles(infer_tp_plan(model, 2)) == styles(infer_tp_plan(Llama(), 2))


def test_sequence_and_loss_parallel_add_norms_and_the_head():
    plan = infer_tp_plan(Llama(), 2, sequence_parallel=True, loss_parallel=True)
    s = styles(plan)
    assert s["layers.0.attention_norm"] == s["layers.1.ffn_norm"] == "sequence parallel"
    assert s["output"] == "colwise (loss parallel)"
    assert "norm" not in s  # the final norm runs after the stream is gathered


class _GatedBlock(nn.Module):
    """An MLP block plus a scalar gate read from the stream: the gate cannot be split."""

    def __init__(self, d=16):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.gate = nn.Linear(d, 1)

    def forward(self, x):
        h = self.norm(x)
        return x + torch.sigmoid(self.gate(h)) * self.down(F.gelu(self.up(h)))


class _PostNormBlock(_GatedBlock):
    def forward(self, x):
        return self.norm(x + self.down(F.gelu(self.up(x))))


class _Stack(nn.Module):
    def __init__(self, block_cls, n=2, d=16):
        super().__init__()
        self.emb = nn.Embedding(32, d)
        self.blocks = nn.ModuleList(block_cls(d) for _ in range(n))
        self.head = nn.Linear(d, 32)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_layers_that_cannot_be_split_stay_replicated_with_the_reason():
    plan = infer_tp_plan(_Stack(_GatedBlock), 2)
    s = styles(plan)
    assert s["blocks.0.up"] == COL and s["blocks.0.down"] == ROW
    gate = next(layer for layer in plan.layers if layer.path == "blocks.0.gate")
    assert gate.style == REP and "does not feed a single row-parallel layer" in gate.reason
    assert "blocks.0.gate: replicated" in plan.describe()


def test_plan_description_is_one_line_per_distinct_block_plan_with_per_layer_detail_on_request():
    plan = infer_tp_plan(Llama(LlamaConfig(n_layers=12)), 2, loss_parallel=True)
    lines = plan.describe().splitlines()
    assert len(lines) == 3  # the header, all 12 blocks alike, the output head
    assert lines[1].startswith(
        "  12 blocks layers.0, layers.1, ... layers.11 (LlamaBlock), each as layers.0:"
    )
    assert "layers.0.attention.wo: rowwise" in lines[1] and "layers.11" not in lines[1].split(":", 1)[1]
    assert lines[2].startswith("  output: colwise (loss parallel)")
    detail = plan.describe(detail=True)
    assert "  layers.11.attention.wq: colwise [Linear 32 -> 32, 4 heads x 8]" in detail.splitlines()
    assert "  layers.11.attention.n_kv_heads: 2 -> 1 per rank" in detail.splitlines()


def test_a_family_provider_in_front_of_the_generic_one_plans_the_blocks_it_recognises(monkeypatch):
    from lit_parallel.parallel.tensor_parallel import families as tp_families
    from lit_parallel.parallel.tensor_parallel.block_plan import BlockSplit

    def keep_whole(root, name, block, flow, plan, checks):
        return BlockSplit()

    family = tp_families.PlanProvider(
        "gated", lambda block: isinstance(block, _GatedBlock), traced=keep_whole
    )
    monkeypatch.setattr(tp_families, "PLAN_PROVIDERS", [family, tp_families.GENERIC])
    assert styles(infer_tp_plan(_Stack(_GatedBlock), 2)) == {}
    assert styles(infer_tp_plan(Llama(), 2))["layers.0.attention.wo"] == ROW


# --- refusals -------------------------------------------------------------------------------------------


def test_heads_not_divisible_by_tensor_parallel_size_name_module_and_numbers():
    with pytest.raises(TPPlanError) as err:
        infer_tp_plan(Llama(), 4)  # 2 KV heads
    text = str(err.value)
    assert "layers.0.attention.wk: heads = 2 is not divisible by 4" in text
    assert "Choose tensor_parallel_size from 1 or 2" in text
    with pytest.raises(TPPlanError, match=r"wq: heads = 4 is not divisible by 3"):
        infer_tp_plan(Llama(LlamaConfig(n_kv_heads=4)), 3)


def test_model_that_splits_by_the_full_width_is_refused_with_the_fix():
    # tests.models.GPT: q, k, v = c_attn(x).split(c) with c = x.shape[-1], impossible per rank
    with pytest.raises(TPPlanError) as err:
        infer_tp_plan(GPT(), 2)
    text = str(err.value)
    assert "h.0 (GPTBlock) does not run when each rank holds 1/2 of its heads" in text
    assert ".chunk(3, dim=-1)" in text


def test_sequence_parallel_refuses_post_norm_blocks():
    with pytest.raises(TPPlanError, match=r"blocks.0.up reads the residual stream without a norm"):
        infer_tp_plan(_Stack(_PostNormBlock), 2, sequence_parallel=True)
    infer_tp_plan(_Stack(_PostNormBlock), 2)  # fine without sequence parallelism


def test_sequence_parallel_needs_the_data_flow():
    with pytest.raises(TPPlanError, match="sequence_parallel=True needs the data flow"):
        infer_tp_plan(Llama(), 2, sequence_parallel=True, example_inputs=_fail)


def test_plan_naming_a_missing_module_suggests_the_close_name():
    from torch.distributed.tensor.parallel import ColwiseParallel

    with pytest.raises(TPPlanError) as err:
        check_tp_plan(Llama(), {"layers.0.attention.wqq": ColwiseParallel()})
    assert (
        "'layers.0.attention.wqq', which is not a module of Llama; did you mean 'layers.0.attention.wq'"
        in str(err.value)
    )
    check_tp_plan(Llama(), {"layers.*.attention.wq": ColwiseParallel()})  # wildcards are fine


# --- the strategy, before any process exists ------------------------------------------------------------


def _trainer(devices, strategy, num_nodes=1, **kwargs):
    return L.Trainer(
        accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=strategy, logger=False, **kwargs
    )


def test_registered_as_tp_dp_with_auto_sizes_devices_per_node_by_nodes():
    t = _trainer(4, "tp_dp", num_nodes=2)
    assert isinstance(t.strategy, lp.TensorParallelStrategy)
    dims = t.strategy.parallel_dims
    assert (dims.data_parallel, dims.tensor_parallel) == (2, 4)
    dims = _trainer(4, lp.TensorParallelStrategy(tensor_parallel_size=2)).strategy.parallel_dims
    assert (dims.data_parallel, dims.tensor_parallel) == (2, 2)
    dims = _trainer(4, lp.TensorParallelStrategy(data_parallel_size=4, data_parallel_replicate_size=2), 2)
    dims = dims.strategy.parallel_dims
    assert dims.shape == (2, 2, 2)


def test_sizes_that_do_not_multiply_to_the_world_size_show_the_arithmetic():
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size\(3\) \* data_parallel_replicate_size\(1\) = 3 does"
    ):
        _trainer(4, lp.TensorParallelStrategy(tensor_parallel_size=3))
    with pytest.raises(
        ValueError, match=r"data_parallel_shard\(2\) \* tensor_parallel\(4\) = 8 != world size \(4\)"
    ):
        _trainer(4, lp.TensorParallelStrategy(data_parallel_size=2, tensor_parallel_size=4))
    with pytest.raises(
        ValueError, match=r"data_parallel_replicate_size=3 does not divide data_parallel_size=4"
    ):
        _trainer(4, lp.TensorParallelStrategy(data_parallel_size=4, data_parallel_replicate_size=3), 2)
    with pytest.raises(ValueError, match="plan='nope' must be 'auto'"):
        lp.TensorParallelStrategy(plan="nope")
    with pytest.raises(ValueError, match="sequence_parallel=True applies to plan='auto'"):
        lp.TensorParallelStrategy(plan={}, sequence_parallel=True)


class _Lit(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = Llama()

    def training_step(self, batch, batch_idx):
        return self.model(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_bad_plan_fails_in_fit_before_any_process_group():
    from torch.distributed.tensor.parallel import ColwiseParallel

    t = _trainer(1, lp.TensorParallelStrategy(plan={"model.layers.0.attn.wq": ColwiseParallel()}))
    with pytest.raises(TPPlanError, match="did you mean 'model.layers.0.attention.wq'"):
        t.fit(_Lit(), [torch.zeros(1, 8, dtype=torch.long)])
    assert not dist.is_initialized()


# --- Hugging Face families (tiny configs built in code; the split's exactness: tests/parallel/tensor_parallel/test_families.py) --


def _hf_expected(name: str) -> dict[str, str]:
    """Every attention and MLP projection of the family's two blocks, with the style it must get."""
    per_block = {
        "gpt2": (
            "transformer.h.{i}",
            {"attn.c_attn": FUSED, "attn.c_proj": ROW, "mlp.c_fc": COL, "mlp.c_proj": ROW},
        ),
        "opt": (
            "model.decoder.layers.{i}",
            {"self_attn.q_proj": COL, "self_attn.k_proj": COL, "self_attn.v_proj": COL}
            | {"self_attn.out_proj": ROW, "fc1": COL, "fc2": ROW},
        ),
        "bert": (
            "bert.encoder.layer.{i}",
            {"attention.self.query": COL, "attention.self.key": COL, "attention.self.value": COL}
            | {"attention.output.dense": ROW, "intermediate.dense": COL, "output.dense": ROW},
        ),
        "vit": (
            "vit.layers.{i}",
            {"attention.q_proj": COL, "attention.k_proj": COL, "attention.v_proj": COL}
            | {"attention.o_proj": ROW, "mlp.fc1": COL, "mlp.fc2": ROW},
        ),
    }
    llama = (
        "model.layers.{i}",
        {"self_attn.q_proj": COL, "self_attn.k_proj": COL, "self_attn.v_proj": COL, "self_attn.o_proj": ROW}
        | {"mlp.gate_proj": COL, "mlp.up_proj": COL, "mlp.down_proj": ROW},
    )
    per_block |= {"llama": llama, "mistral": llama, "qwen2": llama}
    if name == "t5":
        attn = {"q": COL, "k": COL, "v": COL, "o": ROW}
        out = {}
        for stack in ("encoder", "decoder"):
            for i in range(2):
                b = f"{stack}.block.{i}.layer"
                out |= {f"{b}.0.SelfAttention.{k}": s for k, s in attn.items()}
                if stack == "decoder":
                    out |= {f"{b}.1.EncDecAttention.{k}": s for k, s in attn.items()}
                ff = f"{b}.{2 if stack == 'decoder' else 1}.DenseReluDense"
                out |= {f"{ff}.wi": COL, f"{ff}.wo": ROW}
            out[f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias"] = COL
        return out
    prefix, layers = per_block[name]
    return {f"{prefix.format(i=i)}.{k}": s for i in range(2) for k, s in layers.items()}


@pytest.mark.parametrize("name", ["gpt2", "llama", "mistral", "qwen2", "opt", "bert", "vit", "t5"])
def test_hf_family_plan_splits_every_attention_and_mlp_projection(name):
    from tests.scenarios.tp_families import build

    plan = infer_tp_plan(build(name), 2)
    assert styles(plan) == _hf_expected(name)
    assert plan.replicated == []


def test_gpt2_conv1d_is_split_on_its_transposed_weight_with_whole_heads_per_rank():
    from tests.scenarios.tp_families import build

    plan = infer_tp_plan(build("gpt2"), 2)
    assert plan.fused == {f"transformer.h.{i}.attn.c_attn": [32, 32, 32] for i in range(2)}
    # Conv1D stores its weight (in, out): the output features are on dimension 1
    assert plan.out_dims == {
        f"transformer.h.{i}.{p}": 1
        for i in range(2)
        for p in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    }
    assert sorted(plan.head_attributes) == sorted(
        (f"transformer.h.{i}.attn", a, n, n // 2)
        for i in range(2)
        for a, n in (("num_heads", 4), ("split_size", 32))
    )
    layer = next(x for x in plan.layers if x.path == "transformer.h.0.attn.c_attn")
    assert "Conv1D 32 -> 96, 3 chunks of 32/32/32, 4/4/4 heads x 8" in layer.detail


def test_grouped_kv_heads_refuse_a_split_that_would_cut_a_head():
    # Llama with 4 query heads and 2 key/value heads of 8 features: tp=4 would give each rank half a
    # key/value head (k_proj has 16 outputs, divisible by 4, but only 2 heads)
    from tests.scenarios.tp_families import build

    with pytest.raises(TPPlanError) as err:
        infer_tp_plan(build("llama"), 4)
    msg = str(err.value)
    assert "model.layers.0.self_attn.k_proj: heads of 8 features = 2 is not divisible by 4" in msg
    assert "tensor_parallel_size from 1 or 2" in msg
    assert "q_proj" not in msg


def test_t5_relative_position_bias_is_split_with_the_heads():
    from tests.scenarios.tp_families import build

    plan = infer_tp_plan(build("t5"), 2)
    bias = [x for x in plan.layers if x.path.endswith("relative_attention_bias")]
    assert [(x.path, x.style) for x in bias] == [
        ("encoder.block.0.layer.0.SelfAttention.relative_attention_bias", COL),
        ("decoder.block.0.layer.0.SelfAttention.relative_attention_bias", COL),
    ]
    assert "Embedding 32 x 4 (one value per head)" in bias[0].detail
    assert ("decoder.block.1.layer.1.EncDecAttention", "n_heads", 4, 2) in plan.head_attributes


def test_t5_traced_with_example_inputs_splits_the_same_and_runs_with_local_heads():
    # with a trace, the later blocks' attention reads the bias handed on from block 0: still split, and
    # one rank's forward (local heads and local bias) is simulated on the meta device
    from tests.scenarios.tp_families import build

    tokens = torch.randint(0, 64, (2, 5))
    plan = infer_tp_plan(build("t5"), 2, example_inputs={"input_ids": tokens, "decoder_input_ids": tokens})
    assert plan.how == "traced"
    assert styles(plan) == _hf_expected("t5")
