# `make test` and `make demo` set up everything they need: a local virtual environment with pinned versions.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test demo lint venv clean

$(STAMP): requirements-ci.txt pyproject.toml setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements-ci.txt
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

venv: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .

test: $(STAMP) lint
	$(BIN)/python -m pytest

demo: $(STAMP)
	$(BIN)/macer demo

clean:
	rm -rf $(VENV) build *.egg-info
