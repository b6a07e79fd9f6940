# Two commands for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# A plain `torch` requirement pulls a multi-GB CUDA build; install the CPU build explicitly first.
TORCH_SPEC ?= torch==2.13.0
export OMP_NUM_THREADS ?= 1

.PHONY: install demo test check lint format bench docs clean contract

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

# Lightning's own tests against our strategies, once with Lightning's strategies and once with each of ours
# (docs/compatibility.md); Lightning's test sources are found through LIT_PARALLEL_LIGHTNING_TESTS or
# ../shared/lightning-tests. `make test` runs the core files only; CONTRACT_FILES=wide (default: strategy,
# launcher, checkpoint and restore files, ~20 min on 2 cores) or all (every file naming DDPStrategy, "ddp" or
# ModelParallelStrategy: hours on 2 cores).
CONTRACT_FILES ?= wide
contract: install
	$(BIN)/python -m tests.lightning_contract.run --files $(CONTRACT_FILES) --out contract-results

bench: install
	$(BIN)/lit-parallel bench all --out bench-results

docs: install
	$(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache site contract-results
