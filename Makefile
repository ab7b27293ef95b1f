PYTHON ?= python3
# Another Transformers release than constraints.txt's (the newest), in a venv of its own:
# `make test-fast TRANSFORMERS=5.24.0`; `make test-oldest` is the oldest release pyproject.toml allows.
TRANSFORMERS ?=
OLDEST := $(shell sed -n 's/.*"transformers>=\([0-9.]*\),.*/\1/p' pyproject.toml)
VENV := .venv$(if $(TRANSFORMERS),-transformers-$(TRANSFORMERS))
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-fast test-oldest lint bench models llamacpp clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, from the pinned CPU build, so the project's `torch` requirement pulls nothing bigger
	$(BIN)/python -m pip install -q torch==2.13.0
	sed '$(if $(TRANSFORMERS),s/^transformers==.*/transformers==$(TRANSFORMERS)/)' constraints.txt > $(VENV)/constraints.txt
	$(BIN)/python -m pip install -q -c $(VENV)/constraints.txt -e ".[test,bench]"
	touch $(STAMP)

setup: $(STAMP)

models: $(STAMP)
	$(BIN)/hf-specdec models fetch

demo: models
	$(BIN)/hf-specdec demo

# every test: the tiny-model ones one process per core (each on one thread, so a lone process would leave the other
# cores idle), then the real pair's in one process on every thread (two processes would load it twice)
test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -n auto --durations=25 -m "not real" tests
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=10 -m real tests

# the inner loop: the core's tests without the real models, the benchmark harness and end-to-end CLI runs, one
# process per core (pytest-xdist; each tiny-model test runs on one thread)
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -n auto --durations=10 -m "not slow and not real" tests

# the fast tier on the oldest Transformers release pyproject.toml allows (its own venv)
test-oldest:
	$(MAKE) test-fast TRANSFORMERS=$(OLDEST)

# optional: the llama.cpp reference row of `hf-specdec bench` (pip compiles llama.cpp once and caches the wheel)
llamacpp: $(STAMP)
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[llamacpp]"

bench: $(STAMP)
	$(BIN)/hf-specdec bench --quick

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports

clean:
	rm -rf .venv .venv-transformers-* build *.egg-info
