"""MACER inside vLLM: the ``vllm.general_plugins`` entry point and the plugin's parts (docs/serving.md).

``pip install "macer-kernels[vllm]"`` installs the entry point ``macer = "macer.vllm:register"``; vLLM calls
``register()`` in every process it starts. It registers the MACER architectures with ``ModelRegistry`` lazily (by
"module:Class" string, so nothing heavy is imported until a MACER model is built) and installs the engine-settings
hook (``macer.vllm.checks.MacerEngineHook``) for them. Select one with ``--hf-overrides '{"architectures":
["MacerQwen2_5OmniThinkerForConditionalGeneration"]}'`` (or a checkpoint whose config names it) and configure it with
``--additional-config '{"macer": {...}}'`` (``macer.vllm.settings``).

Modules: ``registry`` (what ``register()`` installs), ``settings`` (the ``"macer"`` settings), ``checks`` (engine
settings and policies refused), ``guard`` (the per-request check), ``records`` (per-request record and log line),
``model`` (the architectures), ``staged`` (the decoder's forward with the stages), ``plan`` (each step's host plan),
``runner`` (the hooks on vLLM's V1 model runner, and the runner a MACER engine asks for), ``graphcheck`` (the load-time
check of FULL decode CUDA graphs), ``prompt`` (row labels and temporal positions), ``backend`` (everything specific to
vLLM's attention backends and metadata), ``testing`` (a tiny checkpoint, tokenizer and prompts built in code). Built
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
        "macer.vllm._qwen3_omni:MacerQwen3OmniMoeThinkerForConditionalGeneration",
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
    register_kv()  # the compacted layers' KV cache spec (issue 29), in every process that groups or manages KV
    prefer_v1_runner(ARCHITECTURES)  # they choose vLLM's V1 model runner, in every process that reads the choice
