"""Lightning's own strategy, checkpointing and restore tests pass with our strategies as they do with
Lightning's, except the allow-listed, documented differences. The wider selection runs with
``make contract``. Skipped, with the reason, where Lightning's test sources are not available."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.harness import REPO_ROOT
from tests.lightning_contract import run
from tests.lightning_contract.allowlist import ALLOWED, REASONS

MODES = ["ddp_tuned", "auto_parallel", "fsdp_blocks", "hsdp", "tp_dp", "pp_dp"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root, why = run.lightning_tests_root()
    if root is None:
        pytest.skip(why)
    out = tmp_path_factory.mktemp("lightning-contract")
    # each run is one pytest process, mostly one busy thread: two at a time keep both cores of CI busy
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = {
            mode: pool.submit(run.run_pytest, root, mode, run.select_files(root, "core", mode), out)
            for mode in ["lightning", *MODES]
        }
        outcomes = {mode: job.result() for mode, job in runs.items()}
    comparisons = {mode: run.compare(mode, outcomes[mode], outcomes["lightning"]) for mode in MODES}
    for comparison in comparisons.values():
        run.rerun_differences(root, comparison, out / "rerun")
    return comparisons


@pytest.mark.multiprocess
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("mode", MODES)
def test_lightnings_core_tests_pass_with_our_strategy_except_documented_differences(results, mode):
    c = results[mode]
    assert not c.unexplained, "\n".join(f"{t}: {what}" for t, what in c.unexplained.items())
    # the same tests pass, less exactly the allow-listed ones; nothing fails that passes with Lightning's
    assert c.ours.get("passed", 0) + len(c.allowed) == c.theirs.get("passed", 0)
    assert c.theirs.get("passed", 0) >= 10  # the files really ran
    assert not c.stale, f"allow-listed but passing now, remove the entries: {c.stale}"
    assert c.unpaired == 0  # every test of ours was paired with Lightning's run of it


def test_a_difference_that_passes_when_run_again_is_flaky_not_unexplained():
    prefix = "tests_pytorch/strategies/test_ddp_integration.py::"
    theirs = {prefix + "a": "passed", prefix + "b": "passed", prefix + "c[DDPStrategy]": "passed"}
    ours = {prefix + "a": "failed", prefix + "b": "failed", prefix + "c[TunedDDPStrategy]": "failed"}
    c = run.compare("ddp_tuned", ours, theirs)
    assert set(c.unexplained) == set(theirs) and c.ours == {"failed": 3}
    # our id of a parametrized test carries our class name; the rerun asks for it by that name
    assert run._renamed("ddp_tuned", prefix + "c[DDPStrategy]", back=True) == prefix + "c[TunedDDPStrategy]"
    c.rerun({prefix + "a": "passed", prefix + "b": "failed", prefix + "c[DDPStrategy]": "passed"})
    assert set(c.flaky) == {prefix + "a", prefix + "c[DDPStrategy]"} and list(c.unexplained) == [prefix + "b"]
    assert c.ours == {"failed": 1, "passed": 2}
    assert "flaky 2" in c.line()


def test_every_allow_listed_difference_is_documented_with_its_reason():
    text = (REPO_ROOT / "docs" / "explanations" / "compatibility.md").read_text()
    # mkdocs' anchors: the heading in lower case, without punctuation, spaces as hyphens
    headings = re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE)
    anchors = {re.sub(r"[^\w\- ]", "", h.lower()).strip().replace(" ", "-") for h in headings}
    assert set(REASONS) <= anchors, (
        f"sections missing in docs/explanations/compatibility.md: {set(REASONS) - anchors}"
    )
    assert {anchor for _, _, anchor in ALLOWED} <= set(REASONS)


def test_lightning_tests_are_found_through_the_environment_variable(tmp_path, monkeypatch):
    monkeypatch.setenv(run.ENV_VAR, str(tmp_path))
    (tmp_path / "tests" / "tests_pytorch").mkdir(parents=True)
    (tmp_path / "tests" / "tests_pytorch" / "conftest.py").write_text("")
    assert run.lightning_tests_root() == (tmp_path, "")
