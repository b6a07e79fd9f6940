"""The migration guide's example runs as written: a Lightning ``FSDPStrategy`` script and its checkpoint
move to ``fsdp_blocks``.

The scripts and commands are read from docs/how-to/migrate-from-lightning.md, so the page cannot drift from
what is tested. Three launches of 2 CPU ranks: the guide's "before" script under Lightning's own launcher
(Lightning's ``FSDPStrategy``, torch's FSDP1, saving its default full checkpoint file), the "after" script
from that file, and one torchrun launch where ``FSDPStrategy(state_dict_type="sharded")`` saves a folder
that ``fsdp_blocks`` resumes from. Expected values come from the checkpoints as Lightning wrote them, read
with ``torch.load`` and with torch's own ``dcp_to_torch_save``, never through lit_parallel's loaders.
"""

from __future__ import annotations

import difflib
import runpy
import shlex
from pathlib import Path

import pytest
import torch

from lit_parallel.commands.cli import main as lit_parallel_cli
from tests.doc_blocks import marked_block
from tests.harness import REPO_ROOT, launch, run_script
from tests.scenarios.migration import PROBE_ENV, write_fsdp1_on_cpu_site, write_probe_plugin

GUIDE = REPO_ROOT / "docs" / "how-to" / "migrate-from-lightning.md"
GUIDE_BLOCKS = ("before", "after", "commands")  # the guide's blocks these tests run (tests/doc_blocks.py)
STEPS_PER_EPOCH = 2  # 16 sequences, 2 ranks, batches of 4


def guide_block(name: str) -> str:
    """The fenced block that follows ``<!-- migration-example: NAME -->`` in the guide."""
    assert name in GUIDE_BLOCKS, name
    return marked_block(GUIDE, "migration-example", name).text


def parameter_names(script: Path) -> list[str]:
    """The guide's model's parameters in ``self.parameters()`` order: the ids of an optimizer state dict."""
    guide = runpy.run_path(str(script), run_name="migration_guide")  # definitions only: not __main__
    return [name for name, _ in guide["TinyGPT"]().named_parameters()]


@pytest.fixture(scope="module")
def scripts(tmp_path_factory) -> dict[str, Path]:
    """The guide's two scripts as files."""
    folder = tmp_path_factory.mktemp("guide_scripts")
    paths = {name: folder / f"{name}.py" for name in ("before", "after")}
    for name, path in paths.items():
        path.write_text(guide_block(name))
    return paths


def test_migrating_changes_only_the_strategy_and_what_continuing_needs():
    before, after = guide_block("before").splitlines(), guide_block("after").splitlines()
    changed = [
        (a.strip(), b.strip())
        for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=before, b=after).get_opcodes()
        if tag != "equal"
        for a, b in zip(before[i1:i2], after[j1:j2], strict=True)
    ]
    assert changed == [
        (
            "from lightning.pytorch.strategies import FSDPStrategy",
            "from lit_parallel import TransformerFSDPStrategy",
        ),
        (
            "strategy=FSDPStrategy(auto_wrap_policy={Block}),",
            "strategy=TransformerFSDPStrategy(block_types={Block}),",
        ),
        ("max_epochs=1,", "max_epochs=2,"),
        (
            'callbacks=[ModelCheckpoint(dirpath="checkpoints", filename="fsdp1")],',
            'callbacks=[ModelCheckpoint(dirpath="checkpoints", filename="fsdp2")],',
        ),
        (
            "trainer.fit(TinyGPT(), token_data())",
            'trainer.fit(TinyGPT(), token_data(), ckpt_path="checkpoints/fsdp1.ckpt")',
        ),
    ]


def _assert_same_tensors(loaded: dict, expected: dict, what: str) -> None:
    assert sorted(loaded) == sorted(expected), what
    for key, value in expected.items():
        assert torch.equal(loaded[key], value), f"{what}: {key} differs"


def _assert_same_adam_state(loaded: dict, expected_by_name: dict, what: str) -> None:
    """``loaded``: a name-keyed optimizer state dict; ``expected_by_name``: {name: {"step", "exp_avg", ...}}."""
    assert sorted(loaded["state"]) == sorted(expected_by_name), what
    for name, values in expected_by_name.items():
        assert sorted(loaded["state"][name]) == sorted(values), f"{what}: {name}"
        for key, value in values.items():
            assert torch.equal(torch.as_tensor(loaded["state"][name][key]), torch.as_tensor(value)), (
                f"{what}: {name}.{key} differs"
            )
    assert loaded["param_groups"][0]["lr"] == 1e-3


# --- the guide's two scripts: Lightning's default full checkpoint file --------------------------------------


@pytest.fixture(scope="module")
def migrated(scripts, tmp_path_factory) -> Path:
    """The "before" script, then the "after" script, each run once as ``python script.py`` (2 CPU ranks
    through Lightning's launcher) in one working folder; returns it (``checkpoints/``, ``probe.pt``)."""
    work = tmp_path_factory.mktemp("migration")
    site = write_fsdp1_on_cpu_site(tmp_path_factory.mktemp("fsdp1_on_cpu"))
    run_script(scripts["before"], work, env={"PYTHONPATH": str(site)}, timeout=180)
    plugin = write_probe_plugin(tmp_path_factory.mktemp("probe_plugin"))
    env = {"PYTHONPATH": str(plugin), PROBE_ENV: str(work / "probe.pt")}
    run_script(scripts["after"], work, env=env, timeout=180)
    return work


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_the_migrated_script_resumes_the_fsdp1_run_at_its_global_step(migrated):
    saved = torch.load(migrated / "checkpoints" / "fsdp1.ckpt", weights_only=True)
    probe = torch.load(migrated / "probe.pt", weights_only=True)
    assert probe["strategy"] == "TransformerFSDPStrategy"
    assert saved["global_step"] == STEPS_PER_EPOCH == probe["start_step"]
    assert probe["end_step"] == 2 * STEPS_PER_EPOCH
    # the continued run saved lit_parallel's sharded checkpoint at its last step
    meta = torch.load(migrated / "checkpoints" / "fsdp2.ckpt" / "meta.pt", weights_only=True)
    assert meta["global_step"] == 2 * STEPS_PER_EPOCH


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_the_migrated_script_starts_from_the_weights_and_adam_state_fsdp1_saved(migrated, scripts):
    saved = torch.load(migrated / "checkpoints" / "fsdp1.ckpt", weights_only=True)
    probe = torch.load(migrated / "probe.pt", weights_only=True)
    _assert_same_tensors(probe["state_dict"], saved["state_dict"], "weights after loading")
    # a full FSDP1 checkpoint keys the optimizer state by parameter index, in self.parameters() order
    names = parameter_names(scripts["before"])
    by_name = {names[i]: values for i, values in saved["optimizer_states"][0]["state"].items()}
    assert len(by_name) == len(names)
    _assert_same_adam_state(probe["optimizer"], by_name, "AdamW state after loading")


# --- a sharded FSDP1 folder: fsdp_blocks resumes from it, `lit-parallel consolidate` converts it ------------


@pytest.fixture(scope="module")
def sharded(scripts, tmp_path_factory) -> tuple[Path, dict]:
    """One torchrun launch: FSDP1 saves a sharded folder, fsdp_blocks resumes from it. Returns the working
    folder and the folder's content as torch's ``dcp_to_torch_save`` reads it."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    work = tmp_path_factory.mktemp("migration_sharded")
    args = {"script": str(scripts["before"]), "cwd": str(work), "probe": str(work / "probe.pt")}
    launch(
        "tests.scenarios.migration:sharded_fsdp1_then_fsdp_blocks",
        2,
        work,
        args=args,
        worker_group=False,
        timeout=180,
    )
    dcp_to_torch_save(work / "checkpoints" / "fsdp1.ckpt", work / "fsdp1_by_torch.pt")
    return work, torch.load(work / "fsdp1_by_torch.pt", weights_only=False)  # torch's file, written just now


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_fsdp_blocks_resumes_from_a_sharded_fsdp1_folder_as_saved(sharded):
    work, expected = sharded
    assert sorted(expected) == ["model", "optimizer_0"]  # FSDP1's layout: weights under "model"
    probe = torch.load(work / "probe.pt", weights_only=True)
    meta = torch.load(work / "checkpoints" / "fsdp1.ckpt" / "meta.pt", weights_only=True)
    assert meta["global_step"] == STEPS_PER_EPOCH == probe["start_step"]
    assert probe["end_step"] == 2 * STEPS_PER_EPOCH
    _assert_same_tensors(probe["state_dict"], expected["model"], "weights after loading")
    _assert_same_adam_state(probe["optimizer"], expected["optimizer_0"]["state"], "AdamW state after loading")


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_the_guides_consolidate_commands_convert_a_sharded_fsdp1_folder(
    sharded, scripts, monkeypatch, capsys
):
    work, expected = sharded
    monkeypatch.chdir(work)
    commands = [shlex.split(line) for line in guide_block("commands").splitlines() if line.strip()]
    assert [c[:2] for c in commands] == [["lit-parallel", "consolidate"]] * 2
    for command in commands:
        assert lit_parallel_cli(command[1:]) == 0, capsys.readouterr().err

    full = torch.load(work / "fsdp1-full.ckpt", weights_only=True)
    assert full["global_step"] == STEPS_PER_EPOCH and full["epoch"] == 0
    _assert_same_tensors(full["state_dict"], expected["model"], "--lightning weights")
    names = parameter_names(scripts["before"])
    optimizer = full["optimizer_states"][0]
    by_name = {
        "state": {names[i]: values for i, values in optimizer["state"].items()},
        "param_groups": optimizer["param_groups"],
    }
    _assert_same_adam_state(by_name, expected["optimizer_0"]["state"], "--lightning optimizer state")

    weights = torch.load(work / "fsdp1-weights.pt", weights_only=True)
    _assert_same_tensors(weights, expected["model"], "--key model weights")
