"""Run Lightning's own tests with Lightning's strategies and with ours, and compare test by test.

    python -m tests.lightning_contract.run --strategies lightning ddp_tuned --files core
    python -m tests.lightning_contract.run --files wide         # strategy, launcher, checkpoint, restore files
    python -m tests.lightning_contract.run --files all          # every file naming DDP / ModelParallel / "ddp"

Each strategy runs in its own pytest process (:mod:`tests.lightning_contract.plugin`) over the same files;
outcomes go to ``--out`` (``<strategy>.json``). A test that passes with Lightning's strategy must pass with
ours unless it is in the allow-list (:mod:`tests.lightning_contract.allowlist`, each entry with its reason,
the same differences as ``docs/explanations/compatibility.md``). Exit status 1 when a test differs without an entry.

Lightning's tests are found through ``LIT_PARALLEL_LIGHTNING_TESTS`` (the folder holding ``tests/tests_pytorch``),
else ``../shared/lightning-tests`` next to this repository, else ``/work/shared/lightning-tests``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.lightning_contract.allowlist import allowed_difference

REPO = Path(__file__).resolve().parents[2]
ENV_VAR = "LIT_PARALLEL_LIGHTNING_TESTS"
# Lightning's configuration makes FutureWarnings errors; torch 2.13 deprecates two APIs Lightning's own code
# calls (an all_gather, and LeafSpec in its loops' pytree handling), which would fail its own strategies too.
WARNING_FILTERS = (
    "error::FutureWarning",
    "ignore:torch.distributed.nn.functional.all_gather is deprecated:FutureWarning",
    "ignore:`isinstance(treespec, LeafSpec)` is deprecated:FutureWarning",
)
# What `make test` runs, per strategy: the strategy, checkpointing and restore files where Lightning's tests
# build the strategy that mode substitutes (a few minutes on 2 cores).
_DDP_CORE = ("strategies/test_ddp.py", "strategies/test_registry.py")
CORE_FILES: dict[str, tuple[str, ...]] = {
    "ddp_tuned": (*_DDP_CORE, "checkpointing/test_torch_saving.py", "models/test_restore.py"),
    "auto_parallel": _DDP_CORE,
    "fsdp_blocks": ("strategies/test_model_parallel.py",),
    "hsdp": ("strategies/test_model_parallel.py",),
    "tp_dp": ("strategies/test_model_parallel.py",),
    "pp_dp": ("strategies/test_model_parallel.py",),
}
# `--files wide`: every strategy and launcher file, with the checkpointing, restore, connector, data-loading,
# combined-loader, trainer and model-access files that build the substituted strategies (`all` takes hours).
WIDE_FILES = (
    "strategies/test_common.py",
    "strategies/test_ddp.py",
    "strategies/test_ddp_integration.py",
    "strategies/test_ddp_integration_comm_hook.py",
    "strategies/test_model_parallel.py",
    "strategies/test_model_parallel_integration.py",
    "strategies/test_registry.py",
    "strategies/launchers/test_multiprocessing.py",
    "strategies/launchers/test_subprocess_script.py",
    "checkpointing/test_checkpoint_callback_frequency.py",
    "checkpointing/test_model_checkpoint.py",
    "checkpointing/test_torch_saving.py",
    "models/test_restore.py",
    "overrides/test_distributed.py",
    "trainer/connectors/test_accelerator_connector.py",
    "trainer/connectors/test_data_connector.py",
    "trainer/properties/test_get_model.py",
    "trainer/test_dataloaders.py",
    "trainer/test_ddp_sigterm_handling.py",
    "trainer/test_trainer.py",
    "utilities/test_combined_loader.py",
)
# Modes that substitute a strategy class name, and the name; the others substitute registry names.
_NAMES = {
    "ddp_tuned": r"DDPStrategy|[\"']ddp",
    "auto_parallel": r"[\"']ddp[\"']|devices=[2-9]",
    "fsdp_blocks": r"ModelParallelStrategy",
    "hsdp": r"ModelParallelStrategy",
    "tp_dp": r"ModelParallelStrategy",
    "pp_dp": r"ModelParallelStrategy",
}


def lightning_tests_root() -> tuple[Path | None, str]:
    """The folder holding ``tests/tests_pytorch``, or None with where it was looked for."""
    candidates = []
    if os.environ.get(ENV_VAR):
        candidates.append(Path(os.environ[ENV_VAR]))
    candidates += [REPO.parent / "shared" / "lightning-tests", Path("/work/shared/lightning-tests")]
    for root in candidates:
        if (root / "tests" / "tests_pytorch" / "conftest.py").is_file():
            return root, ""
    looked = ", ".join(str(c) for c in candidates)
    return None, f"Lightning's tests (tests/tests_pytorch) not found; set {ENV_VAR} (looked in {looked})"


def select_files(root: Path, which: str | list[str], mode: str) -> list[str]:
    """Files (relative to tests_pytorch) for ``mode``: the core set, the given ones, or with ``"all"`` every
    file whose source names what ``mode`` substitutes."""
    tests = root / "tests" / "tests_pytorch"
    if which == "core":
        return (
            list(CORE_FILES[mode])
            if mode in CORE_FILES
            else sorted({f for v in CORE_FILES.values() for f in v})
        )
    if which not in ("all", "wide"):
        return list(which)
    pattern = "|".join(_NAMES.values()) if mode == "lightning" else _NAMES[mode]
    candidates = tests.rglob("test_*.py") if which == "all" else (tests / f for f in WIDE_FILES)
    return sorted(
        str(p.relative_to(tests)) for p in candidates if re.search(pattern, p.read_text(errors="replace"))
    )


def run_pytest(
    root: Path, mode: str, files: list[str], out: Path, timeout: int = 300, reuse: bool = False
) -> dict[str, str]:
    """Run ``files`` of Lightning's tests under ``mode``; returns nodeid -> outcome."""
    tests = root / "tests"
    out.mkdir(parents=True, exist_ok=True)
    results = out / f"{mode}.json"
    if reuse and results.is_file():
        return json.loads(results.read_text())["outcomes"]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(tests), env.get("PYTHONPATH", "")])
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # Lightning's tests may live in a read-only folder
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "pytest", "-p", "tests.lightning_contract.plugin", "-p", "no:cacheprovider"]
    cmd += [
        "--lit-strategy",
        mode,
        "--lit-results",
        str(results),
        "-q",
        "-rN",
        "--no-header",
        "-o",
        "addopts=",
    ]
    cmd += [
        "--rootdir",
        str(tests),
        f"--timeout={timeout}",
        "-c",
        os.devnull,
        "--continue-on-collection-errors",
    ]
    for spec in WARNING_FILTERS:
        cmd += ["-W", spec]
    cmd += [str(tests / "tests_pytorch" / f) for f in files]
    with tempfile.TemporaryDirectory(prefix=f"lightning-contract-{mode}-") as cwd:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    (out / f"{mode}.log").write_text(proc.stdout + proc.stderr)
    outcomes = json.loads(results.read_text())["outcomes"] if results.is_file() else {}
    if not outcomes:
        raise RuntimeError(f"pytest for {mode} ran no tests (exit {proc.returncode}):\n{proc.stdout[-3000:]}")
    return outcomes


@dataclass
class Comparison:
    """Ours against Lightning's on the tests both ran."""

    mode: str
    ours: dict[str, int] = field(default_factory=dict)
    theirs: dict[str, int] = field(default_factory=dict)
    allowed: dict[str, str] = field(default_factory=dict)  # test -> reason
    unexplained: dict[str, str] = field(default_factory=dict)  # test -> "lightning outcome -> ours"
    stale: list[str] = field(default_factory=list)  # allow-listed but no longer different
    flaky: dict[str, str] = field(default_factory=dict)  # test -> first outcome; passed when run again
    unpaired: int = 0  # tests that ran in only one of the two runs

    def line(self) -> str:
        def fmt(c: dict[str, int]) -> str:
            return " / ".join(str(c.get(k, 0)) for k in ("passed", "failed", "skipped"))

        return (
            f"{self.mode:<14} ours {fmt(self.ours):<16} lightning {fmt(self.theirs):<16}"
            f" allow-listed {len(self.allowed):<3} unexplained {len(self.unexplained):<3} flaky {len(self.flaky):<2}"
            f" unpaired {self.unpaired}"
        )

    def rerun(self, outcomes: dict[str, str]) -> None:
        """A difference that passes when its test runs again (alone, in a fresh pytest process) is flaky,
        not a difference: it is listed as such (with the first outcome) and counted as passed."""
        for test, outcome in outcomes.items():
            if test in self.unexplained and outcome in ("passed", "xpassed"):
                self.flaky[test] = self.unexplained.pop(test)
                self.ours["failed"] = self.ours.get("failed", 0) - 1
                self.ours["passed"] = self.ours.get("passed", 0) + 1


def _count(outcomes: dict[str, str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for outcome in outcomes.values():
        key = {"xfailed": "skipped", "xpassed": "passed"}.get(outcome, outcome)
        counts[key] = counts.get(key, 0) + 1
    return counts


# Parametrized test ids may contain the class name: ours is named as Lightning's to pair the tests up.
_ID_NAMES = {
    "ddp_tuned": ("TunedDDPStrategy", "DDPStrategy"),
    "fsdp_blocks": ("TransformerFSDPStrategy", "ModelParallelStrategy"),
    "hsdp": ("HybridShardStrategy", "ModelParallelStrategy"),
    "tp_dp": ("TensorParallelStrategy", "ModelParallelStrategy"),
    "pp_dp": ("PipelineParallelStrategy", "ModelParallelStrategy"),
}


def _renamed(mode: str, test: str, back: bool = False) -> str:
    """A test id of ours with Lightning's class name (or, ``back``, the reverse)."""
    if mode not in _ID_NAMES:
        return test
    ours, lightnings = _ID_NAMES[mode]
    old, new = (lightnings, ours) if back else (ours, lightnings)
    return re.sub(rf"\b{old}\b", new, test)


def compare(mode: str, ours: dict[str, str], theirs: dict[str, str]) -> Comparison:
    """A test that passes with Lightning's strategy and not with ours is allowed only by the allow-list."""
    ours = {_renamed(mode, test): outcome for test, outcome in ours.items()}
    common = sorted(set(ours) & set(theirs))
    result = Comparison(mode, _count({t: ours[t] for t in common}), _count({t: theirs[t] for t in common}))
    result.unpaired = len(set(ours) - set(theirs))
    for test in common:
        reason = allowed_difference(mode, test)
        differs = theirs[test] in ("passed", "xpassed") and ours[test] not in ("passed", "xpassed")
        if differs and reason:
            result.allowed[test] = reason
        elif differs:
            result.unexplained[test] = f"{theirs[test]} with Lightning's strategy -> {ours[test]} with {mode}"
        elif reason and ours[test] == theirs[test] == "passed":
            result.stale.append(test)
    return result


def rerun_differences(root: Path, comparison: Comparison, out: Path, timeout: int = 300) -> None:
    """Runs the unexplained differences of ``comparison`` once more, alone in a fresh pytest process; those
    that pass then are flaky (:meth:`Comparison.rerun`). A SIGABRT at the exit of a ``ddp_spawn`` rank
    (torch's gloo threads torn down with the interpreter, the group never destroyed) fails Lightning's own
    strategy too now and then."""
    if not comparison.unexplained:
        return
    mode = comparison.mode
    tests = [_renamed(mode, t, back=True).split("tests_pytorch/", 1)[-1] for t in comparison.unexplained]
    try:
        again = run_pytest(root, mode, tests, out, timeout)
    except RuntimeError:  # none of them ran
        again = {}
    comparison.rerun({_renamed(mode, t): outcome for t, outcome in again.items()})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--strategies",
        nargs="+",
        default=["ddp_tuned", "auto_parallel", "fsdp_blocks", "hsdp", "tp_dp", "pp_dp"],
    )
    parser.add_argument(
        "--files", nargs="+", default=["core"], help="'core', 'all' or paths under tests_pytorch"
    )
    parser.add_argument("--out", default="lightning-contract-results")
    parser.add_argument("--timeout", type=int, default=300, help="per test, seconds")
    parser.add_argument("--reuse", action="store_true", help="compare the results already in --out (no run)")
    args = parser.parse_args(argv)
    root, why = lightning_tests_root()
    if root is None:
        print(f"skipped: {why}")
        return 0
    which = args.files[0] if args.files in (["core"], ["wide"], ["all"]) else args.files
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    per_mode = {m: select_files(root, which, m) for m in args.strategies}
    union = sorted({f for files in per_mode.values() for f in files})
    start = time.monotonic()
    theirs = run_pytest(root, "lightning", union, out, args.timeout, args.reuse)
    print(f"lightning: {len(union)} files, {time.monotonic() - start:.0f}s", flush=True)
    comparisons = []
    for mode in args.strategies:
        start = time.monotonic()
        ours = run_pytest(root, mode, per_mode[mode], out, args.timeout, args.reuse)
        print(f"{mode}: {len(per_mode[mode])} files, {time.monotonic() - start:.0f}s", flush=True)
        comparison = compare(mode, ours, theirs)
        if not args.reuse:
            rerun_differences(root, comparison, out / "rerun", args.timeout)
        comparisons.append(comparison)
    report = {c.mode: {**c.__dict__} for c in comparisons}
    (out / "comparison.json").write_text(json.dumps(report, indent=1))
    print("passed / failed / skipped on the same tests")
    for c in comparisons:
        print(c.line())
        for test, what in c.unexplained.items():
            print(f"  UNEXPLAINED {test}: {what}")
        for test, what in c.flaky.items():
            print(f"  flaky (passed when run again) {test}: {what}")
        for test in c.stale:
            print(f"  allow-listed but passes now (remove the entry): {test}")
    return 1 if any(c.unexplained for c in comparisons) else 0


if __name__ == "__main__":
    sys.exit(main())
