"""The plugin's settings: ``additional_config["macer"]`` parsed into the same policy objects as ``macer.make_policy``.

```
vllm serve CKPT --additional-config '{"macer": {"policy": "macer", "keep_ratio": 0.25}}'
LLM(CKPT, additional_config={"macer": {"policy": "fastv", "keep_ratio": 0.25, "layer": 2}})
```

Every key except the labelling keys below is a field of the policy's class, exactly as ``make_policy(name, model,
**fields)`` takes them: the paper's defaults where the model is recognised (Qwen2.5-Omni 3B/7B, Qwen3-Omni), the same
``ValueError`` for a bad value or an unknown field. ``"policy"`` is one of ``macer.POLICY_NAMES`` (default
``"macer"``).

Labelling keys (the labelled architecture ``MacerQwen2ForCausalLM`` only; the Omni thinker labels its rows from its
own config's audio/video/image token ids):

* ``"audio_token_ids"``, ``"video_token_ids"``: lists of token ids whose rows are audio, resp. video (or image).
  A prompt row whose id is in neither set is text. Temporal positions are the row index (``LabelledAdapter``'s
  default), and the question rows end before the prompt's last ``end_of_turn_token_id`` (a ``MacerConfig`` field;
  the labelled path has no model default, so name it, or use ``"question_span": "prompt_end"``).

Pure Python over ``vllm_config`` attributes: this module does not import vLLM.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from typing import Any

from macer.core.config import decoder_depth
from macer.core.families import LabelSpec, text_config
from macer.core.policies import POLICY_NAMES, FastVConfig, FullConfig, RandomConfig, make_policy
from macer.core.policy import Policy

__all__ = [
    "LABELLED_ARCHITECTURE",
    "LABEL_KEYS",
    "OMNI_THINKER_ARCHITECTURE",
    "SETTINGS_KEY",
    "LabelSpec",
    "policy_from_config",
    "policy_from_settings",
]

SETTINGS_KEY = "macer"
LABELLED_ARCHITECTURE = "MacerQwen2ForCausalLM"
OMNI_THINKER_ARCHITECTURE = "MacerQwen2_5OmniThinkerForConditionalGeneration"
LABEL_KEYS = ("audio_token_ids", "video_token_ids")
_BASELINES = {"full": FullConfig, "fastv": FastVConfig, "random": RandomConfig}  # no per-model defaults


def _token_ids(key: str, value: Any, vocab_size: int | None) -> tuple[int, ...]:
    where = f'additional_config["{SETTINGS_KEY}"]["{key}"]'
    if isinstance(value, str | bytes) or not isinstance(value, list | tuple):
        raise ValueError(f"{where} must be a list of token ids, got {value!r}")
    bad = [v for v in value if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0
           or (vocab_size is not None and v >= vocab_size)]
    if bad:
        bound = f"[0, {vocab_size - 1}] (vocab_size={vocab_size})" if vocab_size is not None else ">= 0"
        raise ValueError(f"{where} must hold integer token ids in {bound}, got {bad[:8]!r}")
    return tuple(sorted({int(v) for v in value}))


def _label_spec(settings: Mapping[str, Any], vocab_size: int | None) -> LabelSpec:
    missing = [key for key in LABEL_KEYS if key not in settings]
    if len(missing) == len(LABEL_KEYS):
        raise ValueError(f'{LABELLED_ARCHITECTURE} labels prompt rows by token id: additional_config["{SETTINGS_KEY}"] '
                         f"must name at least one of {list(LABEL_KEYS)} (lists of token ids)")
    audio = _token_ids("audio_token_ids", settings.get("audio_token_ids", []), vocab_size)
    visual = _token_ids("video_token_ids", settings.get("video_token_ids", []), vocab_size)
    both = sorted(set(audio) & set(visual))
    if both:
        raise ValueError(f'additional_config["{SETTINGS_KEY}"]: audio_token_ids and video_token_ids must be disjoint; '
                         f"both hold {both[:8]}")
    return LabelSpec(audio, visual)


def policy_from_settings(settings: Any, hf_config: Any, architecture: str) -> tuple[Policy, LabelSpec | None]:
    """``(policy, labels)`` from the ``"macer"`` settings of one engine (see the module docstring).

    Args:
        settings: the ``additional_config["macer"]`` value (a JSON object; None or absent = all defaults).
        hf_config: the engine's model config (``vllm_config.model_config.hf_config``): the model the paper's defaults
            and the depth checks are read from.
        architecture: the resolved architecture; ``LABELLED_ARCHITECTURE`` takes the labelling keys, any other
            refuses them and gets ``labels=None`` (its rows are labelled by the model itself).
    """
    settings = {} if settings is None else settings
    if not isinstance(settings, Mapping):
        raise ValueError(f'additional_config["{SETTINGS_KEY}"] must be a JSON object of settings, got '
                         f"{type(settings).__name__} {settings!r}")
    params = dict(settings)
    name = params.pop("policy", "macer")
    if name not in POLICY_NAMES:
        raise ValueError(f'additional_config["{SETTINGS_KEY}"]["policy"]: unknown policy {name!r}; known: '
                         f"{list(POLICY_NAMES)}")
    text = text_config(hf_config)
    vocab_size = getattr(text, "vocab_size", None)
    vocab_size = vocab_size if isinstance(vocab_size, int) else None
    labels: LabelSpec | None = None
    if architecture == LABELLED_ARCHITECTURE:
        labels = _label_spec(params, vocab_size)
    elif any(key in params for key in LABEL_KEYS):
        raise ValueError(f'additional_config["{SETTINGS_KEY}"]: {list(LABEL_KEYS)} are settings of '
                         f"{LABELLED_ARCHITECTURE}; {architecture} labels its rows from its own config's token ids")
    for key in LABEL_KEYS:
        params.pop(key, None)
    baseline = _BASELINES.get(name)
    if baseline is None:
        # MACER and its ablations start from the paper's defaults for a recognised model (make_policy(name, model)).
        policy = make_policy(name, hf_config, **params)
    else:
        # make_policy would raise TypeError from the dataclass for an unknown field: name it and the allowed ones.
        allowed = [f.name for f in dataclasses.fields(baseline)]
        unknown = sorted(set(params) - set(allowed))
        if unknown:
            raise ValueError(f'additional_config["{SETTINGS_KEY}"]: policy {name!r} ({baseline.__name__}) has no '
                             f"field {unknown}; allowed: {allowed}")
        policy = make_policy(name, **params)
    policy.check_depth(decoder_depth(hf_config))
    eot = policy.end_of_turn_token_id
    if eot is not None and vocab_size is not None and eot >= vocab_size:
        raise ValueError(f'additional_config["{SETTINGS_KEY}"]["end_of_turn_token_id"]={eot} is outside this '
                         f"model's vocabulary (vocab_size={vocab_size}); pass the id of the token that closes the "
                         "user's question")
    return policy, labels


def policy_from_config(vllm_config: Any) -> tuple[Policy, LabelSpec | None]:
    """``(policy, labels)`` of an engine: ``policy_from_settings`` on ``vllm_config.additional_config["macer"]``,
    the model's ``hf_config`` and its resolved architecture."""
    model_config = vllm_config.model_config
    additional = vllm_config.additional_config or {}
    if not isinstance(additional, Mapping):
        raise ValueError(f"additional_config must be a JSON object holding a {SETTINGS_KEY!r} entry, got "
                         f"{type(additional).__name__}")
    return policy_from_settings(additional.get(SETTINGS_KEY), model_config.hf_config, model_config.architecture)
