"""Every strategy's public constructor, as Python and as LightningCLI see it, stays what
``signatures.json`` (beside this file) records.

LightningCLI (jsonargparse) builds a strategy from its ``__init__`` signature, following ``**kwargs`` into
the code the constructor passes them to (``TunedDDPStrategy``'s reach ``DDPStrategy`` and
``DistributedDataParallel``; ``HybridShardStrategy``'s reach ``TransformerFSDPStrategy``), and the docs list
the same arguments. So a change of a parameter's name, order, kind, default or annotation, or of what
``**kwargs`` resolve to, is a change of the public interface: this test fails on it. For each strategy the
record holds

- ``signature``: ``inspect.signature(cls.__init__)``, one entry per parameter: name, kind, ``repr`` of the
  default (``null`` for none) and the annotation as written (``null`` for none);
- ``print_config``: the ``trainer.strategy`` section that ``--print_config`` of a LightningCLI prints with
  the strategy given as ``class_path`` and no ``init_args`` (``init_args`` as ``[name, value]`` pairs, in
  order).

After an intended change of the interface, regenerate the record and commit it with the change:
``LP_UPDATE_SIGNATURES=1 python -m pytest -q tests/strategies/test_signatures.py``.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import os
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

from lit_parallel import _compat
from lit_parallel.strategies import ALL_STRATEGIES
from lit_parallel.strategies.arguments import NEWER_DDP_ARGUMENTS

RECORD = Path(__file__).resolve().parent / "signatures.json"
UPDATE = os.environ.get("LP_UPDATE_SIGNATURES") == "1"


def signature_record(cls: type) -> list[dict[str, Any]]:
    """``cls.__init__``'s parameters: name, kind, ``repr`` of the default, annotation as written."""
    record = []
    for param in inspect.signature(cls.__init__).parameters.values():
        annotation = param.annotation
        record.append(
            {
                "name": param.name,
                "kind": param.kind.name,
                "default": None if param.default is param.empty else repr(param.default),
                "annotation": None
                if annotation is param.empty
                else annotation
                if isinstance(annotation, str)
                else inspect.formatannotation(annotation),
            }
        )
    return record


def printed_config(cls: type) -> dict[str, Any]:
    """The ``trainer.strategy`` section of LightningCLI's ``--print_config`` for ``cls`` with its defaults."""
    spec = json.dumps({"class_path": f"lit_parallel.{cls.__name__}"})  # the public path, as users write it
    args = ["--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.strategy", spec, "--print_config"]
    out = io.StringIO()
    # --print_config prints the configuration and exits (status 0) before anything is built; sys.argv holds
    # pytest's arguments, which LightningCLI would warn about next to args
    with (
        contextlib.redirect_stdout(out),
        mock.patch.object(sys, "argv", ["lightning"]),
        pytest.raises(SystemExit) as exited,
    ):
        LightningCLI(BoringModel, BoringDataModule, run=False, args=args)
    assert exited.value.code in (0, None), out.getvalue()
    section = yaml.safe_load(out.getvalue())["trainer"]["strategy"]
    # the printed values as JSON has them (a timedelta prints as "0:30:00"); pairs keep the printed order
    init_args = json.loads(json.dumps(list(section.get("init_args", {}).items()), default=str))
    return {"class_path": section["class_path"], "init_args": init_args}


def live_record() -> dict[str, Any]:
    return {
        cls.__name__: {"signature": signature_record(cls), "print_config": printed_config(cls)}
        for cls in ALL_STRATEGIES
    }


def record_text(record: dict[str, Any]) -> str:
    """``record`` as JSON with one line per parameter and per printed argument (short diffs)."""
    classes = []
    for name, entry in record.items():
        params = ",\n".join(f"   {json.dumps(p)}" for p in entry["signature"])
        config = entry["print_config"]
        init_args = ",\n".join(f"    {json.dumps(pair)}" for pair in config["init_args"])
        classes.append(
            f' {json.dumps(name)}: {{\n  "signature": [\n{params}\n  ],\n'
            f'  "print_config": {{\n   "class_path": {json.dumps(config["class_path"])},\n'
            f'   "init_args": [\n{init_args}\n   ]\n  }}\n }}'
        )
    return "{\n" + ",\n".join(classes) + "\n}\n"


@pytest.fixture(scope="module")
def recorded() -> dict[str, Any]:
    if UPDATE:
        RECORD.write_text(record_text(live_record()))
    return json.loads(RECORD.read_text())


def test_the_record_covers_every_strategy(recorded):
    assert sorted(recorded) == sorted(cls.__name__ for cls in ALL_STRATEGIES)


@pytest.mark.parametrize("cls", ALL_STRATEGIES, ids=lambda cls: cls.__name__)
def test_the_constructor_signature_is_the_recorded_one(cls, recorded):
    assert signature_record(cls) == recorded[cls.__name__]["signature"], (
        f"{cls.__name__}.__init__'s signature differs from {RECORD.name}; if intended, regenerate it:"
        " LP_UPDATE_SIGNATURES=1 python -m pytest -q tests/strategies/test_signatures.py"
    )


def for_installed_torch(cls: type, config: dict[str, Any]) -> dict[str, Any]:
    """The record (made with the newest torch) less the DistributedDataParallel arguments that ``cls``
    reaches through ``**kwargs`` and the installed torch does not have yet (``_compat.FEATURES``)."""
    own = set(inspect.signature(cls.__init__).parameters)
    absent = {n for n, f in NEWER_DDP_ARGUMENTS.items() if not _compat.has_feature(f)} - own
    return {**config, "init_args": [pair for pair in config["init_args"] if pair[0] not in absent]}


def test_on_an_older_torch_the_record_drops_only_the_ddp_arguments_it_lacks(monkeypatch):
    from lit_parallel import TunedDDPStrategy

    config = {"class_path": "x", "init_args": [["forward_sync_buffers", None], ["batched_grad_copy", False]]}
    monkeypatch.setitem(_compat._FORCED, "ddp_batched_grad_copy", False)
    monkeypatch.setitem(_compat._FORCED, "ddp_forward_sync_buffers", False)
    # forward_sync_buffers is TunedDDPStrategy's own argument: printed on every torch
    assert for_installed_torch(TunedDDPStrategy, config)["init_args"] == [["forward_sync_buffers", None]]
    monkeypatch.setitem(_compat._FORCED, "ddp_batched_grad_copy", True)
    assert for_installed_torch(TunedDDPStrategy, config) == config


@pytest.mark.parametrize("cls", ALL_STRATEGIES, ids=lambda cls: cls.__name__)
def test_lightning_cli_prints_the_recorded_configuration(cls, recorded):
    assert printed_config(cls) == for_installed_torch(cls, recorded[cls.__name__]["print_config"]), (
        f"LightningCLI's --print_config for {cls.__name__} differs from {RECORD.name}; if intended,"
        " regenerate it: LP_UPDATE_SIGNATURES=1 python -m pytest -q tests/strategies/test_signatures.py"
    )


def test_the_record_is_written_as_the_generator_writes_it(recorded):
    # one line per parameter; a hand-edited or reformatted file shows up here rather than as a noisy diff
    assert RECORD.read_text() == record_text(recorded)
