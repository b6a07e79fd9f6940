# Two commands for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# A plain `torch` requirement pulls a multi-GB CUDA build; install the CPU build explicitly first.
TORCH_SPEC ?= torch==2.13.0
# `make test-compat`: the newest torch pip installs here (a CUDA build; it runs on CPU with gloo), in its own
# environment, against the unit tier and one launch per strategy (docs/reference/versions.md, "Tested versions")
COMPAT_TORCH_SPEC ?= torch==2.14.1
COMPAT_VENV ?= .venv-compat
export OMP_NUM_THREADS ?= 1

.PHONY: install demo test check lint format bench docs clean contract test-compat clean-compat

install: $(VENV)/.installed

# extras: what `make test` runs needs scikit-learn (demo, digits), jsonargparse (recipes), mkdocs (docs build),
# matplotlib (bench plots)
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[test,demo,docs,recipes,bench]"
	touch $@

demo: install
	$(BIN)/lit-parallel demo

# ruff, then the layer contract (tests/test_layers.py: layers import only downward, no import cycles)
lint: install
	$(BIN)/ruff check lit_parallel tests $(wildcard recipes)
	$(BIN)/ruff format --check lit_parallel tests $(wildcard recipes)
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/test_layers.py

format: install
	$(BIN)/ruff format lit_parallel tests $(wildcard recipes)
	$(BIN)/ruff check --fix lit_parallel tests $(wildcard recipes)

# the layer contract ran in lint: not again
test: lint
	$(BIN)/python -m pytest --ignore=tests/test_layers.py tests

# the edit-test loop: lint and every test that launches no ranks (under 2 minutes on 2 cores)
check: lint
	$(BIN)/python -m pytest -m "not multiprocess" --ignore=tests/test_layers.py tests

# The unit tier and one launch per strategy on $(COMPAT_TORCH_SPEC): two launches cover all six strategies
# (Lightning's launcher, 2 ranks: ddp_tuned, fsdp_blocks, hsdp, auto_parallel's choices and the paths of an
# older torch, forced; the shared 4-rank launch: tp_dp as dp2 x tp2 and pp_dp as pp2 x dp2), a third expert
# parallelism (2 ranks: fsdp_blocks with expert_parallel_size=2 on four MoE models, checkpoints, all-to-all bytes), a fourth
# asynchronous checkpoints (torchrun, 2 ranks, 5 restarts: a rank killed during a background write under every
# strategy, then resumed). From scratch
# (the environment built, ~6 GB) about 4 minutes on 2 cores; docs/reference/versions.md has the matrix.
COMPAT_LAUNCH_TESTS := \
	tests/strategies/test_ddp.py::test_registry_name_under_lightnings_own_launcher_matches_single_process \
	tests/strategies/test_fsdp.py::test_lightning_launcher_string_names_and_repeated_trainers \
	tests/strategies/test_auto.py::test_auto_parallel_becomes_the_strategy_the_rules_choose_and_trains_exactly_like_it \
	tests/strategies/test_tensor_parallel.py::test_dp2_tp2_matches_single_process_with_accumulation_and_clipping \
	tests/strategies/test_pipeline.py::test_pp2_dp2_matches_single_process \
	tests/parallel/expert_parallel/test_expert_parallel.py::test_fsdp_ep2_matches_one_process \
	tests/reliability/test_async_checkpoints.py::test_a_rank_killed_during_a_background_write_keeps_the_previous_checkpoint_and_resumes_bitwise \
	tests/strategies/test_older_torch.py

$(COMPAT_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(COMPAT_VENV)/bin/python -m pip install --quiet "$(COMPAT_TORCH_SPEC)"
	$(COMPAT_VENV)/bin/python -m pip install --quiet -e ".[test,demo,docs,recipes,bench]"
	echo "$(COMPAT_TORCH_SPEC)" > $@

test-compat: $(COMPAT_VENV)/.installed
	@if [ "$$(cat $(COMPAT_VENV)/.installed)" != "$(COMPAT_TORCH_SPEC)" ]; then \
		echo "$(COMPAT_VENV) holds $$(cat $(COMPAT_VENV)/.installed), not $(COMPAT_TORCH_SPEC): make clean-compat"; exit 2; fi
	$(COMPAT_VENV)/bin/python -c "import torch, lightning, sys; print('test-compat: torch', torch.__version__, 'lightning', lightning.__version__, 'python', sys.version.split()[0])"
	$(COMPAT_VENV)/bin/python -m pytest -p no:cacheprovider -m "not multiprocess" --ignore=tests/test_layers.py tests
	$(COMPAT_VENV)/bin/python -m pytest -p no:cacheprovider $(COMPAT_LAUNCH_TESTS)

clean-compat:
	rm -rf $(COMPAT_VENV)

# Lightning's own tests against our strategies, once with Lightning's strategies and once with each of ours
# (docs/explanations/compatibility.md); Lightning's test sources are found through LIT_PARALLEL_LIGHTNING_TESTS or
# ../shared/lightning-tests. `make test` runs the core files only; CONTRACT_FILES=wide (default: strategy,
# launcher, checkpoint, restore, connector, data-loading, combined-loader and trainer files) or all (every
# file naming DDPStrategy, "ddp" or ModelParallelStrategy: hours on 2 cores).
CONTRACT_FILES ?= wide
contract: install
	$(BIN)/python -m tests.lightning_contract.run --files $(CONTRACT_FILES) --out contract-results

bench: install
	$(BIN)/lit-parallel bench all --out bench-results

# the generated sections first (the rule table, the API reference: docs/hooks/generated_sections.py)
docs: install
	$(BIN)/python docs/hooks/generated_sections.py
	$(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) $(COMPAT_VENV) build *.egg-info .pytest_cache site contract-results
