"""Test environment only (``make test-vllm`` installs this file and ``macer_torchvision_ops.pth`` into .venv-vllm's
site-packages): lets torchvision's pure-Python parts import beside the CPU torch build.

The registry's torchvision 0.28.0 (the release paired with torch 2.13.0) links CUDA libraries that
``torch 2.13.0+cpu`` lacks, so its compiled ops (``torchvision._C``) do not load. ``import torchvision`` then fails
in ``torchvision/_meta_registrations.py``, which registers fake kernels for ``torchvision::nms`` and
``torchvision::qnms`` whether or not the compiled ops loaded, and registering a kernel for an op that nobody declared
raises. This module declares those two schemas (torchvision's own, from its C++ registration) just before that file
runs, and only when ``torchvision.extension._has_ops()`` says the compiled ops did not load. Nothing else changes:
torchvision's compiled detection ops stay unavailable (calling one raises), its Python transforms work, and those are
all that transformers' Qwen2-VL / Qwen2.5-Omni image and video processors use, through which vLLM's Qwen-Omni thinker
modules import torchvision.

The ``.pth`` line imports this module at interpreter start in every process of the environment (vLLM's engine
worker processes included); it only inserts an import hook, and imports torch only when torchvision is imported.
"""

from __future__ import annotations

import importlib.abc
import sys

_TARGET = "torchvision._meta_registrations"
_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_library = None  # the torch.library.Library holding the declarations: the schemas live as long as it does


class _DeclareOpsFirst(importlib.abc.MetaPathFinder):
    """Finds nothing; on the first import of ``torchvision._meta_registrations`` it declares the op schemas
    (when torchvision's compiled ops did not load) and removes itself, leaving the import to the other finders."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _TARGET:
            return None
        global _library
        sys.meta_path.remove(self)
        extension = sys.modules.get("torchvision.extension")
        if extension is not None and not extension._has_ops():
            import torch

            _library = torch.library.Library("torchvision", "DEF")
            for schema in _SCHEMAS:
                _library.define(schema)
        return None


if not any(isinstance(finder, _DeclareOpsFirst) for finder in sys.meta_path):
    sys.meta_path.insert(0, _DeclareOpsFirst())
