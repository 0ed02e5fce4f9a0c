"""The ``lmms_eval.models`` entry point: ``--model macer_qwen2_5_omni`` (pyproject.toml names ``manifests``).

lmms-eval 0.7.3 finds third-party models only through this entry-point group (its ``@register_model`` dict is not
read by ``--model``). ``manifests`` is called by lmms-eval while it builds its registry, so importing lmms_eval
inside it is safe; the model class itself is imported only when the model is used.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MODEL_ID", "manifests"]

MODEL_ID = "macer_qwen2_5_omni"


def manifests() -> list[Any]:
    """The ``ModelManifest`` of ``macer_qwen2_5_omni`` (a simple, non-chat lmms-eval model)."""
    from lmms_eval.models.registry_v2 import ModelManifest

    return [ModelManifest(model_id=MODEL_ID, simple_class_path="macer.eval.lmms_model.MacerQwen2_5Omni")]
