# taogate: two commands on a fresh machine.
#   make demo   emulated vLLM fleet + gateway: SDK checks, bench --compare, diagnose
#   make check  lint, types, tests (what CI runs)
#   make real   only the real-vLLM tier (tests/real: installs vLLM into .real-vllm/ on first use)
#   make bench  the benchmarks that print the README's figures (minutes; not part of check)
#   make compiled        the hot path compiled to C by mypyc, as a wheel in dist/ (minutes)
#   make check-compiled  the tests that run the compiled wheel (CI runs it after check)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo check lint types test real bench clean lock compiled check-compiled

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/taogate demo

check: lint types test

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks deploy
	$(BIN)/ruff format --check src tests benchmarks deploy

types: $(STAMP)
	$(BIN)/mypy

test: $(STAMP)
	$(BIN)/pytest

real: $(STAMP)
	$(BIN)/pytest tests/real

bench: $(STAMP)
	$(BIN)/python benchmarks/overhead.py
	$(BIN)/python benchmarks/dispatch.py
	$(BIN)/python benchmarks/soak.py
	$(BIN)/python benchmarks/hostile.py
	$(BIN)/python benchmarks/diagnose_runs.py
	$(BIN)/python benchmarks/emulator_figures.py

# The compiled wheel. hatch-mypyc writes its extensions beside the sources, where the editable
# install would import them in place of an edited .py, so it builds from a copy of the tracked files.
COMPILED := build/compiled
compiled: $(STAMP)
	rm -rf $(COMPILED) dist/taogate-*.whl && mkdir -p $(COMPILED)/tree dist
	git ls-files -z | xargs -0 cp --parents -t $(COMPILED)/tree
	cd $(COMPILED)/tree && HATCH_BUILD_HOOKS_ENABLE=1 $(abspath $(BIN))/pip wheel --quiet --no-deps -w $(abspath dist) .
	cd $(COMPILED) && mkdir site && cd site && $(abspath $(BIN))/python -m zipfile -e $(abspath dist)/taogate-*.whl .

# The tiers that hold the compiled build to the Python one, run on the unpacked wheel (the container
# image's build: picker mode behind Envoy too).
check-compiled: compiled
	TAOGATE_EXPECT_COMPILED=1 PYTHONPATH=$(abspath $(COMPILED))/site $(BIN)/pytest tests/unit tests/transport tests/e2e tests/hostile tests/envoy

# Regenerate the pinned versions after changing dependencies in pyproject.toml.
lock: $(STAMP)
	$(BIN)/python -m pip list --format=freeze --exclude-editable | grep -vE '^(taogate|py-spy|pip)==' > constraints.txt

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
