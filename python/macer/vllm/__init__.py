"""MACER inside vLLM: the ``vllm.general_plugins`` entry point and the plugin's parts (docs/serving.md).

``pip install "macer-kernels[vllm]"`` installs the entry point ``macer = "macer.vllm:register"``; vLLM calls
``register()`` in every process it starts. It registers the MACER architectures with ``ModelRegistry`` lazily (by
"module:Class" string, so nothing heavy is imported until a MACER model is built) and installs the engine-settings
hook (``macer.vllm.checks.MacerEngineHook``) for them. Select one with ``--hf-overrides '{"architectures":
["MacerQwen2_5OmniThinkerForConditionalGeneration"]}'`` (or a checkpoint whose config names it) and configure it with
``--additional-config '{"macer": {...}}'`` (``macer.vllm.settings``).

Modules: one per job, each listed with its job in docs/architecture.md ("The vLLM room, module by module"):
``registry``, ``settings``, ``request_settings``, ``checks``, ``guard``, ``http``, ``model`` (with the thinkers
``qwen2_5_omni`` and ``qwen3_omni``), ``prompt``, ``state``, ``plan``, ``staged``, ``runner``, ``backend``,
``buffers``, ``graphcheck``, ``kv``, ``scheduler``, ``worker``, ``records``, ``parallel``, ``testing``. Built
on ``macer.core``; it never imports the transformers engine (``macer.hf``). Importing this package does not import
vLLM.
"""

from __future__ import annotations

__all__ = ["ARCHITECTURES", "register"]

ARCHITECTURES = {
    "MacerQwen2ForCausalLM": "macer.vllm.model:MacerQwen2ForCausalLM",
    "MacerQwen2_5OmniThinkerForConditionalGeneration":
        "macer.vllm.model:MacerQwen2_5OmniThinkerForConditionalGeneration",
    "MacerQwen3OmniMoeThinkerForConditionalGeneration":
        "macer.vllm.model:MacerQwen3OmniMoeThinkerForConditionalGeneration",
}
"""Architecture name -> "module:Class" registered with vLLM's ``ModelRegistry``."""


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register the MACER architectures and their engine-settings hook, the
    check that refuses MACER settings on every other architecture (``macer.vllm.registry``), and the compacted
    layers' KV cache spec and manager (``macer.vllm.kv``). Idempotent (vLLM may call it more than once per
    process)."""
    from macer.vllm.kv import register_kv
    from macer.vllm.registry import register_architectures
    from macer.vllm.runner import prefer_v1_runner

    register_architectures(ARCHITECTURES)
    register_kv()  # the compacted layers' KV cache spec, in every process that groups or manages KV
    prefer_v1_runner(ARCHITECTURES)  # they choose vLLM's V1 model runner, in every process that reads the choice
