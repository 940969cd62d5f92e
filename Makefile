# Two commands on a fresh machine: `make demo` and `make test`. Each bootstraps .venv itself.
PYTHON ?= python3
VENV   := .venv
STAMP  := $(VENV)/.installed-stamp
BIN    := $(VENV)/bin

.PHONY: demo test check test-vllm protos protos-check venv clean

venv: $(STAMP)

# The C extension (kvroute/prefix_index/_native.c) is built into the tree by the editable install: rebuild on change.
$(STAMP): pyproject.toml kvroute/prefix_index/_native.c
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[tools,dev]'
	# xds-protos (epp) overwrites opentelemetry-proto's and googleapis-common-protos' modules: put theirs back
	$(BIN)/python scripts/restore_shadowed_protos.py
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/kvroute demo

# PYTEST_ARGS: passed on to pytest, e.g. make test PYTEST_ARGS="-k audit -x" (a -m replaces -m 'not vllm').
test: $(STAMP)
	PYTHON=$(BIN)/python scripts/gen_protos.sh --check
	$(BIN)/ruff check
	$(BIN)/pytest $(PYTEST_ARGS)

# The inner loop, under 2 minutes: lint, format, types, and the tests that start no process and use no
# Redis (markers applied from what each test uses: tests/conftest.py). `make test` is what CI runs.
check: $(STAMP)
	$(BIN)/ruff check
	$(BIN)/ruff format --check
	$(BIN)/python -m mypy
	$(BIN)/pytest -q -m "not e2e and not slow and not redis and not vllm" $(PYTEST_ARGS)

# Real vLLM (CPU build) in its own cached virtualenv; see tests/vllm/.
test-vllm: $(STAMP)
	scripts/vllm_venv.sh
	KVROUTE_VLLM_PYTHON="$$(scripts/vllm_venv.sh --print-python)" $(BIN)/pytest -m vllm tests/vllm

protos: $(STAMP)
	PYTHON=$(BIN)/python scripts/gen_protos.sh

clean:
	rm -rf $(VENV) .pytest_cache
