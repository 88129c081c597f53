PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test test-fast test-floor lint bench
$(BIN)/oomless: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@if ! command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q torch==2.13.0; fi
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

setup: $(BIN)/oomless

demo: setup
	$(BIN)/oomless train configs/demo.yaml

# the fast tier and the slow tier as two pytest sessions at once (tests/tiers.py): the
# single-process tests fill the core the launches leave idle
test: setup
	$(BIN)/python tests/tiers.py

# the inner loop: units, in-process engine steps, planner, estimate, docs, architecture, the
# in-process hostile cases and one 2-rank smoke; `make test` (CI) runs these and the slow tier
test-fast: setup
	$(BIN)/python -m pytest -q --durations=15 -m "not slow" tests

# the fast tier again on the lowest transformers pyproject.toml allows (the GPU machines run it),
# in a venv of its own; not part of CI
FLOOR := .venv-floor
test-floor:
	$(PY) -m venv $(FLOOR)
	$(FLOOR)/bin/pip install -q --upgrade pip
	$(FLOOR)/bin/pip install -q -e '.[dev]' $$(sed -n 's/^ *"\(torch\|transformers\)>=\([0-9.]*\),.*/\1==\2/p' pyproject.toml)
	$(FLOOR)/bin/python -m pytest -q --durations=15 -m "not slow" tests

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

bench: setup
	$(BIN)/python -m bench.run_all
