"""The plugin's settings: ``additional_config["macer"]`` parsed into the same policy objects as ``macer.make_policy``.

```
vllm serve CKPT --additional-config '{"macer": {"policy": "macer", "keep_ratio": 0.25}}'
LLM(CKPT, additional_config={"macer": {"policy": "fastv", "keep_ratio": 0.25, "layer": 2}})
```

Every key except the labelling keys below is a field of the policy's class, exactly as ``make_policy(name, model,
**fields)`` takes them: the paper's defaults where the model is recognised (Qwen2.5-Omni 3B/7B, Qwen3-Omni), the same
checks of each value. ``"policy"`` is one of ``macer.POLICY_NAMES`` (default ``"macer"``).

Labelling keys (the labelled architecture ``MacerQwen2ForCausalLM`` only; the Omni thinker labels its rows from its
own config's audio/video/image token ids):

* ``"audio_token_ids"``, ``"video_token_ids"``: lists of token ids whose rows are audio, resp. video (or image).
  A prompt row whose id is in neither set is text. Temporal positions are the row index (``LabelledAdapter``'s
  default), and the question rows end before the prompt's last ``end_of_turn_token_id`` (a ``MacerConfig`` field;
  the labelled path has no model default, so name it, or use ``"question_span": "prompt_end"``).

An engine whose own policy is ``"full"`` (pruning off, requests opt in with ``macer_policy``) may also carry MACER's
fields (``audio_layer``, ``video_layer``, ``end_of_turn_token_id``, ...) for those requests; it frees no KV memory,
since its own policy drops nothing (``macer.vllm.kv``). A policy carries the name it was asked by (``named``), so
records say ``"no_coverage"``, not the class's ``"macer"``.

Engine keys (not fields of the policy): ``"free_kv"`` (bool, default true): the layers after the engine policy's
last stage allocate KV cache blocks for the rows each request keeps, not for its whole prompt (``macer.vllm.kv``);
false allocates every layer's blocks for the whole prompt, as vLLM's own model does.

Everything that can be checked before an engine starts is checked here, and all of it at once: ``Refusal`` (a
``ValueError``) lists every refused setting, one line each, each naming ``additional_config["macer"]`` and the key.
The checks of single values (``validate_policy_name``, ``validate_keep_ratio``, ``validate_token_ids``,
``validate_end_of_turn``) are public so that per-request settings get the same messages.

Pure Python over ``vllm_config`` attributes: this module does not import vLLM.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from macer.core.config import MacerConfig, decoder_depth
from macer.core.families import QWEN2_5_OMNI, QWEN3_OMNI, LabelSpec, QwenOmni, text_config
from macer.core.policies import POLICY_NAMES, FastVConfig, FullConfig, RandomConfig, make_policy
from macer.core.policy import Policy

__all__ = [
    "ENGINE_KEYS",
    "LABELLED_ARCHITECTURE",
    "LABEL_KEYS",
    "MACER_ARCHITECTURES",
    "OMNI_THINKER_ARCHITECTURE",
    "QWEN3_OMNI_THINKER_ARCHITECTURE",
    "SETTINGS_KEY",
    "WHERE",
    "LabelSpec",
    "Refusal",
    "architecture_end_of_turn",
    "free_kv",
    "misplaced_settings",
    "named",
    "policy_from_config",
    "policy_from_settings",
    "policy_problems",
    "thinker_family",
    "validate_end_of_turn",
    "validate_keep_ratio",
    "validate_policy_name",
    "validate_token_ids",
]

SETTINGS_KEY = "macer"
WHERE = f'additional_config["{SETTINGS_KEY}"]'
"""How every refusal of a setting names where it was set."""
LABELLED_ARCHITECTURE = "MacerQwen2ForCausalLM"
OMNI_THINKER_ARCHITECTURE = "MacerQwen2_5OmniThinkerForConditionalGeneration"
QWEN3_OMNI_THINKER_ARCHITECTURE = "MacerQwen3OmniMoeThinkerForConditionalGeneration"
_THINKER_FAMILIES: dict[str, QwenOmni] = {OMNI_THINKER_ARCHITECTURE: QWEN2_5_OMNI,
                                        QWEN3_OMNI_THINKER_ARCHITECTURE: QWEN3_OMNI}
"""The thinker architectures, each with the model family whose config labels its rows."""
MACER_ARCHITECTURES = (LABELLED_ARCHITECTURE, *_THINKER_FAMILIES)
"""The architectures the plugin registers (``macer.vllm.ARCHITECTURES`` maps them to their classes)."""
LABEL_KEYS = ("audio_token_ids", "video_token_ids")
ENGINE_KEYS = ("free_kv",)
"""Settings of the engine rather than of its policy (a request cannot set them)."""
_CLASSES: dict[str, type[Policy]] = {"full": FullConfig, "fastv": FastVConfig,
                                    "random": RandomConfig}  # the rest: MacerConfig's fields
_BASELINES = frozenset(_CLASSES)  # no per-model defaults: make_policy(name, **fields) without the model


class Refusal(ValueError):
    """Settings a MACER engine cannot run under: every one found, one line each (``problems``). With one problem the
    message is that line; with several, a header line and one indented line per problem."""

    def __init__(self, problems: Sequence[str], subject: str = "macer"):
        self.problems = tuple(problems)
        if len(self.problems) == 1:
            text = self.problems[0]
        else:
            text = (f"{subject} cannot start: {len(self.problems)} settings refused (all of them listed, fix each):\n"
                    + "\n".join(f"  - {problem}" for problem in self.problems))
        super().__init__(text)


# ----------------------------------------------------------------------------------------- single values
def validate_policy_name(value: Any, where: str = f'{WHERE}["policy"]') -> str:
    """``value`` if it is one of ``macer.POLICY_NAMES``, else ``ValueError`` naming ``where`` and the names."""
    if not isinstance(value, str) or value not in POLICY_NAMES:
        raise ValueError(f"{where}: unknown policy {value!r}; known: {list(POLICY_NAMES)}")
    return value


def validate_keep_ratio(value: Any, where: str = f'{WHERE}["keep_ratio"]', policy: str = "macer") -> float:
    """``value`` as a float if ``policy`` accepts it as its keep ratio: a finite real number in (0, 1], exactly 1.0
    for ``"full"``, never a bool; else ``ValueError`` naming ``where``, worded as the policy classes' own check."""
    real = not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)
    if policy == "full":
        if not real or value != 1.0:
            raise ValueError(f"{where} must be 1.0 (a real number: full keeps everything), got {value!r}")
    elif not real or not 0.0 < value <= 1.0:
        raise ValueError(f"{where} must be a finite real number in (0.0, 1.0], got {value!r}")
    return float(value)


def validate_token_ids(value: Any, where: str, vocab_size: int | None) -> tuple[int, ...]:
    """Sorted unique ids of a list of token ids, each an integer in ``[0, vocab_size - 1]`` (``>= 0`` when the
    vocabulary is unknown); else ``ValueError`` naming ``where``, the range and the first bad ids."""
    if isinstance(value, str | bytes) or not isinstance(value, list | tuple):
        raise ValueError(f"{where} must be a list of token ids, got {value!r}")
    bad = [v for v in value if not _is_id(v, vocab_size)]
    if bad:
        raise ValueError(f"{where} must hold integer token ids in {_id_range(vocab_size)}, got {bad[:8]!r}")
    return tuple(sorted({int(v) for v in value}))


def validate_end_of_turn(value: Any, where: str = f'{WHERE}["end_of_turn_token_id"]',
                         vocab_size: int | None = None) -> int:
    """``value`` if it is a token id of the model's vocabulary (``[0, vocab_size - 1]``); else ``ValueError``."""
    if not _is_id(value, None):
        raise ValueError(f"{where} must be a token id (an integer in {_id_range(vocab_size)}), got {value!r}")
    if not _is_id(value, vocab_size):
        raise ValueError(f"{where}={value} is outside this model's vocabulary (vocab_size={vocab_size}); pass the id "
                         "of the token that closes the user's question")
    return int(value)


def _is_id(value: Any, vocab_size: int | None) -> bool:
    return (not isinstance(value, bool) and isinstance(value, numbers.Integral) and int(value) >= 0
            and (vocab_size is None or int(value) < vocab_size))


def _id_range(vocab_size: int | None) -> str:
    return f"[0, {vocab_size - 1}] (vocab_size={vocab_size})" if vocab_size is not None else ">= 0"


# ----------------------------------------------------------------------------------------- the settings
def _vocab_size(hf_config: Any) -> int | None:
    size = getattr(text_config(hf_config), "vocab_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) else None


_OPT_IN = tuple(f.name for f in dataclasses.fields(MacerConfig) if f.init and f.name != "keep_ratio")
"""The MACER fields an engine whose own policy is ``"full"`` may carry for the requests that opt in to MACER or an
ablation (``macer_policy``); the engine itself prunes nothing."""


def _allowed_keys(name: str, architecture: str) -> list[str]:
    cls: Any = _CLASSES.get(name, MacerConfig)  # a policy dataclass
    labels = list(LABEL_KEYS) if architecture == LABELLED_ARCHITECTURE else []
    opt_in = list(_OPT_IN) if name == "full" else []
    return ["policy", *(f.name for f in dataclasses.fields(cls) if f.init), *opt_in, *labels, *ENGINE_KEYS]


def named(policy: Policy, name: str) -> Policy:
    """``policy`` carrying the name it was asked for (``make_policy``'s ``name``), which its records and log lines
    show: an ablation is a ``MacerConfig`` (``"no_coverage"``, ``"macer_raw"``, ``"single_readout"``) or a
    ``FastVConfig`` (``"shared_topk"``), whose class names say ``"macer"`` / ``"fastv"``. An instance attribute over
    the class's ``name``: not a field, so it changes neither equality nor the policy's behaviour."""
    if policy.name != name:
        object.__setattr__(policy, "name", name)
    return policy


def _opt_in_problems(params: Mapping[str, Any], num_layers: int) -> list[str]:
    """What is wrong with the MACER fields a ``"full"`` engine carries for opt-in requests (``_OPT_IN``): each value
    as ``MacerConfig`` checks it, the layers against the decoder's depth. Missing ones are not a problem here (a
    request that opts in is refused then, naming them)."""
    fields = {key: value for key, value in params.items() if key in _OPT_IN}
    if not fields:
        return []
    try:
        MacerConfig(**{"audio_layer": 1, "video_layer": 1, **fields}).check_depth(num_layers)
    except (ValueError, TypeError) as error:
        return [f"{WHERE}: {error} (a setting for the requests that opt in to MACER on this engine)"]
    return []


def _unknown_key(key: str, name: str, allowed: list[str]) -> str:
    close = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.75)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{WHERE}: policy {name!r} has no setting {key!r}{hint}; allowed: {allowed}"


def _label_problems(params: Mapping[str, Any], vocab_size: int | None,
                    end_of_turn: int | None) -> tuple[LabelSpec | None, list[str]]:
    """The labelled architecture's row labels from the settings' token-id sets, and what is wrong with them."""
    if not any(key in params for key in LABEL_KEYS):
        return None, [f"{LABELLED_ARCHITECTURE} labels prompt rows by token id: {WHERE} must name at least one of "
                      f"{list(LABEL_KEYS)} (lists of token ids)"]
    ids, problems = {}, []
    for key in LABEL_KEYS:
        try:
            ids[key] = validate_token_ids(params.get(key, []), f'{WHERE}["{key}"]', vocab_size)
        except ValueError as error:
            problems.append(str(error))
    if problems:
        return None, problems
    audio, visual = ids["audio_token_ids"], ids["video_token_ids"]
    both = sorted(set(audio) & set(visual))
    if both:
        problems.append(f"{WHERE}: audio_token_ids and video_token_ids must be disjoint; both hold {both[:8]}")
    if not audio and not visual:
        problems.append(f"{WHERE}: audio_token_ids and video_token_ids name no token id between them, so no prompt "
                        "row would be audio or video and nothing would ever be pruned: name the ids of the audio "
                        "and/or video placeholder tokens")
    for key, held in (("audio_token_ids", audio), ("video_token_ids", visual)):
        if end_of_turn is not None and end_of_turn in held:
            problems.append(f'{WHERE}["{key}"] holds end_of_turn_token_id={end_of_turn}: the token closing the '
                            "user's question would be a media row after the question, so the plan would refuse "
                            "every prompt and each would run unpruned; take it out of the list")
    return (None if problems else LabelSpec(audio, visual)), problems


def free_kv(settings: Any) -> bool:
    """Whether an engine with these ``"macer"`` settings frees the dropped rows' KV blocks (``"free_kv"``, default
    true; ``policy_from_settings`` refuses a value that is not a bool)."""
    return not isinstance(settings, Mapping) or settings.get("free_kv", True) is not False


def thinker_family(architecture: str) -> QwenOmni | None:
    """The model family whose config labels a thinker architecture's rows (None: the labelled architecture)."""
    return _THINKER_FAMILIES.get(architecture)


def architecture_end_of_turn(hf_config: Any, architecture: str) -> int | None:
    """The end-of-turn id an architecture finds by itself when the settings name none: a Qwen-Omni thinker's
    ``<|im_end|>`` (``macer.vllm.prompt.omni_prompt_labels`` reads the same), none on the labelled path."""
    family = _THINKER_FAMILIES.get(architecture)
    return None if family is None else family.end_of_turn_token_id(hf_config)


_TRIM_EARLY_CACHE = (f'{WHERE}["trim_early_cache"]=true is not supported inside vLLM (the early layers\' KV pages '
                     "keep every prompt token); leave it false")


def policy_problems(policy: Policy, end_of_turn_token_id: int | None) -> list[str]:
    """What the engine cannot serve of a valid policy as the transformers runtime would (an error at a prefill would
    stop the engine, not just the request):

    * ``trim_early_cache=True``: the early layers' pages would have to be compacted after the prefill (not done).
    * question rows read before an unknown end-of-turn token (``question_span="end_of_turn"`` with no
      ``end_of_turn_token_id`` from the settings or the model).
    """
    problems = []
    if policy.trim_early_cache:
        problems.append(_TRIM_EARLY_CACHE)
    reads_question = any(spec.needs_scores and spec.query == "question" for spec in policy.stage_specs(1, 1))
    if reads_question and policy.question_span == "end_of_turn" and end_of_turn_token_id is None:
        problems.append(f'{WHERE}: the question rows end before the end-of-turn token, which this model does not name: '
                        'set "end_of_turn_token_id" (the id closing the user\'s question), or "question_span": '
                        '"prompt_end" to read the prompt\'s last query_tokens tokens')
    return problems


def policy_from_settings(settings: Any, hf_config: Any, architecture: str) -> tuple[Policy, LabelSpec | None]:
    """``(policy, labels)`` from the ``"macer"`` settings of one engine (see the module docstring); ``Refusal``
    listing every problem found.

    Args:
        settings: the ``additional_config["macer"]`` value (a JSON object; None or absent = all defaults).
        hf_config: the engine's model config (``vllm_config.model_config.hf_config``): the model the paper's defaults,
            the depth checks and the vocabulary are read from.
        architecture: the resolved architecture; ``LABELLED_ARCHITECTURE`` takes the labelling keys, any other
            refuses them and gets ``labels=None`` (its rows are labelled by the model itself).
    """
    settings = {} if settings is None else settings
    if not isinstance(settings, Mapping):
        raise Refusal([f"{WHERE} must be a JSON object of settings, got {type(settings).__name__} {settings!r}"])
    params = dict(settings)
    name = params.pop("policy", "macer")
    try:
        validate_policy_name(name)
    except ValueError as error:
        raise Refusal([str(error)]) from None
    problems: list[str] = []
    free = params.pop("free_kv", True)
    if not isinstance(free, bool):
        problems.append(f'{WHERE}["free_kv"] must be true or false (free the KV cache blocks of the rows the stages '
                        f"drop), got {free!r}")
    vocab_size = _vocab_size(hf_config)
    labelled = architecture == LABELLED_ARCHITECTURE
    if not labelled and any(key in params for key in LABEL_KEYS):
        problems.append(f"{WHERE}: {list(LABEL_KEYS)} are settings of {LABELLED_ARCHITECTURE}; {architecture} labels "
                        "its rows from its own config's token ids")
    allowed = _allowed_keys(name, architecture)
    unknown = [key for key in params if key not in allowed and key not in LABEL_KEYS]
    problems += [_unknown_key(key, name, allowed) for key in unknown]
    named_end = params.get("end_of_turn_token_id") if "end_of_turn_token_id" in allowed else None
    end_ok = True
    if named_end is not None:
        try:
            validate_end_of_turn(named_end, vocab_size=vocab_size)
        except ValueError as error:
            problems.append(str(error))
            end_ok = False
    labels = None
    if labelled:
        labels, found = _label_problems(params, vocab_size, named_end if end_ok else None)
        problems += found
    if params.get("trim_early_cache") is True and "trim_early_cache" in allowed:
        problems.append(_TRIM_EARLY_CACHE)  # also when no policy can be built from the rest
    # The policy from the known fields, a refused end-of-turn id left out: make_policy then reports what else is wrong
    # (each problem once).
    fields = {key: value for key, value in params.items() if key in allowed and key not in LABEL_KEYS
              and (end_ok or key != "end_of_turn_token_id")}
    if name == "full":  # the opt-in requests' MACER fields: checked, not the engine's own policy's
        problems += _opt_in_problems(fields, decoder_depth(hf_config))
        fields = {key: value for key, value in fields.items() if key not in _OPT_IN}
    try:
        # MACER and its ablations start from the paper's defaults for a recognised model (make_policy(name, model));
        # the baselines have none.
        policy = make_policy(name, **fields) if name in _BASELINES else make_policy(name, hf_config, **fields)
        policy.check_depth(decoder_depth(hf_config))
        policy = named(policy, name)
    except (ValueError, TypeError) as error:
        policy = None
        problems.append(f"{WHERE}: {error}")
    if policy is not None:
        # The id the engine will close the question at; a named but refused one is not "unknown".
        end = policy.end_of_turn_token_id
        end = end if end is not None else named_end if named_end is not None else architecture_end_of_turn(
            hf_config, architecture)
        problems += [problem for problem in policy_problems(policy, end) if problem not in problems]
    if problems:
        raise Refusal(problems, f"{architecture} (macer)")
    assert policy is not None
    return policy, labels


def _near_miss(key: Any) -> bool:
    """A top-level key that is ``"macer"`` misspelt: equal after case and punctuation, or one edit away (a letter
    added, dropped, changed, or two swapped)."""
    if not isinstance(key, str) or key == SETTINGS_KEY:
        return False
    word = "".join(ch for ch in key.lower() if ch.isalnum())
    return word == SETTINGS_KEY or _edits(word, SETTINGS_KEY) <= 1


def _edits(a: str, b: str) -> int:
    """Optimal string alignment distance (Levenshtein with adjacent swaps)."""
    rows = [[i + j if not i * j else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            rows[i][j] = min(rows[i - 1][j] + 1, rows[i][j - 1] + 1, rows[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                rows[i][j] = min(rows[i][j], rows[i - 2][j - 2] + 1)
    return rows[len(a)][len(b)]


def _macer_architecture_for(hf_config: Any) -> str:
    model_type = getattr(hf_config, "model_type", None)
    for architecture, family in _THINKER_FAMILIES.items():
        if model_type in family.model_types:
            return architecture
    if model_type == "qwen2":
        return LABELLED_ARCHITECTURE
    return ""


def misplaced_settings(additional_config: Any, architecture: str | None, hf_config: Any) -> list[str]:
    """Settings that would be silently ignored: a misspelt top-level ``"macer"`` key, and ``"macer"`` settings on an
    engine whose architecture is not one of ``MACER_ARCHITECTURES`` (it would serve every prompt unpruned)."""
    if not isinstance(additional_config, Mapping):
        return []
    near = [key for key in additional_config if _near_miss(key)]
    ours = architecture in MACER_ARCHITECTURES
    problems = []
    if near:
        fix = (f"rename it to {SETTINGS_KEY!r}" if SETTINGS_KEY not in additional_config
               else f"drop it ({WHERE} is set beside it)")
        problems.append(f"additional_config holds {near[0]!r}, a misspelling of {SETTINGS_KEY!r} that MACER would not "
                        f"read: {fix}")
    if not ours and (SETTINGS_KEY in additional_config or near):
        suggested = _macer_architecture_for(hf_config)
        model_type = getattr(hf_config, "model_type", None)
        if suggested:
            how = (f"select MACER's architecture for it with --hf-overrides '{{\"architectures\": [\"{suggested}\"]}}' "
                   f"(LLM(..., hf_overrides={{\"architectures\": [\"{suggested}\"]}}))")
        else:
            how = (f"MACER serves {list(MACER_ARCHITECTURES)} only (a Qwen2 decoder whose audio/video rows are named "
                   f"by token ids, the Qwen2.5-Omni and Qwen3-Omni thinkers), and this model (model_type "
                   f"{model_type!r}) is none of them")
        problems.append(f"{WHERE} is set, but this engine's architecture {architecture} is not a MACER architecture "
                        f"and would serve every prompt unpruned: {how}, or drop {WHERE}")
    return problems


def policy_from_config(vllm_config: Any) -> tuple[Policy, LabelSpec | None]:
    """``(policy, labels)`` of an engine: ``policy_from_settings`` on ``vllm_config.additional_config["macer"]``,
    the model's ``hf_config`` and its resolved architecture (``Refusal`` for every problem found)."""
    model_config = vllm_config.model_config
    additional = vllm_config.additional_config or {}
    if not isinstance(additional, Mapping):
        raise Refusal([f"additional_config must be a JSON object holding a {SETTINGS_KEY!r} entry, got "
                       f"{type(additional).__name__}"])
    architecture = model_config.architecture
    problems = misplaced_settings(additional, architecture, model_config.hf_config)
    try:
        policy, labels = policy_from_settings(additional.get(SETTINGS_KEY), model_config.hf_config, architecture)
    except Refusal as refusal:
        problems += refusal.problems
    if problems:
        raise Refusal(problems, f"{architecture} (macer)")
    return policy, labels
