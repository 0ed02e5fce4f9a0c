"""How the plugin enters vLLM's registries (called by ``macer.vllm.register`` in every process vLLM starts):

* the MACER architectures in ``ModelRegistry``, lazily by "module:Class" (nothing heavy is imported until a MACER
  model is built), with ``MacerEngineHook`` as their ``MODELS_CONFIG_MAP`` entry;
* every other registered architecture's ``MODELS_CONFIG_MAP`` entry wrapped by ``checks.guarded_hook``, so that
  ``additional_config["macer"]`` on an engine that would ignore it is refused, not silently served unpruned (an
  architecture registered after this plugin by another one is not covered);
* the Omni thinkers' entries made to say why they cannot be inspected: vLLM inspects a lazily registered class in
  a subprocess and, when that fails, only says "failed to be inspected"; the cause (torchvision, on the CPU build) is
  logged here as one ERROR line.

vLLM interfaces used that are not public: ``ModelRegistry.models`` and ``_LazyRegisteredModel`` (0.32.0).
"""

from __future__ import annotations

import logging
from typing import Any

from vllm import ModelRegistry
from vllm.model_executor.models.config import MODELS_CONFIG_MAP
from vllm.model_executor.models.registry import _LazyRegisteredModel

from macer.vllm.checks import MacerEngineHook, guarded_hook

__all__ = ["ExplainedLazyModel", "register_architectures"]

logger = logging.getLogger("vllm.macer")

IMPORT_MARKER = "ImportError: macer: "
"""How ``macer.vllm.model`` starts the ImportError that names what a MACER class could not import."""


class ExplainedLazyModel(_LazyRegisteredModel):
    """vLLM's lazily registered model, whose failed inspection logs the cause the class's import gave (one line)."""

    def inspect_model_cls(self) -> Any:
        try:
            return super().inspect_model_cls()
        except RuntimeError as error:  # vLLM's wrapper of the inspection subprocess's failure, with its stderr
            causes = [line.removeprefix("ImportError: ") for line in str(error).splitlines()
                      if line.startswith(IMPORT_MARKER)]
            if not causes:
                raise
            logger.error("%s", causes[-1])
            logger.debug("macer: the inspection subprocess of %s:%s failed: %s", self.module_name, self.class_name,
                         error)
            return None  # vLLM then refuses the architecture ("failed to be inspected"), right below that line


def register_architectures(architectures: dict[str, str]) -> None:
    """Register ``architectures`` (name -> "module:Class") and the config hooks; idempotent."""
    supported = set(ModelRegistry.get_supported_archs())
    for architecture, target in architectures.items():
        if architecture not in supported:
            module, name = target.split(":")
            ModelRegistry.models[architecture] = ExplainedLazyModel(module, name)  # register_model's lazy entry
        # vLLM types the map as its VerifyAndUpdateConfig classes; the hook has the same static method.
        MODELS_CONFIG_MAP[architecture] = MacerEngineHook  # type: ignore[assignment]
    for architecture in ModelRegistry.get_supported_archs():
        if architecture not in architectures:
            MODELS_CONFIG_MAP[architecture] = guarded_hook(MODELS_CONFIG_MAP.get(architecture))
