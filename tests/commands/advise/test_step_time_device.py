"""`advise`'s step time is timed on the device the prediction is for: a CUDA prediction on a machine without
CUDA gets no step time (and says why) instead of a CPU timing under a GPU's name."""

from __future__ import annotations

import pytest
import torch

from lit_parallel.commands.advise.report import predict, step_time_device

KW = dict(precision="32-true", devices=1, nodes=1, batch_size=2, seq_len=None, busbw_gbps=None)


def test_a_cuda_prediction_without_cuda_has_no_step_time_and_says_why(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    pred = predict("tests.models:Llama", {}, device_type="cuda", step_time=True, **KW)
    assert pred.timing is None and pred.step_s("one_process")["step_s"] is None
    assert any("no step time: the prediction is for cuda devices" in n for n in pred.notes), pred.notes
    assert "block_timing" not in pred.as_dict()
    assert pred.report.peaks["one_process"].total > 0  # the peak is still predicted


def test_a_cpu_prediction_is_timed_on_the_cpu_and_says_so():
    pred = predict("tests.models:Llama", {}, device_type="cpu", step_time=True, **KW)
    assert pred.timing is not None and pred.timing.device == "cpu"
    assert pred.as_dict()["block_timing"]["device"] == "cpu"
    assert pred.step_s("one_process")["step_s"] > 0


def test_the_timing_device_follows_the_target(monkeypatch):
    assert step_time_device("cpu") == torch.device("cpu")
    assert step_time_device("mps") is None  # no way to time it here: no figure rather than a wrong one
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert step_time_device("cuda") == torch.device("cuda", 3)


def test_advise_command_prints_why_a_cuda_prediction_has_no_step_time_here(capsys, monkeypatch):
    from lit_parallel.commands.cli import main

    monkeypatch.setenv("COLUMNS", "400")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["advise", "--model", "tests.models:Llama", "--devices", "1", "--memory-gb", "2"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "no step time: the prediction is for cuda devices" in out and "--device-type cpu" in out
    assert "timed here" not in out


def test_verify_cannot_be_a_cuda_prediction(capsys):
    from lit_parallel.commands.cli import main

    args = ["advise", "--model", "tests.models:Llama", "--verify", "--precision", "32-true"]
    assert main([*args, "--device-type", "cuda"]) == 2
    assert "--verify runs the model on this machine's CPU" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_prediction_is_timed_on_the_gpu():
    pred = predict("tests.models:Llama", {}, device_type="cuda", step_time=True, **KW)
    assert pred.timing is not None and pred.timing.device.startswith("cuda")
