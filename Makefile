# `make test` and `make demo` set up everything they need: a local virtual environment with pinned versions.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test demo lint venv clean

# One line per setup step; pip's and setuptools' output goes to $(LOG), printed only when a step fails.
LOG := $(VENV)/setup.log
quietly = $(1) >>$(LOG) 2>&1 || { echo "macer setup: that step failed; the end of $(LOG):"; tail -n 40 $(LOG); exit 1; }

$(STAMP): requirements-ci.txt requirements-eval.txt pyproject.toml setup.py
	@if [ ! -x $(BIN)/python ]; then echo "macer setup: creating $(VENV) with $$($(PYTHON) --version)"; \
		$(PYTHON) -m venv $(VENV) || exit 1; fi
	@: > $(LOG)
	@echo "macer setup: upgrading pip"
	@$(call quietly,$(BIN)/python -m pip install -q --upgrade pip)
	@echo "macer setup: installing pinned requirements-ci.txt (torch CPU, transformers, triton; first time: a few minutes)"
	@$(call quietly,$(BIN)/python -m pip install -q -r requirements-ci.txt)
	@echo "macer setup: installing lmms-eval 0.7.3 and the packages its evaluator imports (requirements-eval.txt, --no-deps)"
	@$(call quietly,$(BIN)/python -m pip install -q --no-deps -r requirements-eval.txt)
	@echo "macer setup: installing macer-kernels (editable), building the CUDA extension if nvcc is found (about a minute)"
	@$(call quietly,$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .)
	@$(BIN)/python -c "import importlib.util as u; print('macer setup: CUDA extension', 'built' if \
		u.find_spec('macer_kernels._C') else 'not built (MACER_NO_CUDA=1 or no nvcc): PyTorch and Triton paths only')"
	@touch $@
	@echo "macer setup: done ($(VENV) is reused from now on; pip's output is in $(LOG))"

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
