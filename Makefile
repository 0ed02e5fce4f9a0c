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

# `make wheel`: a binary wheel in $(WHEEL_DIR) with macer_kernels._C built for CUDA_ARCHS (SASS for each, plus PTX
# for the highest); it links no libtorch, so one wheel per Python version serves every torch. Without nvcc, or with
# MACER_NO_CUDA=1, the wheel is pure Python. The CMake build tree under build/ is shared with `make test`'s install.
CUDA_ARCHS ?= 89;90
WHEEL_DIR ?= dist

.PHONY: wheel
wheel: $(STAMP)
	MACER_CUDA_ARCHS="$(CUDA_ARCHS)" $(BIN)/python -m pip wheel -q --no-deps --no-build-isolation -w $(WHEEL_DIR) .
	@ls -1 $(WHEEL_DIR)/macer_kernels-*.whl
