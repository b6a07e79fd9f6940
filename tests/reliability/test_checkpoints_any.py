"""Any checkpoint under any strategy and any number of ranks.

Two launches (torchrun): on 2 ranks six strategies train one epoch and save (ddp_tuned and Lightning's ``ddp``
write one full file; fsdp_blocks, hsdp, tp_dp and Lightning's ModelParallelStrategy a sharded DCP folder),
then every other strategy's checkpoint restores under tp_dp (tensor parallel 2); on 3 ranks each restores
under a different strategy: sharded folders under ddp_tuned directly (no ``lit-parallel consolidate``), full
files under fsdp_blocks / hsdp, a tp_dp folder under hsdp. Expected values are the saving run's own full
model and optimizer state, gathered before the save: the restored ones must be bitwise equal.
"""

from __future__ import annotations

import pytest
import torch

from lit_parallel.reliability.checkpoints import TP_LAYOUT_KEY, check_tensor_parallel_layout
from tests.harness import launch
from tests.reference import assert_bitwise
from tests.scenarios.checkpoints_any import LOADS_ON_3, SAVED

SC = "tests.scenarios.checkpoints_any"


@pytest.fixture(scope="module")
def any_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("any_checkpoint")
    data = root / "data"
    data.mkdir()
    on_2 = launch(f"{SC}:any_save", 2, root, args={"dir": str(data)}, timeout=600).scenario("any_save")[0]
    on_3 = launch(f"{SC}:any_load", 3, root, args={"dir": str(data)}, timeout=600).scenario("any_load")[0]
    return on_2, on_3


def _check(out: dict, saved: dict, label: str, strategy: str, world: int) -> None:
    assert out["strategy"] == strategy and out["world"] == world, label
    assert out["trained"] == 0 and out["global_step"] == saved["global_step"], label
    assert saved["optimizer"]["state"], f"{label}: the saving run's optimizer state is empty"
    assert_bitwise(out["model"], saved["model"], f"{label} model")
    assert_bitwise(out["optimizer"], saved["optimizer"], f"{label} optimizer")


STRATEGY_CLASS = {
    "ddp_tuned": "TunedDDPStrategy",
    "fsdp_blocks": "TransformerFSDPStrategy",
    "hsdp": "HybridShardStrategy",
    "hsdp_1xN": "HybridShardStrategy",
    "tp_dp": "TensorParallelStrategy",
}


@pytest.mark.multiprocess
@pytest.mark.timeout(1300)
@pytest.mark.parametrize("source", [s for s in SAVED if s != "tp_dp"])
def test_checkpoint_of_any_strategy_restores_bitwise_under_tp_dp(any_checkpoint, source):
    on_2, _ = any_checkpoint
    out = on_2["restored"][f"{source}_to_tp_dp"]
    _check(out, on_2["saved"][source], f"{source} -> tp_dp", "TensorParallelStrategy", 2)


@pytest.mark.multiprocess
@pytest.mark.timeout(1300)
@pytest.mark.parametrize("label, source, target", LOADS_ON_3, ids=[x[0] for x in LOADS_ON_3])
def test_checkpoint_saved_on_2_ranks_restores_bitwise_on_3_under_another_strategy(
    any_checkpoint, label, source, target
):
    on_2, on_3 = any_checkpoint
    _check(on_3[label], on_2["saved"][source], label, STRATEGY_CLASS[target], 3)


# --- the one combination that is refused -----------------------------------------------------------------


def test_fused_layer_optimizer_state_in_tp_row_order_is_refused_under_another_size_naming_the_fix():
    meta = {TP_LAYOUT_KEY: {"tensor_parallel_size": 2, "fused": ["model.h.0.attn.c_attn"]}}
    with pytest.raises(ValueError) as err:
        check_tensor_parallel_layout(meta, "ckpt/last.ckpt", tensor_parallel_size=1)
    text = str(err.value)
    assert "'ckpt/last.ckpt' was saved with tensor_parallel_size=2 (tp_dp)" in text
    assert "model.h.0.attn.c_attn" in text and "cannot be resumed with tensor_parallel_size=1" in text
    assert "TensorParallelStrategy(tensor_parallel_size=2)" in text and "init_from=" in text
    check_tensor_parallel_layout(meta, "ckpt/last.ckpt", tensor_parallel_size=2)  # the same size loads
    check_tensor_parallel_layout({"epoch": 1}, "ckpt/last.ckpt", tensor_parallel_size=4)  # no fused layers


def test_a_full_file_is_refused_under_tp_dp_with_fused_layers_naming_the_fix(tmp_path):
    from types import SimpleNamespace

    import lit_parallel as lp

    path = tmp_path / "full.ckpt"
    torch.save({"state_dict": {}, "optimizer_states": []}, path)
    strategy = lp.TensorParallelStrategy(tensor_parallel_size=2)
    # as apply_tp records it
    strategy.tp_plan = SimpleNamespace(fused={"model.h.0.attn.c_attn": [32, 32, 32]})
    with pytest.raises(ValueError) as err:
        strategy.load_checkpoint(path)  # no process group: broadcast returns the path itself
    text = str(err.value)
    assert f"checkpoint {str(path)!r} is a full (single-file) checkpoint" in text
    assert (
        "model.h.0.attn.c_attn" in text
        and "save_distributed_checkpoint=True" in text
        and "init_from=" in text
    )
