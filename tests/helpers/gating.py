"""What this machine can run, read once without initialising CUDA: the gates of the ``cuda``, ``triton`` and
``vllm`` markers (tests/conftest.py) and of the tests that choose a path by them. Test modules import these names
from here, never from ``conftest`` (each room's ``conftest.py`` is a module named ``conftest`` too)."""

from __future__ import annotations

import importlib.util
import shutil

__all__ = ["HAS_GPU", "HAS_TRITON", "HAS_VLLM"]

# nvidia-smi's presence is a cheap proxy that does not initialise CUDA in this process.
HAS_GPU = shutil.which("nvidia-smi") is not None
HAS_TRITON = importlib.util.find_spec("triton") is not None
# vLLM lives in its own environment (`make test-vllm` builds .venv-vllm); `make test`'s .venv has none.
HAS_VLLM = importlib.util.find_spec("vllm") is not None
