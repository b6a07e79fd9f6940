"""AutoStrategy ("auto_parallel"): picks by the advisor's rules at setup, then behaves exactly as the
chosen strategy (same losses as that strategy given explicitly, on real gloo ranks).

The model is tests/models.py's Llama in fp32. Its parameter counts follow from its layer sizes
(:data:`PARAMS`, :data:`BLOCK_PARAMS`), its bytes from ZeRO's accounting: in fp32 each parameter keeps
4 + 4 + 8 bytes (parameter, gradient, Adam's two moments), so DDP's model state per rank is 16 x
``PARAMS`` and ZeRO-3's over N ranks 16 x ``PARAMS`` / N; one block, gathered for its forward and
backward, needs ``BLOCK_PARAMS`` x (4 + 4) bytes for its parameters and gradients plus its activations.
Device memory is set from these to land on each rule.
"""

from __future__ import annotations

import signal
from datetime import timedelta

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry
from torch.utils.data import DataLoader, TensorDataset

import lit_parallel as lp
from lit_parallel.planner.rules import GB, PRECISIONS
from lit_parallel.strategies.arguments import CommonArguments
from lit_parallel.strategies.auto import strategy_choice
from tests.models import Llama, LlamaConfig
from tests.moe_models import lm_loss, mixtral

CONFIG = LlamaConfig()
_HEAD_DIM = CONFIG.dim // CONFIG.n_heads
# wq and wo (dim x heads), wk and wv (dim x kv heads, grouped-query attention), the SwiGLU feed-forward's
# three matrices (dim x hidden), the two RMSNorm weights
BLOCK_PARAMS = (
    2 * CONFIG.dim * CONFIG.n_heads * _HEAD_DIM
    + 2 * CONFIG.dim * CONFIG.n_kv_heads * _HEAD_DIM
    + 3 * CONFIG.dim * CONFIG.hidden_dim
    + 2 * CONFIG.dim
)
# the token embedding and the output head (vocab x dim each, not tied), the blocks, the final RMSNorm
PARAMS = 2 * CONFIG.vocab_size * CONFIG.dim + CONFIG.n_layers * BLOCK_PARAMS + CONFIG.dim
FP32 = PRECISIONS["32-true"]  # 4 + 4 + 8 bytes per parameter, computing in 4-byte floats
DDP_STATE_BYTES = PARAMS * FP32.total  # every rank keeps the whole model state
ZERO3_STATE_BYTES = DDP_STATE_BYTES / 2  # sharded over the 2 ranks of the launched scenarios
BLOCK_STATE_BYTES = BLOCK_PARAMS * (FP32.compute + FP32.compute)  # one block's parameters and gradients

PLENTY = None  # the machine's RAM / ranks: the whole state fits -> ddp_tuned (rule 1)
# halfway between ZeRO-3's model state per rank and DDP's: DDP's state alone does not fit, one block (a
# fraction of ZeRO-3's state) with its activations does -> fsdp_blocks (rule 7; no experts, so not rule 5)
BETWEEN = (ZERO3_STATE_BYTES + DDP_STATE_BYTES) / 2 / GB
# half of one block's parameters and gradients: the block does not fit even without activations -> tp_dp
# (rule 2)
TINY = BLOCK_STATE_BYTES / 2 / GB


class TokenLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = Llama()
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        tokens = batch[0]
        logits = self.model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1)
        )
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class SetupBuiltLM(TokenLM):
    """The same model, its layers built in ``setup()``: no parameters when the Trainer first sees it."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        self.losses = []

    def setup(self, stage: str) -> None:
        if not hasattr(self, "model"):
            torch.manual_seed(0)
            self.model = Llama()


# tests/moe_models.py's tiny Mixtral (vocabulary 64, hidden 16, 4 experts of inner size 32, 2 layers): per
# layer q, k, v, o (16 x 16 each), the router (4 x 16), the stacked experts [4, 64, 16] and [4, 16, 32], two
# norms; the embedding, the head and a final norm. Its experts are 74 % of its parameters.
MOE_EXPERTS = 2 * (4 * 64 * 16 + 4 * 16 * 32)
MOE_PARAMS = 2 * (4 * 16 * 16 + 4 * 16 + 2 * 16) + MOE_EXPERTS + 2 * 64 * 16 + 16
# halfway between its state sharded over 2 ranks and its whole state: fsdp_blocks, split by rule 5
MOE_BETWEEN = (FP32.total * MOE_PARAMS / 2 + FP32.total * MOE_PARAMS) / 2 / GB


class MoELM(L.LightningModule):
    """The tiny Mixtral on the same tokens, with its load-balancing loss; the decision's activation estimate
    is of a micro-batch of 2 tokens (kilobytes: the model state decides)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = mixtral()
        self.losses: list[float] = []
        self.example_input_array = torch.zeros(1, 2, dtype=torch.long)

    def training_step(self, batch, batch_idx):
        tokens = batch[0]
        loss = lm_loss(self.model, tokens[:, :-1], tokens[:, 1:])
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class NoParameters(L.LightningModule):
    def validation_step(self, batch, batch_idx):
        self.log("mean", batch[0].float().mean(), sync_dist=True)


def _fit(strategy, world_size: int, module=TokenLM) -> tuple[L.Trainer, TokenLM]:
    torch.manual_seed(0)
    model = module()
    data = TensorDataset(torch.randint(0, 64, (32, 17), generator=torch.Generator().manual_seed(1)))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=2))
    return trainer, model


def _auto_vs_explicit(ctx, memory_gb, explicit, module=TokenLM) -> dict:
    auto_trainer, auto_model = _fit(lp.AutoStrategy(memory_gb=memory_gb), ctx.world_size, module)
    _, explicit_model = _fit(explicit, ctx.world_size, module)
    advice = auto_trainer.strategy.advice
    return {
        "class": type(auto_trainer.strategy).__name__,
        "recommendation": advice.recommendation,
        "rule": advice.rule.number,
        "params": advice.params,
        "auto_losses": auto_model.losses,
        "explicit_losses": explicit_model.losses,
    }


# --- scenarios (run inside the ranks) ---------------------------------------------------------------------


def picks_ddp_tuned(ctx) -> dict:
    return _auto_vs_explicit(ctx, PLENTY, lp.TunedDDPStrategy())


def picks_fsdp_blocks(ctx) -> dict:
    return _auto_vs_explicit(ctx, BETWEEN, lp.TransformerFSDPStrategy())


def picks_tp_dp(ctx) -> dict:
    return _auto_vs_explicit(ctx, TINY, lp.TensorParallelStrategy())


def setup_built_picks_fsdp_blocks(ctx) -> dict:
    """Layers built in setup(): measured after it, on every rank, then trained like fsdp_blocks given."""
    return _auto_vs_explicit(ctx, BETWEEN, lp.TransformerFSDPStrategy(), module=SetupBuiltLM)


def picks_fsdp_blocks_with_expert_parallelism(ctx) -> dict:
    """An MoE model whose experts dominate: fsdp_blocks with expert_parallel_size=2, trained exactly like it."""
    auto_trainer, auto_model = _fit(lp.AutoStrategy(memory_gb=MOE_BETWEEN), ctx.world_size, MoELM)
    _, explicit_model = _fit(lp.TransformerFSDPStrategy(expert_parallel_size=2), ctx.world_size, MoELM)
    strategy = auto_trainer.strategy
    return {
        "class": type(strategy).__name__,
        "rule": strategy.advice.rule.number,
        "arguments": strategy.advice.strategy_arguments,
        "split": strategy.expert_plan.size if strategy.expert_plan is not None else None,
        "auto_losses": auto_model.losses,
        "explicit_losses": explicit_model.losses,
    }


def no_parameters_validates(ctx) -> dict:
    """A model with no parameters at all: nothing to shard, so ddp_tuned (no advice), and validate runs."""
    trainer = L.Trainer(
        accelerator="cpu",
        devices=ctx.world_size,
        strategy=lp.AutoStrategy(),
        logger=False,
        enable_progress_bar=False,
    )
    data = TensorDataset(torch.arange(16.0).reshape(8, 2))
    metrics = trainer.validate(NoParameters(), DataLoader(data, batch_size=2), verbose=False)
    return {"class": type(trainer.strategy).__name__, "advice": trainer.strategy.advice, "metrics": metrics}


# --- tests ------------------------------------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.timeout(360)
@pytest.mark.parametrize(
    ("scenario", "cls", "name", "rule"),
    [
        ("picks_ddp_tuned", "TunedDDPStrategy", "ddp_tuned", 1),
        ("picks_fsdp_blocks", "TransformerFSDPStrategy", "fsdp_blocks", 7),
        ("picks_tp_dp", "TensorParallelStrategy", "tp_dp", 2),
        ("setup_built_picks_fsdp_blocks", "TransformerFSDPStrategy", "fsdp_blocks", 7),
    ],
)
def test_auto_parallel_becomes_the_strategy_the_rules_choose_and_trains_exactly_like_it(
    lightning_launcher_two_ranks, scenario, cls, name, rule
):
    for rank, r in enumerate(lightning_launcher_two_ranks.scenario(scenario)):
        assert (r["class"], r["recommendation"], r["rule"]) == (cls, name, rule), f"rank {rank}"
        assert len(r["auto_losses"]) == 3
        assert r["params"] == PARAMS  # the whole model measured, also when setup() builds it
        torch.testing.assert_close(
            torch.tensor(r["auto_losses"]), torch.tensor(r["explicit_losses"]), rtol=1e-6, atol=0
        )


@pytest.mark.multiprocess
@pytest.mark.timeout(360)
def test_auto_parallel_splits_the_experts_of_an_moe_model_and_trains_exactly_like_fsdp_blocks_with_them(
    lightning_launcher_two_ranks,
):
    for rank, r in enumerate(
        lightning_launcher_two_ranks.scenario("picks_fsdp_blocks_with_expert_parallelism")
    ):
        assert (r["class"], r["rule"], r["arguments"], r["split"]) == (
            "TransformerFSDPStrategy",
            5,
            {"expert_parallel_size": 2},
            2,
        ), f"rank {rank}"
        assert len(r["auto_losses"]) == 3
        torch.testing.assert_close(
            torch.tensor(r["auto_losses"]), torch.tensor(r["explicit_losses"]), rtol=1e-6, atol=0
        )


@pytest.mark.multiprocess
@pytest.mark.timeout(360)
def test_a_model_without_parameters_gets_ddp_tuned_and_validates(lightning_launcher_two_ranks):
    # 8 samples of (2i, 2i + 1) over 2 ranks, 4 each (the same count): the mean of every value 0..15
    for rank, r in enumerate(lightning_launcher_two_ranks.scenario("no_parameters_validates")):
        assert (r["class"], r["advice"]) == ("TunedDDPStrategy", None), f"rank {rank}"
        assert r["metrics"] == [{"mean": pytest.approx(sum(range(16)) / 16)}]


def test_the_parameter_counts_follow_from_the_layer_sizes():
    model = Llama(CONFIG)
    assert sum(p.numel() for p in model.parameters()) == PARAMS
    assert all(sum(p.numel() for p in block.parameters()) == BLOCK_PARAMS for block in model.layers)


def test_decide_keeps_the_cuda_reserve_when_told_the_devices_are_gpus():
    # a dry run plans an 80 GB GPU from a CPU process: 80 x 0.9 - 1 = 71 GB usable, not the CPU's 72
    strategy = _connected(lp.AutoStrategy(memory_gb=80)).strategy
    auto = strategy.advice
    planned = lp.AutoStrategy(memory_gb=80)
    L.Trainer(accelerator="cpu", devices=2, strategy=planned, logger=False)
    gpu = planned.decide(TokenLM(), device_type="cuda")
    assert (auto.device_type, auto.usable_bytes) == ("cpu", 72e9)
    assert (gpu.device_type, gpu.usable_bytes) == ("cuda", 71e9)


def _connected(strategy: lp.AutoStrategy, num_nodes: int = 1, module=TokenLM) -> L.Trainer:
    """A Trainer of ``num_nodes`` x 2 devices with ``strategy`` and a ``module`` (a TokenLM) attached and
    connected, as ``fit`` does before launching ranks: the strategy has chosen, and ``trainer.strategy`` is
    the chosen one."""
    trainer = L.Trainer(accelerator="cpu", devices=2, num_nodes=num_nodes, strategy=strategy, logger=False)
    model = module()
    model.trainer = trainer  # as fit attaches it before connecting
    trainer.strategy._lightning_module = model
    trainer.strategy.connect(model)
    return trainer


@pytest.mark.parametrize(
    ("memory_gb", "name", "rule"), [(BETWEEN, "fsdp_blocks", 7), (TINY, "tp_dp", 2)], ids=["between", "tiny"]
)
def test_the_memory_settings_of_the_launched_scenarios_land_on_their_rules(memory_gb, name, rule):
    # the same decision the launched scenarios above make on each rank, made here in one process
    advice = _connected(lp.AutoStrategy(memory_gb=memory_gb)).strategy.advice
    assert (advice.recommendation, advice.rule.number, advice.params) == (name, rule, PARAMS)
    assert advice.row("DDP").state_bytes == DDP_STATE_BYTES
    assert advice.row("FSDP/ZeRO-3").state_bytes == ZERO3_STATE_BYTES


@pytest.mark.parametrize(
    ("memory_gb", "num_nodes", "name"),
    [
        (PLENTY, 1, "ddp_tuned"),
        (TINY, 1, "tp_dp"),
        (DDP_STATE_BYTES / GB, 2, "hsdp"),  # as in the hsdp test below
        (BETWEEN, 1, "fsdp_blocks"),
    ],
)
def test_the_chosen_strategy_gets_every_common_argument(memory_gb, num_nodes, name):
    common = CommonArguments(
        process_group_backend="gloo",
        timeout=timedelta(minutes=7),
        debug_level="detail",
        watchdog=False,
        preemption_signal="SIGUSR2",
        stall_timeout=42,
        auto_resume=True,
    )
    auto = lp.AutoStrategy(memory_gb=memory_gb, **common.as_kwargs())
    chosen = _connected(auto, num_nodes).strategy
    assert chosen is auto.chosen and chosen.advice.recommendation == name
    assert chosen.common_arguments == auto.common_arguments == common
    assert chosen.process_group_backend == "gloo" and chosen._timeout == timedelta(minutes=7)
    assert chosen.reliability is not auto.reliability  # its own, built from the same arguments
    assert chosen.reliability.options == common.reliability_options()
    assert chosen.reliability.options.preemption_signal == signal.SIGUSR2
    assert chosen.reliability.timeout == timedelta(minutes=7) and chosen.auto_resume is True


def test_auto_parallel_is_registered():
    assert "auto_parallel" in StrategyRegistry
    assert isinstance(StrategyRegistry.get("auto_parallel"), lp.AutoStrategy)


def test_several_nodes_whose_node_holds_the_sharded_state_get_hsdp_with_its_arguments():
    # 2 nodes x 2 devices, each with DDP's model state in memory: DDP needs that plus activations, which does
    # not fit; sharded over the 2 devices of a node it needs half of it plus activations, which does.
    memory_gb = DDP_STATE_BYTES / GB
    strategy = lp.AutoStrategy(
        memory_gb=memory_gb, strategy_kwargs={"hsdp": {"reshard_after_forward": False}}
    )
    trainer = L.Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy=strategy, logger=False)
    launcher, precision = trainer.strategy.launcher, trainer.strategy.precision_plugin
    model = TokenLM()
    model.trainer = trainer  # as fit attaches it before connecting
    trainer.strategy._lightning_module = model
    trainer.strategy.connect(model)
    s = trainer.strategy
    assert type(s) is lp.HybridShardStrategy and s.advice.rule.number == 3
    assert s.num_nodes == 2 and s.num_processes == 2 and s.world_size == 4
    assert s._reshard_after_forward is False  # strategy_kwargs["hsdp"] reached it
    assert s.launcher is launcher and s.precision_plugin is precision  # what Lightning set up is kept
    assert s.advice.row("DDP").state_bytes == DDP_STATE_BYTES
    assert s.advice.row("HSDP").state_bytes == DDP_STATE_BYTES / 2  # sharded over a node's 2 devices


@pytest.mark.parametrize(("precision", "chosen"), [("32-true", "tp_dp"), ("bf16-mixed", "fsdp_blocks")])
def test_the_decision_follows_the_trainer_precision(precision, chosen):
    # Each device holds exactly the largest block's parameters + gradients in fp32, BLOCK_PARAMS x (4 + 4)
    # bytes: with its activations that block does not fit; in bf16 it needs BLOCK_PARAMS x (2 + 2) bytes,
    # half as much, plus its smaller activations, which fits.
    strategy = lp.AutoStrategy(memory_gb=BLOCK_STATE_BYTES / GB)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, precision=precision, logger=False)
    model = TokenLM()
    model.trainer = trainer  # as fit attaches it before connecting
    trainer.strategy._lightning_module = model
    trainer.strategy.connect(model)
    advice = trainer.strategy.advice
    assert advice.precision == precision and advice.recommendation == chosen
    assert advice.bytes == PRECISIONS[precision]
    assert (
        advice.block_working_bytes - advice.activations.largest_block_bytes
        == BLOCK_PARAMS * 2 * advice.bytes.compute
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"memory_gb": 0}, "memory_gb=0 must be a positive number"),
        ({"memory_headroom": 1}, "memory_headroom=1 must be a fraction of device memory kept free"),
        ({"strategy_kwargs": {"ddp": {}}}, "strategy_kwargs has key 'ddp'"),
        ({"strategy_kwargs": {"fsdp_blocks": {"reshard": True}}}, "does not fit TransformerFSDPStrategy"),
        ({"strategy_kwargs": {"tp_dp": {"timeout": 5}}}, "pass it to AutoStrategy(timeout=...)"),
    ],
)
def test_bad_arguments_are_refused_when_the_strategy_is_built(kwargs, message):
    with pytest.raises(ValueError) as info:
        lp.AutoStrategy(**kwargs)
    assert message in str(info.value)


def test_a_layout_that_fills_the_device_is_not_chosen_the_headroom_is_kept():
    # DDP's whole need (model state + activations) at 95 % of the device: it fitted when "fits" meant the
    # whole device; with the default 10 % headroom (CPU devices: no CUDA reserve) the state is sharded
    need = _connected(lp.AutoStrategy(memory_gb=1e4)).strategy.advice.row("DDP").total_bytes
    memory_gb = need / 0.95 / GB
    full = _connected(lp.AutoStrategy(memory_gb=memory_gb, memory_headroom=0.0)).strategy.advice
    assert full.recommendation == "ddp_tuned"
    kept = _connected(lp.AutoStrategy(memory_gb=memory_gb)).strategy.advice
    assert kept.device_type == "cpu" and kept.usable_bytes == pytest.approx(memory_gb * GB * 0.9)
    assert kept.recommendation == "fsdp_blocks" and kept.row("FSDP/ZeRO-3").fits


def test_a_module_connected_before_a_trainer_holds_it_gets_the_default_until_fit_decides():
    # Lightning's data-connector tests connect a module that no Trainer holds yet, then set up its data
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.trainer.states import TrainerFn
    from torch.utils.data import DistributedSampler

    model = BoringModel()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=lp.AutoStrategy(), logger=False)
    trainer.strategy.connect(model)
    assert trainer.strategy.lightning_module is model and isinstance(trainer.strategy, lp.AutoStrategy)
    assert trainer.strategy.chosen is None  # nothing measured yet: fit decides
    trainer._data_connector.attach_data(model)
    trainer.state.fn = TrainerFn.VALIDATING
    trainer.validate_loop.setup_data()
    (loader,) = trainer.validate_loop._combined_loader.flattened
    assert isinstance(loader.sampler, DistributedSampler) and loader.sampler.num_replicas == 2


def test_an_moe_model_whose_experts_dominate_gets_fsdp_blocks_with_its_experts_split():
    # the same decision the launched scenario makes on each rank, made here in one process
    s = _connected(lp.AutoStrategy(memory_gb=MOE_BETWEEN), module=MoELM).strategy
    assert type(s) is lp.TransformerFSDPStrategy and s._ep_size == 2
    assert (s.advice.rule.number, s.advice.strategy_arguments) == (5, {"expert_parallel_size": 2})
    assert (s.advice.params, s.advice.model.expert_params) == (MOE_PARAMS, MOE_EXPERTS)
    # the split state per rank is ZeRO-3's: 16 bytes x P / 2
    assert s.advice.row("FSDP+EP").state_bytes == FP32.total * MOE_PARAMS / 2
    # arguments given for fsdp_blocks win over the advisor's
    given = lp.AutoStrategy(
        memory_gb=MOE_BETWEEN, strategy_kwargs={"fsdp_blocks": {"expert_parallel_size": 1}}
    )
    assert _connected(given, module=MoELM).strategy._ep_size == 1


def test_a_dense_model_gets_fsdp_blocks_without_expert_parallelism():
    s = _connected(lp.AutoStrategy(memory_gb=BETWEEN)).strategy
    assert type(s) is lp.TransformerFSDPStrategy and s._ep_size == 1
    rule, holds, evidence = s.advice.evaluations[4]
    assert (rule.number, holds, s.advice.rule.number) == (5, False, 7) and evidence.startswith(
        "no MoE layers"
    )


def test_when_pp_dp_falls_back_to_fsdp_blocks_an_moe_model_keeps_its_expert_split():
    from lit_parallel.planner.rules import advise

    # 2 nodes x 2 devices: the state sharded inside a node (16 x P / 2) does not fit, cut into 2 stages of a
    # node each (16 x P / 4) it does: pp_dp; a module without pipeline_loss gets fsdp_blocks instead
    usable = FP32.total * MOE_PARAMS * (1 / 2 + 1 / 4) / 2
    a = advise(
        model=mixtral(),
        devices=2,
        nodes=2,
        memory_gb=usable / 0.9 / GB,
        precision="32-true",
        device_type="cpu",
        batch_size=1,
        seq_len=2,
    )
    assert a.recommendation == "pp_dp" and a.expert_parallel_size == 2
    assert strategy_choice(a, object()) == ("fsdp_blocks", {"expert_parallel_size": 2})
