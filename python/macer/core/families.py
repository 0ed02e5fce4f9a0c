"""What a model family's config says, read without a module (no transformers, no vLLM): which prompt rows are audio
or video, which token closes the user's turn, and which model it is (its paper defaults). Both engines read these:
the transformers adapters (``macer.hf.adapters``) and the vLLM architectures (``macer.vllm``) label rows and find the
end-of-turn id here, and ``MacerConfig.for_model`` finds the paper's settings here.

* ``Qwen25Omni`` (``qwen2_5_omni``, ``qwen2_5_omni_thinker``) and ``Qwen3Omni`` (``qwen3_omni_moe``,
  ``qwen3_omni_moe_thinker``): labels from the thinker config's audio / video / image token ids, the end-of-turn id
  from the config (``im_end_token_id``) or the Qwen2 vocabulary's ``<|im_end|>``, the model identified by its text
  sizes, never by depth alone.
* ``LabelSpec``: the labelled path's rows by token-id sets (the vLLM plugin's ``MacerQwen2ForCausalLM``).

``MODEL_TYPE_TO_FAMILY`` maps ``config.model_type`` to its family (``family_for``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from macer.core.policy import AUDIO, TEXT, VISUAL

__all__ = [
    "IM_END",
    "MODEL_TYPE_TO_FAMILY",
    "QWEN2_5_OMNI",
    "QWEN3_OMNI",
    "Family",
    "LabelSpec",
    "Qwen3Omni",
    "Qwen25Omni",
    "QwenOmni",
    "family_for",
    "text_config",
]

IM_END = 151645
"""``<|im_end|>`` of the Qwen2 vocabulary (checked against transformers' constants, see docs/integration.md)."""


def text_config(model_or_config: Any) -> Any:
    """The decoder's (text model's) config of a model or config: through ``.config``, ``thinker_config`` and
    ``get_text_config()``."""
    config = getattr(model_or_config, "config", model_or_config)
    config = getattr(config, "thinker_config", None) or config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


class Family:
    """A model family as its config describes it: the model types it covers, the text sizes that identify each known
    model, and the paper's settings (``MacerConfig`` fields) by model name."""

    model_types: ClassVar[tuple[str, ...]] = ()
    SIZES: ClassVar[dict[str, dict[str, int]]] = {}
    """Model name -> the text config's sizes that identify it."""
    PAPER_DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {}
    """Model name -> the paper's settings (``tab:macer_defaults``)."""
    DERIVED_DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {}
    """Model name -> settings derived (not calibrated) for a known model the paper does not report."""

    def identify(self, model_or_config: Any) -> str | None:
        """The name of a known model (e.g. ``"qwen2.5-omni-7b"``) from its text sizes, or None."""
        text = text_config(model_or_config)
        for name, sizes in self.SIZES.items():
            if all(getattr(text, key, None) == value for key, value in sizes.items()):
                return name
        return None

    def paper_defaults(self, model_or_config: Any) -> dict[str, Any] | None:
        """The paper's settings for this model (``MacerConfig`` fields), or None where the paper has none."""
        name = self.identify(model_or_config)
        fields = None if name is None else self.PAPER_DEFAULTS.get(name)
        return dict(fields) if fields is not None else None

    def derived_defaults(self, model_or_config: Any) -> dict[str, Any] | None:
        """Settings derived for a known model the paper does not report (``MacerConfig.for_model`` uses them with a
        warning), or None."""
        name = self.identify(model_or_config)
        fields = None if name is None else self.DERIVED_DEFAULTS.get(name)
        return dict(fields) if fields is not None else None

    def end_of_turn_token_id(self, config: Any) -> int | None:
        """The id of the token that closes the user's turn, from a model's config, or None if the family cannot
        tell."""
        return None


class QwenOmni(Family):
    """What the Qwen-Omni families share: a full model's config holds the thinker's as ``thinker_config``, modality
    labels come from the thinker config's audio / video / image token ids."""

    FULL_MODEL_TYPE: ClassVar[str] = ""
    """``model_type`` of the full model (talker included), whose config holds the thinker's as ``thinker_config``."""

    def labels(self, thinker_config: Any, input_ids: torch.Tensor) -> torch.Tensor:
        """Modality labels (``TEXT``, ``AUDIO``, ``VISUAL``) of ``input_ids`` (any shape, on their device): audio = the
        thinker config's audio token id, visual = its video or image token id."""
        labels = torch.zeros_like(input_ids)
        labels[input_ids == thinker_config.audio_token_id] = AUDIO
        labels[(input_ids == thinker_config.video_token_id) | (input_ids == thinker_config.image_token_id)] = VISUAL
        return labels


class Qwen25Omni(QwenOmni):
    """Qwen2.5-Omni (7B and 3B in the paper)."""

    model_types = ("qwen2_5_omni", "qwen2_5_omni_thinker")
    FULL_MODEL_TYPE = "qwen2_5_omni"
    SIZES: ClassVar[dict[str, dict[str, int]]] = {
        # The text model's published sizes: a model is identified by all four (plus its model type), never by depth
        # alone.
        "qwen2.5-omni-7b": {"num_hidden_layers": 28, "hidden_size": 3584, "num_attention_heads": 28,
                            "num_key_value_heads": 4},
        "qwen2.5-omni-3b": {"num_hidden_layers": 36, "hidden_size": 2048, "num_attention_heads": 16,
                            "num_key_value_heads": 2},
    }
    PAPER_DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {
        # tab:macer_defaults: (l_a, l_v, alpha, lambda_c), selected once on a held-out split and frozen.
        "qwen2.5-omni-7b": {"audio_layer": 3, "video_layer": 5, "audio_share": 0.30, "coverage_weight": 0.20},
        "qwen2.5-omni-3b": {"audio_layer": 4, "video_layer": 7, "audio_share": 0.32, "coverage_weight": 0.30},
    }

    def end_of_turn_token_id(self, config: Any) -> int | None:
        """The id closing the user's turn from a model's (or thinker's) config, or None."""
        # A config that names its <|im_end|> (macer.testing's synthetic vocabulary; Qwen3-Omni's configs) wins;
        # else the Qwen2 id, if the vocabulary is that large.
        config = getattr(config, "thinker_config", None) or config
        named = getattr(config, "im_end_token_id", None)
        if isinstance(named, int):
            return named
        return IM_END if text_config(config).vocab_size > IM_END else None


class Qwen3Omni(QwenOmni):
    """Qwen3-Omni (not in the paper: derived defaults only)."""

    model_types = ("qwen3_omni_moe", "qwen3_omni_moe_thinker")
    FULL_MODEL_TYPE = "qwen3_omni_moe"
    SIZES: ClassVar[dict[str, dict[str, int]]] = {
        # The thinker's text model (Qwen3-Omni-30B-A3B Instruct / Thinking / Captioner share it).
        "qwen3-omni-30b-a3b": {"num_hidden_layers": 48, "hidden_size": 2048, "num_attention_heads": 32,
                               "num_key_value_heads": 4},
    }
    DERIVED_DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {
        # Not in the paper: readout layers at the paper's depth fractions (7B: 3/28, 5/28; 3B: 4/36, 7/36) of 48
        # layers, audio 5.1-5.3 -> 5, video 8.6-9.3 -> 9; alpha and lambda_c are the 7B values. docs/integration.md
        # has the reasoning; the diagnostics' readout-layer sweep on real weights is how a user confirms them.
        "qwen3-omni-30b-a3b": {"audio_layer": 5, "video_layer": 9, "audio_share": 0.30, "coverage_weight": 0.20},
    }

    def end_of_turn_token_id(self, config: Any) -> int | None:
        """The id closing the user's turn from a model's (or thinker's) config, or None."""
        # The full model's config names <|im_end|> (im_end_token_id); a thinker alone has the Qwen2 vocabulary.
        named = getattr(config, "im_end_token_id", None)
        if isinstance(named, int):
            return named
        return IM_END if text_config(config).vocab_size > IM_END else None


QWEN2_5_OMNI = Qwen25Omni()
QWEN3_OMNI = Qwen3Omni()

MODEL_TYPE_TO_FAMILY: dict[str, Family] = {
    model_type: family for family in (QWEN2_5_OMNI, QWEN3_OMNI) for model_type in family.model_types}
"""``config.model_type`` -> its family (``macer.hf.adapters.register_adapter`` adds an adapter's ``family``)."""


def family_for(model_or_config: Any) -> Family | None:
    """The family of a model or config's ``model_type``, or None."""
    model_type = getattr(getattr(model_or_config, "config", model_or_config), "model_type", None)
    return MODEL_TYPE_TO_FAMILY.get(model_type) if isinstance(model_type, str) else None


@dataclass(frozen=True)
class LabelSpec:
    """Which prompt token ids are audio rows and which are video (or image) rows (the labelled path by token ids).

    Attributes:
        audio_token_ids: sorted, unique ids labelled ``AUDIO``.
        visual_token_ids: sorted, unique ids labelled ``VISUAL``; disjoint from ``audio_token_ids``.
    """

    audio_token_ids: tuple[int, ...]
    visual_token_ids: tuple[int, ...]

    def labels(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``[N]`` int64 labels (``TEXT`` 0, ``AUDIO`` 1, ``VISUAL`` 2) of ``[N]`` prompt ids, on their device."""
        labels = torch.full_like(token_ids, TEXT, dtype=torch.long)
        for label, ids in ((AUDIO, self.audio_token_ids), (VISUAL, self.visual_token_ids)):
            if ids:
                labels[torch.isin(token_ids, torch.tensor(ids, device=token_ids.device))] = label
        return labels
