"""The strategy costs the step-time prediction is priced with (lit_parallel/planner/time/calibration.py)."""

from __future__ import annotations

import pytest

from lit_parallel.planner.time.calibration import (
    SHAPES,
    CalibrationNet,
    StrategyCost,
    calibration_input,
    calibration_model,
    counts,
    fit_costs,
    shapes_of,
    tp_all_reduces,
)


def test_the_calibration_shapes_have_the_groups_and_tensors_the_fit_assumes():
    from lit_parallel.parallel.blocks import find_transformer_blocks

    for name, (blocks, layers, width) in SHAPES.items():
        model = CalibrationNet(blocks, layers, width)
        found = find_transformer_blocks(model, "auto").blocks
        groups, tensors, nbytes = counts(name)
        assert len(found) + 1 == groups == blocks + 1  # the blocks, then the root group
        assert len(list(model.parameters())) == tensors == 2 + 2 * blocks * layers
        assert sum(4 * p.numel() for p in model.parameters()) == nbytes
    # by hand: Linear(4, 4) x 3 = 3 x 20 parameters; heavy: Linear(4, 1024) + 2 x Linear(1024, 1024)
    assert counts("reference")[2] == 4 * 60
    assert counts("heavy")[2] == 4 * (5 * 1024 + 2 * (1024 * 1024 + 1024))


def test_costs_are_recovered_from_seconds_made_up_from_known_costs():
    # a strategy that costs 3 ms per step, 2 ms per FSDP group, 50 us per parameter tensor and 1 ms per MB
    # beyond the reference shape (3 groups, 6 tensors, 240 bytes): thin has 7 groups / 14 tensors, wide 7
    # groups / 146 tensors, heavy the reference's groups and tensors and 8,418,560 more bytes
    fixed, group, tensor, per_byte = 3e-3, 2e-3, 50e-6, 1e-9
    heavy_bytes = 4 * (5 * 1024 + 2 * (1024 * 1024 + 1024)) - 240
    # DDP also broadcasts buffers at every forward: 0.7 ms more for the buffered shape; FSDP2 syncs none
    one = {"reference": 1e-3, "thin": 1.5e-3, "wide": 4e-3, "heavy": 9e-3, "buffered": 1e-3}
    extra = {
        "reference": fixed,
        "thin": fixed + 4 * group + 8 * tensor,
        "wide": fixed + 4 * group + 140 * tensor,
        "heavy": fixed + heavy_bytes * per_byte,
        "buffered": fixed + 0.2e-3,
    }
    ddp_extra = {
        "reference": fixed,
        "thin": fixed + 8 * tensor,
        "wide": fixed + 140 * tensor,
        "heavy": fixed + heavy_bytes * per_byte,
        "buffered": fixed + 0.7e-3,
    }
    costs = fit_costs(
        one,
        {
            "fsdp_blocks": {k: one[k] + extra[k] for k in one},
            "ddp_tuned": {k: one[k] + ddp_extra[k] for k in one},
        },
    )
    f, d = costs["fsdp_blocks"], costs["ddp_tuned"]
    assert (f.fixed_s, f.group_s, f.tensor_s, f.byte_s) == pytest.approx((fixed, group, tensor, per_byte))
    assert (d.fixed_s, d.group_s, d.tensor_s, d.byte_s) == pytest.approx((fixed, 0.0, tensor, per_byte))
    # a model of 13 groups, 100 tensors and 1,000,240 bytes: 3 ms + 10 x 2 ms + 94 x 50 us + 1 ms
    assert f.seconds(13, 100, 1_000_240) == pytest.approx(3e-3 + 20e-3 + 4.7e-3 + 1e-3)
    assert d.seconds(13, 100, 1_000_240) == pytest.approx(3e-3 + 4.7e-3 + 1e-3)
    assert d.buffers_s == pytest.approx(0.7e-3) and f.buffers_s == 0.0  # FSDP's difference is noise to it
    assert d.seconds(13, 100, 1_000_240, buffers=True) == pytest.approx(3e-3 + 4.7e-3 + 1e-3 + 0.7e-3)


def test_the_all_reduces_of_each_shape_are_what_the_automatic_plan_makes():
    from lit_parallel.parallel.tensor_parallel.infer import infer_tp_plan
    from lit_parallel.planner.memory.tensor_parallel import all_reduces_per_step

    for name in SHAPES:
        model = calibration_model(name)
        plan = infer_tp_plan(model, tp_size=2)
        assert len(plan.split) == tp_all_reduces(name), (name, plan.describe())
        # as many column-wise as row-wise layers: a pair per block
        assert [layer.style for layer in plan.split].count("rowwise") == tp_all_reduces(name) // 2
        # every split layer all-reduces: each column-wise one reads the previous Linear's output
        assert all_reduces_per_step(model, plan, calibration_input()) == tp_all_reduces(name)
    # by hand: a block of one Linear has no row-wise partner; paired and wide split their first two Linears
    assert [tp_all_reduces(n) for n in ("reference", "thin", "paired", "wide", "heavy")] == [0, 0, 12, 12, 0]
    # only tp_dp (and one process, the baseline) runs the paired shape
    assert "paired" in shapes_of(None) and "paired" in shapes_of("tp_dp")
    assert all("paired" not in shapes_of(s) for s in ("ddp_tuned", "zero2", "fsdp_blocks", "hsdp"))


def test_tp_dp_cost_per_all_reduce_is_recovered_from_seconds_made_up_from_known_costs():
    # tp_dp costing 5 ms per step, 1 ms per FSDP group, 30 us per parameter tensor, 2 ms per all-reduce and
    # 1 ms per MB: thin 4 more groups and 8 more tensors than reference, paired thin's groups with 20 more
    # tensors and 12 all-reduces, wide 140 more tensors and the same 12 all-reduces
    fixed, group, tensor, split, per_byte = 5e-3, 1e-3, 30e-6, 2e-3, 1e-9
    heavy_bytes = counts("heavy")[2] - counts("reference")[2]
    one = {n: 1e-3 * (i + 1) for i, n in enumerate(SHAPES)}
    extra = {
        "reference": fixed,
        "thin": fixed + 4 * group + 8 * tensor,
        "paired": fixed + 4 * group + 20 * tensor + 12 * split,
        "wide": fixed + 4 * group + 140 * tensor + 12 * split,
        "heavy": fixed + heavy_bytes * per_byte,
        "buffered": fixed,
    }
    cost = fit_costs(one, {"tp_dp": {k: one[k] + extra[k] for k in one}})["tp_dp"]
    assert (cost.fixed_s, cost.group_s, cost.tensor_s, cost.all_reduce_s, cost.byte_s) == pytest.approx(
        (fixed, group, tensor, split, per_byte)
    )
    # a model of 5 groups, 30 tensors, 1,000,240 bytes and 7 all-reduces: 5 + 2 x 1 + 24 x 0.03 + 1 + 7 x 2
    assert cost.seconds(5, 30, 1_000_240, all_reduces=7) == pytest.approx((5 + 2 + 0.72 + 1 + 14) * 1e-3)
    # the other strategies never split a layer: FSDP's fit of the same seconds, without paired, has 0 for it
    fsdp = fit_costs(one, {"fsdp_blocks": {k: one[k] + extra[k] for k in one if k != "paired"}})[
        "fsdp_blocks"
    ]
    assert fsdp.all_reduce_s == 0.0


def test_a_cost_measured_below_one_process_is_no_cost_and_a_smaller_model_pays_the_fixed_cost():
    cost = StrategyCost.fit({"reference": -1e-4, "thin": -2e-4, "wide": -5e-4, "heavy": -3e-4}, grouped=True)
    assert (cost.fixed_s, cost.group_s, cost.tensor_s, cost.byte_s) == (0.0, 0.0, 0.0, 0.0)
    cost = StrategyCost(fixed_s=1e-3, group_s=1e-3, tensor_s=1e-4, reference_groups=3, reference_tensors=6)
    assert cost.seconds(1, 2) == pytest.approx(1e-3)


def test_the_predicted_step_adds_the_measured_strategy_cost():
    from lit_parallel.commands.advise.report import Prediction
    from lit_parallel.parallel.memory import estimate_comm_bytes
    from lit_parallel.planner.memory.predict import predict_peaks
    from lit_parallel.planner.time.calibration import StrategyCost
    from lit_parallel.planner.time.step import StepTime
    from tests.conformance_models import ResidualSequentialNet

    model = ResidualSequentialNet()
    report = predict_peaks(
        model,
        precision="32-true",
        devices=2,
        nodes=1,
        batch_size=4,
        seq_len=None,
        block_names=[f"blocks.{i}" for i in range(3)],
        device_type="cpu",
        example_inputs=__import__("torch").empty(4, 16, device="meta"),
    )
    params = sum(p.numel() for p in model.parameters())
    tensors = len(list(model.parameters()))
    timing = StepTime(
        block_s=0.0,
        op_s=1e-5,
        flop_s=0.0,
        ops=100,
        flops=0,
        optimizer_tensor_s=1e-5,
        optimizer_element_s=1e-9,
        tensors=tensors,
        elements=params,
        block_description="x",
    )
    fsdp = StrategyCost(
        fixed_s=2e-3,
        group_s=1e-3,
        tensor_s=1e-4,
        reference_groups=3,
        reference_tensors=6,
        byte_s=2e-9,
        reference_bytes=240,
    )
    pred = Prediction(
        "m",
        report,
        timing=timing,
        overhead_s=5e-4,
        busbw_gbps=1.0,
        latency_s=1e-4,
        groups=4,
        costs={"fsdp_blocks": fsdp},
    )
    got = pred.step_s("fsdp_blocks")
    # compute 100 x 10 us; AdamW tensors x 10 us + half the elements x 1 ns; 2 ms + 1 group x 1 ms +
    # (tensors - 6) x 100 us + (4 x params - 240) x 2 ns (the bytes, measured: not over the bus); Lightning
    # 0.5 ms
    comm = 2e-3 + 1e-3 + (tensors - 6) * 1e-4 + (4 * params - 240) * 2e-9
    expected = 1e-3 + (tensors * 1e-5 + params / 2 * 1e-9) + comm + 5e-4
    assert got["comm_s"] == pytest.approx(comm) and got["step_s"] == pytest.approx(expected)
    # hsdp is priced with fsdp_blocks' cost without its per-byte part, plus its bytes over the bus and the
    # latency of its replicas' all-reduce calls (one per group): on one node of 2 devices HSDP is FSDP (the
    # root group, the parameters outside the 3 blocks, gathered once)
    root = params - sum(p.numel() for p in model.blocks.parameters())
    sent = estimate_comm_bytes(params, strategy="fsdp", world_size=2, grad_dtype=4, root_params=root) / 1e9
    hsdp_comm = sent + 4 * 1e-4 + 2e-3 + 1e-3 + (tensors - 6) * 1e-4
    assert pred.step_s("hsdp")["comm_s"] == pytest.approx(hsdp_comm)
    # without a measured cost the old pricing: every collective call pays the latency
    assert pred.step_s("ddp_tuned")["comm_s"] == pytest.approx(1e-4 + 2 * params * 4 / 2 / 1e9)
    # DDP measured: 1 ms + 20 us per tensor beyond 6 (its bytes, 4 x params - 240, at 1 ns each); a model
    # with buffers pays their measured broadcast (0.3 ms), FSDP2 none
    ddp = StrategyCost(
        fixed_s=1e-3,
        group_s=0.0,
        tensor_s=2e-5,
        reference_groups=3,
        reference_tensors=6,
        byte_s=1e-9,
        reference_bytes=240,
        buffers_s=3e-4,
    )
    pred.costs["ddp_tuned"] = ddp
    ddp_comm = 1e-3 + (tensors - 6) * 2e-5 + (4 * params - 240) * 1e-9
    assert pred.step_s("ddp_tuned")["comm_s"] == pytest.approx(ddp_comm)
    pred.buffers = True
    assert pred.step_s("ddp_tuned")["comm_s"] == pytest.approx(ddp_comm + 3e-4)
    assert pred.step_s("fsdp_blocks")["comm_s"] == pytest.approx(comm)


def test_tp_dp_divides_the_compute_its_plan_splits_and_pays_its_measured_cost_per_all_reduce():
    from dataclasses import replace

    from lit_parallel.commands.advise.report import predict
    from lit_parallel.planner.time.step import StepTime

    # mlp (Linear 16->32, 32->32, 32->32, 32->4, Tanh between): the automatic plan splits them as two
    # column-wise / row-wise pairs at tp 2, every Linear split: 4 split layers, 3 all-reduces (the first
    # Linear reads the model's input, which needs no gradient)
    pred = predict(
        "tests.conformance_models:mlp",
        {},
        precision="32-true",
        devices=2,
        nodes=1,
        batch_size=4,
        seq_len=None,
        device_type="cpu",
        step_time=False,
        busbw_gbps=1.0,
        latency_s=1e-4,
        input_shape=(16,),
    )
    assert pred.tp_all_reduces == 3 and pred.tp_split == 1.0
    params, tensors = 16 * 32 + 32 + 2 * (32 * 32 + 32) + 32 * 4 + 4, 8
    costs = {
        "tp_dp": StrategyCost(
            fixed_s=5e-3,
            group_s=1e-3,
            tensor_s=3e-5,
            reference_groups=3,
            reference_tensors=6,
            byte_s=1e-9,
            reference_bytes=240,
            all_reduce_s=2e-3,
        )
    }
    timing = StepTime(
        block_s=0.0,
        op_s=1e-5,
        flop_s=0.0,
        ops=100,
        flops=0,
        optimizer_tensor_s=1e-5,
        optimizer_element_s=0.0,
        tensors=tensors,
        elements=params,
        block_description="x",
    )
    got = replace(pred, timing=timing, costs=costs).step_s("tp_dp")
    # compute 100 x 10 us, all of it split: halved; FSDP groups: the three Linears block discovery takes as
    # mlp's blocks (0, 2, 4) and the root, one beyond the reference's 3; 2 tensors and 4 x params - 240
    # bytes beyond it; 3 all-reduces x 2 ms
    assert pred.groups == 4 and got["compute_s"] == pytest.approx(0.5e-3)
    more = 1e-3 + (tensors - 6) * 3e-5 + (4 * params - 240) * 1e-9
    assert got["comm_s"] == pytest.approx(5e-3 + more + 3 * 2e-3)
    # a model the plan splits half of: the compute is 3/4 of one process's
    assert replace(pred, timing=timing, costs=costs, tp_split=0.5).step_s("tp_dp")[
        "compute_s"
    ] == pytest.approx(0.75e-3)


def test_advise_prices_the_step_with_a_measured_cluster_file(tmp_path, monkeypatch, capsys):
    import json

    from lit_parallel.commands.cli import main

    monkeypatch.setenv("COLUMNS", "200")
    cost = {
        "fixed_s": 0.004,
        "group_s": 0.002,
        "tensor_s": 1e-4,
        "reference_groups": 3,
        "reference_tensors": 6,
        "byte_s": 1e-9,
        "reference_bytes": 240,
        "retired_s": 0.5,  # a field another version wrote: read, and ignored
    }
    cluster = tmp_path / "cluster.json"
    cluster.write_text(
        json.dumps(
            {
                "measured_cluster": {
                    "ranks": 2,
                    "busbw_gbps": 0.5,
                    "latency_s": 2e-4,
                    "strategy_costs": {"fsdp_blocks": cost},
                }
            }
        )
    )
    out = tmp_path / "advice.json"
    args = [
        "advise",
        "--model",
        "tests.conformance_models:ResidualSequentialNet",
        "--devices",
        "2",
        "--memory-gb",
        "2",
        "--batch-size",
        "4",
        "--input-shape",
        "16",
        "--precision",
        "32-true",
        "--device-type",  # the costs were measured on CPU processes, and the step is timed on this CPU
        "cpu",
    ]
    assert main([*args, "--cluster", str(cluster), "--json", str(out)]) == 0
    data = json.loads(out.read_text())["prediction"]
    timing, fsdp = data["block_timing"], data["peak"]["fsdp_blocks"]["time"]
    assert data["busbw_gbps"] == 0.5 and data["latency_s"] == pytest.approx(2e-4)
    assert timing["fsdp_groups"] == 4 and timing["tensors"] == 22  # 3 blocks + root; 11 modules with weights
    params = timing["elements"]
    # 4 ms + 1 group beyond the reference's 3 x 2 ms + 16 tensors x 100 us + its fp32 bytes beyond 240 x 1 ns
    expected_comm = 0.004 + 1 * 0.002 + (22 - 6) * 1e-4 + (4 * params - 240) * 1e-9
    assert fsdp["comm_s"] == pytest.approx(expected_comm)
    assert fsdp["step_s"] == pytest.approx(
        fsdp["compute_s"] + fsdp["optimizer_s"] + expected_comm + data["overhead_s"]
    )
    # the same costs for 4 ranks: ring collectives move 3/4 of the bytes through each rank instead of 1/2, so
    # the per-byte cost is 1.5 x; the per-call costs stay as measured, and a note says so
    four = tmp_path / "four.json"
    assert main([*args[:4], "4", *args[5:], "--cluster", str(cluster), "--json", str(four)]) == 0
    data4 = json.loads(four.read_text())["prediction"]
    expected4 = 0.004 + 1 * 0.002 + (22 - 6) * 1e-4 + (4 * params - 240) * 1.5e-9
    assert data4["peak"]["fsdp_blocks"]["time"]["comm_s"] == pytest.approx(expected4)
    assert any("measured on 2 ranks, this prediction is for 4" in n for n in data4["notes"])
    assert not any("measured on 2 ranks" in n for n in data["notes"])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"busbw_gbps": 1.0}))
    assert main([*args, "--cluster", str(bad)]) != 0
    assert "no measured_cluster with busbw_gbps, latency_s, strategy_costs in it" in capsys.readouterr().err
    bad.write_text(json.dumps({"busbw_gbps": 1.0, "latency_s": 1e-4, "strategy_costs": {"ddp_tuned": 3}}))
    assert main([*args, "--cluster", str(bad)]) != 0
    assert "a strategy cost is malformed" in capsys.readouterr().err


def test_the_pipeline_cost_is_spread_over_the_slots_and_the_stage_groups_of_its_calibration_runs():
    from lit_parallel.planner.time.calibration import (
        BATCH,
        calibration_slots,
        fit_pipeline_cost,
        pipeline_slot_s,
        stage_bytes,
        stage_groups,
        stage_tensors,
    )

    # 2 stages: a batch of 8 splits into 8 micro-batches (4 x stages), so 8 + 2 - 1 = 9 slots
    assert BATCH == 8 and calibration_slots(2) == 9
    # 4 stages: 16 micro-batches do not divide 8, 8 do: 8 + 4 - 1 = 11 slots
    assert calibration_slots(4) == 11
    # on 2 stages, reference (2 blocks) has 1 block + the stage root per stage, thin (6 blocks) 3 + 1
    assert (stage_groups("reference", 2), stage_groups("thin", 2)) == (2, 4)
    # the largest stage is the first: the input Linear(4, width) and half the blocks, fp32
    assert (stage_bytes("reference", 2), stage_bytes("thin", 2)) == (
        4 * (5 * 4 + 5 * 4),
        4 * (5 * 4 + 3 * 5 * 4),
    )
    assert stage_bytes("heavy", 2) == 4 * (5 * 1024 + 1025 * 1024)
    # ... as pp_dp's own planner cuts it (its largest stage's share of the parameters)
    import torch

    from lit_parallel.planner.memory.predict import predict_peaks
    from lit_parallel.planner.time.calibration import calibration_model, counts

    for name in ("reference", "heavy"):
        report = predict_peaks(
            calibration_model(name),
            precision="32-true",
            devices=2,
            nodes=1,
            batch_size=8,
            seq_len=None,
            block_names=["blocks.0", "blocks.1"],
            device_type="cpu",
            example_inputs=torch.empty(8, 4, device="meta"),
        )
        share = report.pipeline.stage_share
        assert share * counts(name)[2] == pytest.approx(stage_bytes(name, 2)), name

    # the first stage's parameter tensors: the input Linear's 2 and 2 per Linear of its blocks
    # (reference: 1 block of 1 layer, thin: 3 of 1, wide: 3 of 12, heavy: 1 of 1)
    assert [stage_tensors(n, 2) for n in ("reference", "thin", "wide", "heavy")] == [4, 8, 74, 4]
    assert stage_groups("wide", 2) == 4 and stage_bytes("wide", 2) == 4 * (5 * 4 + 36 * 5 * 4)

    # a pipeline that costs 1 ms per slot + 0.5 ms per stage group + 40 us per stage tensor + 1 ns per
    # byte of the stage, per slot: over 9 slots each
    def per_slot(name: str) -> float:
        return (
            1e-3
            + 0.5e-3 * stage_groups(name, 2)
            + 40e-6 * stage_tensors(name, 2)
            + 1e-9 * stage_bytes(name, 2)
        )

    one = {"reference": 2e-3, "thin": 5e-3, "wide": 7e-3, "heavy": 9e-3}
    pipe = {n: one[n] + 9 * per_slot(n) for n in one}
    cost = fit_pipeline_cost(one, pipe, stages=2)
    got = (cost.slot_s, cost.group_s, cost.tensor_s, cost.byte_s, cost.fixed_s)
    assert got == pytest.approx((1e-3, 0.5e-3, 40e-6, 1e-9, 0.0))
    # a transformer stage of 3 groups, 26 tensors and 1 MB: 1 + 1.5 + 1.04 + 1 ms per slot
    assert pipeline_slot_s(cost, 3, 26, 1e6) == pytest.approx(1e-3 + 3 * 0.5e-3 + 26 * 40e-6 + 1e-3)


def test_pp_dp_transfers_pay_the_latency_only_where_no_measured_cost_per_slot_holds_it():
    from dataclasses import replace

    from lit_parallel.commands.advise.report import predict
    from lit_parallel.planner.time.calibration import StrategyCost
    from lit_parallel.planner.time.step import StepTime

    pred = predict(
        "tests.conformance_models:ResidualSequentialNet",
        {},
        precision="32-true",
        devices=2,
        nodes=1,
        batch_size=8,
        seq_len=None,
        device_type="cpu",
        step_time=False,
        busbw_gbps=1.0,
        latency_s=0.0,
        input_shape=(16,),
    )
    pipe = pred.report.pipeline
    # 2 stages, 8 micro-batches of 1 sample: 9 slots, each sending a 1 x 32 fp32 activation forward and its
    # gradient back
    assert (pipe.layout.stages, pipe.layout.microbatches, pipe.layout.micro_batch) == (2, 8, 1)
    assert pipe.boundary_bytes == 1 * 32 * 4
    pred.timing = StepTime(
        block_s=1e-3,
        op_s=1e-5,
        flop_s=0.0,
        ops=100,
        flops=0,
        optimizer_tensor_s=1e-5,
        optimizer_element_s=1e-9,
        tensors=20,
        elements=1000,
        block_description="x",
    )
    slow = replace(pred, latency_s=1e-3)
    # without a measured cost each transfer pays the latency: 9 slots x 2 x 1 ms more
    assert slow.step_s("pp_dp")["comm_s"] - pred.step_s("pp_dp")["comm_s"] == pytest.approx(9 * 2 * 1e-3)
    # the cost per slot measured on the calibration shapes holds their own transfers (a few bytes each, the
    # latency and all): only the model's bytes are added to it, whatever the latency
    cost = {"pp_dp": StrategyCost(0.0, 0.0, 0.0, 3, 6, slot_s=2e-3)}
    fast, slow = replace(pred, costs=cost), replace(slow, costs=cost)
    expected = 9 * (2e-3 + 2 * 128 / 1e9)
    assert fast.step_s("pp_dp")["comm_s"] == pytest.approx(expected)
    assert slow.step_s("pp_dp")["comm_s"] == pytest.approx(expected)


def test_each_round_is_predicted_against_its_own_step_and_the_median_round_is_the_error():
    from types import SimpleNamespace

    from lit_parallel.commands.advise.compare import error_rows, paired_step
    from lit_parallel.measure.live_memory import CATEGORIES, MemoryPeak

    # three rounds; the machine ran at half speed in the second, for its parts and its steps alike
    # (predicted, measured): each round's ratio is 1.2, 1.2 and 0.9; the median round is 20 % over
    got = paired_step([(6e-3, 5e-3), (12e-3, 10e-3), (4.5e-3, 5e-3)])
    assert got["predicted"] == 6e-3 and got["measured"] == 5e-3
    assert got["error"] == pytest.approx(0.2)
    assert got["round_errors"] == pytest.approx([0.2, 0.2, -0.1])
    # the step row of error_rows takes them (the row's split stays the prediction from the rounds' medians);
    # a median round 30 % short misses the 25 % target
    predicted, peak = SimpleNamespace(total=100, **dict.fromkeys(CATEGORIES, 0)), MemoryPeak(100, {})
    split = {"compute_s": 3e-3, "optimizer_s": 1e-3, "comm_s": 1e-3, "step_s": 5.5e-3}

    def step_row(rounds=None):
        (row,) = [
            r for r in error_rows("x", predicted, peak, split, 5e-3, rounds) if r["figure"].startswith("step")
        ]
        return row

    step = step_row([(6e-3, 5e-3), (12e-3, 10e-3), (4.5e-3, 5e-3)])
    assert (step["predicted"], step["ok"], step["parts"]) == (6e-3, True, split)
    assert step["error"] == pytest.approx(0.2)
    step = step_row([(7e-3, 10e-3), (3.5e-3, 5e-3), (4.9e-3, 5e-3)])
    assert step["error"] == pytest.approx(0.3) and step["ok"] is False
    # without rounds: the one prediction against the one measurement
    step = step_row()
    assert step["error"] == pytest.approx(0.1) and "round_errors" not in step


def test_an_uneven_pipeline_waits_for_its_slowest_stage():
    from lit_parallel.planner.time.pipeline import uneven_pipeline_step

    # stages of 0.1 s and 0.3 s per micro-batch, 4 micro-batches: the slow stage is busy 4 x 0.3 s, the
    # fast one adds its 0.1 s once (filling/draining); 5 slots, each one transfer each way and 10 ms
    t = uneven_pipeline_step([0.1, 0.3], microbatches=4, transfer_s=1e-3, overhead_per_slot_s=0.01)
    assert (t.compute_s, t.bubble_s, t.p2p_s, t.overhead_s) == pytest.approx((1.2, 0.1, 5 * 2e-3, 0.05))
    # equal stages: (M + P - 1) slots of compute, as the equal-stage formula says
    assert uneven_pipeline_step([0.2, 0.2], microbatches=4).step_s == pytest.approx(5 * 0.2)
    with pytest.raises(ValueError, match="microbatches=0"):
        uneven_pipeline_step([0.1], microbatches=0)


def test_each_stage_is_charged_the_flops_of_the_pieces_it_runs():
    import torch

    from lit_parallel.planner.time.pipeline import stage_work

    # CalibrationNet(2 blocks): inp, blocks.0 | blocks.1 (+ the loss); three Linear(4, 4) of equal FLOPs:
    # the first stage runs two of them, the second one; the loss (cross-entropy) has no matmul FLOPs
    model = CalibrationNet(2, 1)
    work = stage_work(model, [["blocks.0"], ["blocks.1"]], (torch.empty(8, 4, device="meta"),))
    assert [w.flops for w in work] == pytest.approx([2 / 3, 1 / 3])
    assert [w.groups for w in work] == [2, 2]  # one block and the stage's root each
    assert sum(w.ops for w in work) == pytest.approx(1.0)
    assert work[1].ops > 1 / 3  # the second stage also runs the loss's ops


def test_each_stage_counts_the_parameter_tensors_of_the_pieces_pp_dp_gives_it():
    import torch

    from lit_parallel.planner.memory.predict import predict_peaks
    from lit_parallel.planner.time.pipeline import pipeline_stage_work, stage_tensors

    # CalibrationNet(2 blocks of 3 layers) on 2 stages: inp's weight and bias with blocks.0's 3 Linears
    # (2 + 6 tensors), then blocks.1's 3 Linears (6 tensors)
    model = CalibrationNet(2, 3)
    report = predict_peaks(
        model,
        precision="32-true",
        devices=2,
        nodes=1,
        batch_size=8,
        seq_len=None,
        block_names=["blocks.0", "blocks.1"],
        device_type="cpu",
        example_inputs=torch.empty(8, 4, device="meta"),
    )
    work = pipeline_stage_work(model, ["blocks.0", "blocks.1"], report.pipeline.layout, (torch.empty(1, 4),))
    assert [w.tensors for w in work] == [2 + 6, 6]
    # a parameter two pieces share (tied weights) is one tensor of the stage
    tied = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 4), "b": torch.nn.Linear(4, 4, bias=False)})
    tied.b.weight = tied.a.weight
    assert stage_tensors(tied, ["a", "b"]) == 2


def test_the_launch_reports_the_median_of_its_rounds_and_the_first_rounds_peaks():
    from dataclasses import asdict

    from lit_parallel.commands.advise.measure import combine_rounds
    from lit_parallel.planner.time.step import StepTime

    def timing(block_s: float) -> dict:
        return asdict(
            StepTime(
                block_s=block_s,
                op_s=block_s / 100,
                flop_s=0.0,
                ops=100,
                flops=0,
                optimizer_tensor_s=1e-5,
                optimizer_element_s=1e-9,
                tensors=4,
                elements=10,
                block_description="the whole model",
            )
        )

    # three rounds; the machine was slow in the second: every figure is the median (the parts timed between
    # a strategy's steps included), the peaks are round 1's
    rounds = [
        {
            "alone": {"overhead_s": o, "one_process": {"reference": r}},
            "ddp_tuned": {"peaks": [p], "step_s": step, "timing": timing(s)},
            "calibration.ddp_tuned": {"reference": c},
            "zero2": {"error": "RuntimeError: no"},
            "tp_dp": {"peaks": [p], "step_s": step, "timing": None, "timed_costs": {"all_reduce_s": c / 2}},
            "calibration.tp_dp": {"paired": c},
        }
        for s, o, r, p, step, c in [
            (1e-3, 5e-4, 2e-3, 100, 4e-3, 3e-3),
            (9e-3, 9e-4, 8e-3, 101, 9e-3, 9e-3),
            (2e-3, 6e-4, 3e-3, 102, 5e-3, 4e-3),
        ]
    ]
    out = combine_rounds(rounds, ["ddp_tuned", "zero2"])
    # tp_dp's cost per all-reduce, timed between its steps: the median of 1.5, 4.5 and 2 ms
    assert combine_rounds(rounds, ["tp_dp"])["tp_dp"]["timed_costs"] == {"all_reduce_s": 2e-3}
    # a round whose timer had no samples counts for nothing: the median of the other two
    rounds[0]["tp_dp"]["timed_costs"] = {"all_reduce_s": None}
    assert combine_rounds(rounds, ["tp_dp"])["tp_dp"]["timed_costs"] == {"all_reduce_s": 3.25e-3}
    assert out["alone"] == {"overhead_s": 6e-4, "one_process": {"reference": 3e-3}}
    ddp = out["ddp_tuned"]
    assert ddp["peaks"] == [100] and ddp["step_s"] == 5e-3
    assert ddp["timing"]["block_s"] == 2e-3 and ddp["timing"]["op_s"] == 2e-5
    assert out["calibration"] == {"ddp_tuned": {"reference": 4e-3}}  # zero2 failed: no calibration
    assert out["zero2"] == {"error": "RuntimeError: no"}
    # a strategy that failed in a later round only (the rounds after it skip it) is reported as failed
    rounds[1]["ddp_tuned"] = {"error": "RuntimeError: later"}
    del rounds[2]["ddp_tuned"]
    assert combine_rounds(rounds, ["ddp_tuned"])["ddp_tuned"] == {"error": "RuntimeError: later"}


def test_a_launch_prices_each_strategy_with_the_costs_timed_between_its_steps():
    from lit_parallel.commands.advise.compare import launch_costs

    # the calibration runs (one process: 1 ms per shape) say 3 ms fixed, 2 ms per group, 50 us per tensor and
    # 1 ms per MB under both strategies; between zero2's steps the machine was slower: 4 ms fixed, 5 ms per
    # group (per tensor and byte are the calibration's). DDP was timed only by the calibration
    heavy_bytes = 4 * (5 * 1024 + 2 * (1024 * 1024 + 1024)) - 240
    extra = {
        "reference": 3e-3,
        "thin": 3e-3 + 4 * 2e-3 + 8 * 50e-6,
        "wide": 3e-3 + 4 * 2e-3 + 140 * 50e-6,
        "heavy": 3e-3 + heavy_bytes * 1e-9,
        "buffered": 3e-3,
    }
    timed = {"fixed_s": 4e-3, "group_s": 5e-3}
    res = {
        "alone": {"one_process": dict.fromkeys(extra, 1e-3)},
        "calibration": {n: {k: 1e-3 + v for k, v in extra.items()} for n in ("zero2", "ddp_tuned")},
        "zero2": {"timed_costs": timed},
        "ddp_tuned": {},
    }
    costs = launch_costs(res, 2)
    zero2, ddp = costs["zero2"], costs["ddp_tuned"]
    assert (zero2.fixed_s, zero2.group_s, zero2.tensor_s, zero2.byte_s) == pytest.approx(
        (4e-3, 5e-3, 50e-6, 1e-9)
    )
    assert (zero2.reference_groups, zero2.reference_tensors, zero2.reference_bytes) == (3, 6, 240)
    # DDP has no groups: its (wide - thin) / 132 tensors
    assert (ddp.fixed_s, ddp.group_s, ddp.tensor_s) == pytest.approx((3e-3, 0.0, 50e-6))


def test_the_parts_timed_between_steps_give_the_rates_worked_out_by_hand():
    from lit_parallel.planner.model_summary import build_on_meta, shaped_input
    from lit_parallel.planner.time.step import PartsTimer
    from tests.conformance_models import FEATURES, mlp

    timer = PartsTimer(
        build_on_meta(mlp, {}), block_name=None, batch_size=4, example_inputs=shaped_input((FEATURES,))
    )
    # the whole model at the micro-batch and at half of it: the same ops, half the FLOPs (Linears only)
    (ops1, flops1), (ops2, flops2) = timer.counts
    assert ops1 == ops2 and 2 * flops2 == flops1 > 0
    timer.sample()
    assert len(timer.samples) == 1 and len(timer.samples[0]) == 4 and min(timer.samples[0]) > 0
    # made-up counts and samples (forward + backward at B and B / 2, AdamW on the unit, AdamW on 64 tiny
    # tensors); the lower quartile of 8 samples is the third smallest
    timer.counts, timer.unit_tensors, timer.unit_elements = [(100, 1000), (100, 500)], 4, 1000
    timer.ops, timer.flops = timer.counts[0]
    lq = [3e-3, 2e-3, 1.4e-3, 64e-5]
    timer.samples = [[v * f for v in lq] for f in (1.5, 1.0, 0.5, 2.0, 0.9, 3.0, 1.2, 1.1)]  # third: 1.0
    got = timer.timing()
    assert got.block_s == pytest.approx(3e-3)
    assert got.flop_s == pytest.approx((3e-3 - 2e-3) / (1000 - 500))  # 2 us per FLOP
    assert got.op_s == pytest.approx((3e-3 - 2e-6 * 1000) / 100)  # what the FLOPs leave of B's time
    assert got.optimizer_tensor_s == pytest.approx(64e-5 / 64)
    assert got.optimizer_element_s == pytest.approx((1.4e-3 - 4 * 1e-5) / 1000)
    assert got.tensors == len(list(mlp().parameters())) and timer.samples == []  # forgotten once read
    assert got.compute_s == pytest.approx(3e-3)  # the model timed whole: its time at the micro-batch

    # a pipeline's micro-batch is the second batch timed (2 of 8 here), so its slots are not extrapolated
    pp = PartsTimer(
        build_on_meta(mlp, {}),
        block_name=None,
        batch_size=8,
        example_inputs=shaped_input((FEATURES,)),
        low_batch=2,
    )
    assert 4 * pp.counts[1][1] == pp.counts[0][1] and pp.inputs[1][0][0].shape[0] == 2
    # a micro-batch of one is timed next to twice it
    one = PartsTimer(
        build_on_meta(mlp, {}), block_name=None, batch_size=1, example_inputs=shaped_input((FEATURES,))
    )
    assert one.counts[1][1] == 2 * one.counts[0][1] and one.inputs[1][0][0].shape[0] == 2


def test_the_step_rates_always_give_back_the_time_at_the_micro_batch():
    from lit_parallel.planner.time.step import _rates

    counts = [(100, 1000), (100, 500)]
    # half the FLOPs take 2 of 3 ms: 2 us per FLOP, the 1 ms left over 100 ops
    assert _rates(counts, [3e-3, 2e-3]) == pytest.approx((1e-5, 2e-6))
    # faster than in proportion (1 of 3 ms at half the FLOPs): the FLOPs pay it all, 3 ms / 1000
    assert _rates(counts, [3e-3, 1e-3]) == pytest.approx((0.0, 3e-6))
    # no faster at half the FLOPs: the ops pay it all, 3 ms / 100
    assert _rates(counts, [3e-3, 3.5e-3]) == pytest.approx((3e-5, 0.0))
    # twice the batch works as well (5 ms at 2000 FLOPs: 2 us per FLOP), and one count alone
    assert _rates([(100, 1000), (100, 2000)], [3e-3, 5e-3]) == pytest.approx((1e-5, 2e-6))
    assert _rates([(100, 1000)], [3e-3]) == pytest.approx((3e-5, 0.0))


@pytest.fixture(scope="module")
def advise_launch(advise_two_ranks):
    """The launch of 2 ranks that runs every scenario of tests/scenarios/advise.py (tests/conftest.py)."""
    return advise_two_ranks


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_a_launch_times_the_parts_as_its_slowest_rank_saw_them(advise_launch):
    # sample 0: ranks 1 and 2 ms, sample 1: ranks 3 and 2 ms; the slowest per sample: 2 and 3 ms, whose
    # lower quartile (of two: the smaller) is 2 ms, on both ranks; the samples are used up
    expected = {"block_s": 2e-3, "samples_left": 0, "none": None}
    assert advise_launch.scenario("slowest_rank_timing") == [expected] * 2


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_tp_dp_cost_per_all_reduce_is_timed_as_the_slowest_rank_saw_it(advise_launch):
    got = advise_launch.scenario("all_reduce_timer")
    # made up: the slowest rank's paired times are 11, 20, 30 and 40 ms, its thin ones 1, 2, 4 and 4 ms; the
    # differences 10, 18, 26 and 36 ms have the lower quartile 18 ms: 1.5 ms for each of paired's 12
    # all-reduces, on both ranks; the samples are used up, and without samples there is no figure
    assert [g["made_up"] for g in got] == [pytest.approx(1.5e-3)] * 2
    assert all(g["left"] == [] and g["none"] is None for g in got)
    # real: paired's 12 all-reduces cost more than nothing, and both ranks report the same figure
    assert got[0]["real"] == got[1]["real"] > 0


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_fsdp_costs_are_timed_on_the_calibration_shapes_sharded_as_the_strategy_shards(advise_launch):
    got = advise_launch.scenario("fsdp_cost_timer")
    for name in ("zero2", "fsdp_blocks", "hsdp"):
        costs = [g[name]["costs"] for g in got]
        # every rank gets the same costs (each sample at its slowest rank's time); sharding adds a fixed cost
        # (three groups gathered and reduce-scattered: milliseconds on gloo); the samples are used up
        assert costs[0] == costs[1] and set(costs[0]) == {"fixed_s", "group_s"}, name
        assert costs[0]["fixed_s"] > 0, (name, costs[0])
        assert all(g[name]["left"] == [] for g in got)
        # collectives follow the groups, not the tensors: wide has thin's groups
        n = got[0][name]["collectives"]
        assert n["wide"] == n["thin"], (name, n)
    # by hand, per training step: each group is gathered in forward and reduce-scattered in backward, and
    # gathered again in backward when resharded after forward (fsdp_blocks, every block; not the root, which
    # stays gathered into backward; not ZeRO-2). reference: 2 blocks + root, thin: 6 blocks + root
    # made up: sharding added 13 - 1 ms to reference (rank 1's, the slower), 28 to thin, 53 to wide: 132 more
    # tensors in wide than thin at (53 - 28) / 132 each; thin's 4 more groups less its 8 more tensors
    tensor = (53 - 28) / 132
    assert got[0]["made_up"] == got[1]["made_up"]
    assert got[0]["made_up"] == pytest.approx(
        {"fixed_s": 12e-3, "group_s": (28 - 12 - 8 * tensor) / 4 * 1e-3}
    )
    zero2 = {"reference": 3 * 2, "thin": 7 * 2, "wide": 7 * 2}
    assert got[0]["zero2"]["collectives"] == zero2
    fsdp = {"reference": 3 * 3 - 1, "thin": 7 * 3 - 1, "wide": 7 * 3 - 1}
    assert got[0]["fsdp_blocks"]["collectives"] == fsdp


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def test_tp_dp_is_priced_by_the_all_reduces_a_real_split_step_runs(advise_launch):
    from lit_parallel.commands.advise.report import predict

    # by hand: mlp's plan splits its 4 Linears, and the first one reads the input (no gradient to reduce):
    # 3. t5 (2 encoder and 2 decoder layers): q, k, v, o, wi and wo of each encoder layer, self-attention's
    # and cross-attention's q, k, v and o and wi, wo of each decoder layer; the two relative attention bias
    # embeddings are split as well but read integer positions: 2 x 6 + 2 x 10 = 32
    counted = {"mlp": 3, "t5": 2 * 6 + 2 * 10}
    assert advise_launch.scenario("tp_all_reduces") == [counted] * 2
    for name, shape, seq in (("mlp", (16,), None), ("t5", None, 8)):
        pred = predict(
            f"tests.conformance_models:{name}",
            {},
            precision="32-true",
            devices=2,
            nodes=1,
            batch_size=4,
            seq_len=seq,
            device_type="cpu",
            step_time=False,
            busbw_gbps=None,
            input_shape=shape,
        )
        assert pred.tp_all_reduces == counted[name], name


def test_measure_step_calls_between_after_each_timed_step_only():
    import torch

    from lit_parallel.commands.advise.measure import measure_step

    calls = []
    peak, seconds = measure_step(
        torch.nn.Linear(2, 2), (torch.zeros(4, 2),), repeats=3, between=lambda: calls.append(1)
    )
    assert len(calls) == 3 and seconds > 0 and peak.total > 0
