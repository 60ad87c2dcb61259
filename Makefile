# make demo : train a built-in model on 2 CPU worker processes (installs what it needs)
# make test : run the test suite (installs what it needs)
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/pipetrain train --model mlp --workers 2 --config 1-1 --schedule pipedream --steps 60 --batch-size 32 --lr 0.01 --momentum 0.9 --option num_classes=10 --log-every 10

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

bench: $(STAMP)
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf $(VENV) build *.egg-info
