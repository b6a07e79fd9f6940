"""Bad input to fsdp_blocks / hsdp fails in this process with a message naming the value and the fix,
before any process is launched or any process group exists."""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

import lit_parallel as lp
from lit_parallel.parallel import NoBlocksFoundError
from tests.scenarios import fsdp as sc


@pytest.fixture(autouse=True)
def _restore_environment():
    # Lightning's launcher writes MASTER_PORT, LOCAL_RANK, ... into os.environ; keep other tests clean.
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
    assert not dist.is_initialized()


def _trainer(strategy, devices=4, **kwargs):
    return L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False, **kwargs)


def test_shard_size_not_dividing_the_world_size_fails_when_the_trainer_is_built():
    with pytest.raises(ValueError, match="shard_size=3 does not divide world size 4; choose 1, 2 or 4"):
        _trainer(lp.HybridShardStrategy(shard_size=3))
    with pytest.raises(
        ValueError, match=r"shard_size=0 must be 'auto' \(devices per node\) or a positive integer"
    ):
        lp.HybridShardStrategy(shard_size=0)


def test_block_types_naming_no_module_fails_before_any_process_group():
    trainer = _trainer(lp.TransformerFSDPStrategy(block_types={nn.GRU}), devices=1, max_steps=1)
    with pytest.raises(NoBlocksFoundError, match=r"block_types=\{GRU\} names no module in LitModel"):
        trainer.fit(sc.LitModel(), sc.loader(sc.lm_dataset()))
    assert not dist.is_initialized()


class _Plain(sc.LitModel):
    def __init__(self):
        super().__init__(build=False)
        self.model = nn.Sequential(nn.Embedding(64, 8), nn.Linear(8, 64))


def test_model_without_blocks_is_accepted_and_planned_as_size_based_groups():
    # a model without repeated blocks: fsdp_blocks shards size-based groups
    trainer = _trainer("fsdp_blocks", devices=1, max_steps=1)
    trainer.strategy.connect(_Plain())  # the block check the strategy runs before launching
    assert not dist.is_initialized()
    plan = lp.parallel.plan_fsdp(_Plain(), world_size=4)
    assert plan.blocks.how == "size" and [n for n, _ in plan.blocks.blocks] == ["model.0", "model.1"]
    assert "no repeated blocks: 2 size-based groups of ~544 params (threshold 136)" in plan.summary()


def test_predicate_matching_nothing_fails_before_any_process_group():
    strategy = lp.TransformerFSDPStrategy(block_types=lambda m: isinstance(m, nn.GRU))
    trainer = _trainer(strategy, devices=1, max_steps=1)
    with pytest.raises(NoBlocksFoundError, match="the block_types predicate matched no submodule of _Plain"):
        trainer.fit(_Plain(), sc.loader(sc.lm_dataset()))
    assert not dist.is_initialized()


def test_policy_with_bf16_true_is_conflicting_precision():
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    with pytest.raises(
        ValueError,
        match=r"conflicting precision.*precision='bf16-true'.*Fix: use Trainer\(precision='32-true'\)",
    ):
        _trainer(lp.TransformerFSDPStrategy(mixed_precision=policy), precision="bf16-true")


def test_policy_disagreeing_with_bf16_mixed_is_conflicting_precision():
    policy = MixedPrecisionPolicy(param_dtype=torch.float16)
    with pytest.raises(ValueError, match="conflicting precision.*param_dtype=torch.float16"):
        _trainer(lp.HybridShardStrategy(mixed_precision=policy), precision="bf16-mixed")
    # agreeing is fine: the policy casts, autocast stays off
    agreeing = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    trainer = _trainer(lp.TransformerFSDPStrategy(mixed_precision=agreeing), precision="bf16-mixed")
    assert trainer.precision == "bf16-mixed"


def test_unsupported_precision_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="precision='64-true'.*choose precision= one of 32-true, bf16-mixed"):
        _trainer("fsdp_blocks", precision="64-true")


def test_bad_options_are_refused_by_the_constructor():
    with pytest.raises(ValueError, match="reshard_after_forward='yes' must be True"):
        lp.TransformerFSDPStrategy(reshard_after_forward="yes")
    with pytest.raises(ValueError, match="compile=3 must be True, False or a dict"):
        lp.TransformerFSDPStrategy(compile=3)
    with pytest.raises(
        ValueError, match="mixed_precision='bf16' must be a torch.distributed.fsdp.MixedPrecisionPolicy"
    ):
        lp.TransformerFSDPStrategy(mixed_precision="bf16")


def test_missing_pretrained_file_fails_when_the_trainer_is_built(tmp_path):
    with pytest.raises(FileNotFoundError, match="init_from=.*is not a file"):
        _trainer(lp.TransformerFSDPStrategy(init_from=tmp_path / "missing.pt"))


def test_strategies_are_registered_under_their_names():
    assert isinstance(_trainer("fsdp_blocks", devices=2).strategy, lp.TransformerFSDPStrategy)
    assert isinstance(_trainer("hsdp", devices=2).strategy, lp.HybridShardStrategy)


def test_reading_an_empty_shard_outside_its_forward_gets_the_fix_in_the_error():
    # Lightning's test_params_synced_during_nonfit under fsdp_blocks: `.item()` on a parameter in test_step
    # reads this rank's shard, empty on a rank that holds none of a (1, 1) weight. The same DTensor here, on
    # one gloo rank: a (1, 1) global shape whose local shard has no rows.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from lit_parallel.strategies.fsdp import with_shard_read_hint

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        weight = DTensor.from_local(torch.empty(0, 1), mesh, [Shard(0)], shape=(1, 1), stride=(1, 1))
        with pytest.raises(RuntimeError) as caught:
            weight.item()
    finally:
        dist.destroy_process_group()
    with_shard_read_hint(caught.value)
    message = str(caught.value)
    assert message.startswith("_local_scalar_dense: Empty tensor not supported")
    assert "param.full_tensor()" in message and "outside its module's forward" in message
    other = RuntimeError("something else")
    with_shard_read_hint(other)
    assert str(other) == "something else"
