"""Every strategy argument is checked when the strategy is built (no process group): names and values; the
arguments every strategy takes (CommonArguments) are kept where the strategy uses them."""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import signal
from datetime import timedelta
from pathlib import Path

import pytest
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

import lit_parallel
from lit_parallel import TunedDDPStrategy
from lit_parallel.strategies import ALL_STRATEGIES
from lit_parallel.strategies.arguments import CommonArguments
from lit_parallel.strategies.auto import CANDIDATES, AutoStrategy
from lit_parallel.strategies.fsdp import TransformerFSDPStrategy
from lit_parallel.strategies.hsdp import HybridShardStrategy
from lit_parallel.strategies.tensor_parallel import TensorParallelStrategy

ALL = (TunedDDPStrategy, TransformerFSDPStrategy, HybridShardStrategy, TensorParallelStrategy, AutoStrategy)
FSDP_FAMILY = (TransformerFSDPStrategy, HybridShardStrategy, TensorParallelStrategy)


def test_ddp_typo_names_the_closest_argument():
    with pytest.raises(ValueError) as err:
        TunedDDPStrategy(find_unused_parameter=True)
    message = str(err.value)
    assert message.startswith(
        "TunedDDPStrategy(find_unused_parameter=True): unknown argument 'find_unused_parameter'"
    )
    assert "did you mean 'find_unused_parameters'?" in message


def test_ddp_typo_of_a_pass_through_and_of_an_own_argument():
    with pytest.raises(ValueError, match="did you mean 'skip_all_reduce_unused_params'"):
        TunedDDPStrategy(skip_allreduce_unused_params=True)
    with pytest.raises(ValueError, match="did you mean 'comm_hook'"):
        TunedDDPStrategy(comm_hok="fp16")


def test_ddp_unknown_name_without_close_match_lists_valid_names():
    with pytest.raises(ValueError) as err:
        TunedDDPStrategy(zzzz=1)
    message = str(err.value)
    assert "there is no similar name" in message
    for name in ("find_unused_parameters", "init_sync", "ddp_comm_hook", "bucket_cap_mb"):
        assert name in message
    assert "device_ids" not in message  # set by the strategy, not offered


@pytest.mark.parametrize("name", ["module", "device_ids", "output_device", "process_group", "device_mesh"])
def test_ddp_arguments_the_strategy_sets_are_refused_with_the_reason(name):
    with pytest.raises(ValueError, match=rf"TunedDDPStrategy\({name}=0\) is not accepted: "):
        TunedDDPStrategy(**{name: 0})


def test_lightning_and_ddp_pass_through_arguments_stay_accepted():
    def hook(state, bucket):  # pragma: no cover - never called
        return bucket

    strategy = TunedDDPStrategy(
        ddp_comm_hook=hook,
        ddp_comm_state=None,
        ddp_comm_wrapper=None,
        model_averaging_period=None,
        init_sync=True,
        check_reduction=False,
        dim=0,
        skip_all_reduce_unused_params=False,
    )
    assert strategy._ddp_comm_hook is hook
    assert strategy._ddp_kwargs == {
        "init_sync": True,
        "check_reduction": False,
        "dim": 0,
        "skip_all_reduce_unused_params": False,
    }


def test_bucket_cap_mb_list_none_is_ignored_and_a_value_refused():
    strategy = TunedDDPStrategy(bucket_cap_mb_list=None)
    assert "bucket_cap_mb_list" not in strategy._ddp_kwargs
    with pytest.raises(ValueError, match=r"bucket_cap_mb=\[first, rest, \.\.\.\]"):
        TunedDDPStrategy(bucket_cap_mb_list=[1, 25])


def test_lightning_cli_style_construction_with_ddp_strategy_defaults():
    # LightningCLI (jsonargparse) may fill in every DDPStrategy default, bucket_cap_mb_list=None included.
    defaults = {"ddp_comm_state": None, "ddp_comm_hook": None, "ddp_comm_wrapper": None}
    defaults.update(model_averaging_period=None, start_method="popen", bucket_cap_mb_list=None)
    defaults.update(output_device=None, device_ids=None, process_group=None, device_mesh=None)
    strategy = TunedDDPStrategy(**defaults)
    assert isinstance(strategy, DDPStrategy)
    assert strategy._ddp_kwargs == {}


@pytest.mark.parametrize("init_args", [{}, {"find_unused_parameters": True, "init_sync": False}])
def test_lightning_cli_builds_the_strategy(init_args):
    # jsonargparse fills in every argument of DDP's signature, output_device=None and bucket_cap_mb_list=None
    # included; a real value of an argument the strategy sets itself is still refused.
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

    def cli(init_args: dict) -> LightningCLI:
        spec = json.dumps({"class_path": "lit_parallel.TunedDDPStrategy", "init_args": init_args})
        args = ["--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.strategy", spec]
        return LightningCLI(BoringModel, BoringDataModule, run=False, args=args)

    strategy = cli(init_args).trainer.strategy
    assert isinstance(strategy, TunedDDPStrategy)
    assert strategy._find_unused == init_args.get("find_unused_parameters", "auto")
    assert strategy._ddp_kwargs["init_sync"] is init_args.get("init_sync", True)
    assert not {"output_device", "device_ids", "process_group", "bucket_cap_mb_list"} & set(
        strategy._ddp_kwargs
    )
    with pytest.raises(ValueError, match=re.escape("TunedDDPStrategy(output_device=1) is not accepted")):
        cli({"output_device": 1})


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"gradient_as_bucket_view": "yes"}, "gradient_as_bucket_view='yes' must be True or False"),
        ({"start_method": "thread"}, "start_method='thread' must be one of 'popen', 'spawn'"),
        ({"init_sync": 1}, "init_sync=1 must be True or False"),
        ({"model_averaging_period": 0}, "model_averaging_period=0 must be a positive integer"),
        ({"ddp_comm_hook": "fp16"}, "ddp_comm_hook='fp16' must be a function"),
    ],
)
def test_ddp_refuses_wrong_values(kwargs, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        TunedDDPStrategy(**kwargs)


@pytest.mark.parametrize("cls", ALL)
@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"timeout": 30}, "timeout=30 must be a positive datetime.timedelta"),
        ({"timeout": timedelta(0)}, "timeout=datetime.timedelta(0) must be a positive datetime.timedelta"),
        ({"process_group_backend": 1}, "process_group_backend=1 must be a backend name"),
        ({"process_group_backend": ""}, "process_group_backend='' must be a backend name"),
    ],
)
def test_every_strategy_refuses_wrong_common_values(cls, kwargs, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        cls(**kwargs)


@pytest.mark.parametrize("cls", FSDP_FAMILY)
@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"activation_checkpointing": "true"}, "activation_checkpointing='true' must be True or False"),
        ({"save_distributed_checkpoint": 0}, "save_distributed_checkpoint=0 must be True or False"),
        ({"init_from": 3}, "init_from=3 must be a path"),
    ],
)
def test_sharded_strategies_refuse_wrong_values(cls, kwargs, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        cls(**kwargs)


@pytest.mark.parametrize("cls", (TransformerFSDPStrategy, HybridShardStrategy))
def test_cpu_offload_must_be_a_bool(cls):
    with pytest.raises(ValueError, match=re.escape("cpu_offload='no' must be True or False")):
        cls(cpu_offload="no")


def test_hsdp_typo_names_the_closest_argument():
    with pytest.raises(
        ValueError,
        match="HybridShardStrategy\\(cpu_ofload=True\\): unknown argument 'cpu_ofload'; did you mean 'cpu_offload'",
    ):
        HybridShardStrategy(cpu_ofload=True)


@pytest.mark.parametrize(
    "cls, typo, meant",
    [
        (TransformerFSDPStrategy, "reshard_after_forwad", "reshard_after_forward"),
        (TensorParallelStrategy, "tensor_paralel_size", "tensor_parallel_size"),
        (TensorParallelStrategy, "reshard_after_forwad", "reshard_after_forward"),
        (HybridShardStrategy, "reshard_after_forwad", "reshard_after_forward"),
        (AutoStrategy, "memory_gbs", "memory_gb"),
    ],
)
def test_typo_passed_to_a_strategy_without_kwargs_names_the_closest_argument(cls, typo, meant):
    with pytest.raises(ValueError) as err:
        cls(**{typo: True})
    message = str(err.value)
    assert message.startswith(
        f"{cls.__name__}({typo}=True): unknown argument {typo!r}; did you mean {meant!r}?"
    )
    assert "Valid names: " in message and "self" not in message.split("Valid names: ")[1]


def test_checked_argument_names_keeps_the_signature_that_lightning_cli_reads():
    import inspect

    for cls in (TransformerFSDPStrategy, TensorParallelStrategy, AutoStrategy):
        params = inspect.signature(cls).parameters
        assert "kwargs" not in params and "timeout" in params, cls
    assert "reshard_after_forward" in inspect.signature(TransformerFSDPStrategy).parameters
    # positional arguments still reach the constructor unchanged
    assert TransformerFSDPStrategy("auto", False)._reshard_after_forward is False


def test_auto_strategy_checks_candidate_arguments_by_building_them():
    with pytest.raises(ValueError, match="did you mean 'find_unused_parameters'"):
        AutoStrategy(strategy_kwargs={"ddp_tuned": {"find_unused_parameter": True}})
    with pytest.raises(
        ValueError, match="does not fit TransformerFSDPStrategy: .*did you mean 'cpu_offload'"
    ):
        AutoStrategy(strategy_kwargs={"fsdp_blocks": {"cpu_ofload": True}})
    with pytest.raises(ValueError, match="cpu_offload='yes' must be True or False"):
        AutoStrategy(strategy_kwargs={"fsdp_blocks": {"cpu_offload": "yes"}})


def test_valid_configurations_still_construct(tmp_path: Path):
    for cls in ALL:
        cls()
        cls(timeout=timedelta(minutes=5), process_group_backend="gloo")
        cls(timeout=None)
    TunedDDPStrategy(gradient_as_bucket_view=False, start_method="spawn", bucket_cap_mb=[1, 25])
    for cls in FSDP_FAMILY:
        cls(activation_checkpointing=True, save_distributed_checkpoint=False, init_from=tmp_path / "w.pt")
        cls(init_from=str(tmp_path / "w.pt"))
    TransformerFSDPStrategy(cpu_offload=True)
    HybridShardStrategy(shard_size=2, cpu_offload=True)
    AutoStrategy(
        strategy_kwargs={"ddp_tuned": {"comm_hook": "fp16", "init_sync": True}, "hsdp": {"shard_size": 2}}
    )


def test_every_registered_lit_parallel_strategy_constructs():
    names = [
        name
        for name in StrategyRegistry
        if StrategyRegistry[name]["strategy"].__module__.startswith("lit_parallel")
    ]
    assert "ddp_tuned_find_unused_parameters_true" in names
    for name in names:
        strategy = StrategyRegistry.get(name)
        assert strategy.__class__.__module__.startswith(lit_parallel.__name__)


# --- the arguments every strategy takes (CommonArguments) ------------------------------------------------

# each common argument: a value other than its default, where a built strategy keeps it (read back), and
# what it reads there
COMMON_TAKEN = [
    ("process_group_backend", "gloo", lambda s: s.process_group_backend, "gloo"),
    (
        "timeout",
        timedelta(minutes=7),
        # Lightning's, for the process group it creates; the reliability's, for every other group
        lambda s: (s._timeout, s.reliability.timeout, s.reliability.timeout_given),
        (timedelta(minutes=7), timedelta(minutes=7), True),
    ),
    ("debug_level", "detail", lambda s: s.reliability.options.debug_level, "detail"),
    ("watchdog", False, lambda s: s.reliability.options.watchdog, False),
    ("preemption_signal", "SIGUSR2", lambda s: s.reliability.options.preemption_signal, signal.SIGUSR2),
    ("stall_timeout", 42, lambda s: s.reliability.options.stall_timeout, 42.0),
    ("auto_resume", True, lambda s: s.auto_resume, True),
    (
        "async_checkpoint",
        "auto",
        lambda s: (s.reliability.options.async_checkpoint, s.reliability.checkpoints.setting),
        ("auto", "auto"),
    ),
]
# each common argument: a wrong value and the start of the error, which names the value
COMMON_REFUSED = [
    ("process_group_backend", 1, "process_group_backend=1 must be a backend name"),
    ("timeout", 30, "timeout=30 must be a positive datetime.timedelta"),
    ("debug_level", "verbose", "debug_level='verbose' must be None (keep TORCH_DISTRIBUTED_DEBUG)"),
    ("watchdog", "yes", "watchdog='yes' must be True or False"),
    ("preemption_signal", "SIGNOPE", "preemption_signal='SIGNOPE' is not a signal name"),
    ("stall_timeout", "soon", "stall_timeout='soon' must be 'auto'"),
    ("auto_resume", "yes", "auto_resume='yes' must be True or False"),
    ("async_checkpoint", "yes", "async_checkpoint='yes' must be True (write checkpoints in the background"),
]


def test_the_tables_cover_every_common_argument():
    assert [case[0] for case in COMMON_TAKEN] == list(CommonArguments.names())
    assert [case[0] for case in COMMON_REFUSED] == list(CommonArguments.names())


@pytest.mark.parametrize("cls", ALL_STRATEGIES, ids=lambda cls: cls.__name__)
def test_every_strategy_defaults_to_the_common_defaults(cls):
    strategy = cls()
    assert strategy.common_arguments == CommonArguments()
    assert strategy.reliability.options == CommonArguments().reliability_options()
    assert (
        strategy.reliability.timeout == CommonArguments().timeout and not strategy.reliability.timeout_given
    )
    assert strategy.auto_resume is False
    assert strategy.reliability.checkpoints is None  # synchronous saves unless asked


@pytest.mark.parametrize("cls", ALL_STRATEGIES, ids=lambda cls: cls.__name__)
@pytest.mark.parametrize(
    ("name", "value", "read", "expected"), COMMON_TAKEN, ids=[c[0] for c in COMMON_TAKEN]
)
def test_every_strategy_keeps_each_common_argument(cls, name, value, read, expected):
    strategy = cls(**{name: value})
    assert read(strategy) == expected
    assert strategy.common_arguments == CommonArguments(**{name: value})


@pytest.mark.parametrize("cls", ALL_STRATEGIES, ids=lambda cls: cls.__name__)
@pytest.mark.parametrize(("name", "value", "needle"), COMMON_REFUSED, ids=[c[0] for c in COMMON_REFUSED])
def test_every_strategy_refuses_a_wrong_common_argument_naming_the_value(cls, name, value, needle):
    with pytest.raises(ValueError) as err:
        cls(**{name: value})
    assert str(err.value).startswith(needle), str(err.value)


@pytest.mark.parametrize(
    "cls", [c for c in ALL_STRATEGIES if c is not HybridShardStrategy], ids=lambda cls: cls.__name__
)
def test_every_signature_lists_the_common_arguments_as_common_arguments_declares_them(cls):
    # HybridShardStrategy takes them through **kwargs, as TransformerFSDPStrategy's (the tests above)
    params = inspect.signature(cls.__init__).parameters
    declared = {field.name: field for field in dataclasses.fields(CommonArguments)}
    listed = [name for name in params if name in declared]
    assert listed == list(declared), f"{cls.__name__} lists {listed}"
    for name, field in declared.items():
        assert params[name].default is field.default or params[name].default == field.default, name
        assert params[name].annotation == field.type, name


def test_auto_strategy_passes_every_common_argument_to_each_candidate():
    values = {name: value for name, value, _, _ in COMMON_TAKEN}
    auto = AutoStrategy(**values)
    for name, cls in CANDIDATES.items():
        candidate = cls(**auto._kwargs_for(name))
        assert candidate.common_arguments == auto.common_arguments == CommonArguments(**values), name
        for _, _, read, expected in COMMON_TAKEN:
            assert read(candidate) == expected, name
