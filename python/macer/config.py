"""``MacerConfig``: the settings of one MACER run, with the paper's scale-specific defaults (``tab:macer_defaults``)."""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any

__all__ = ["PAPER_DEFAULTS", "MacerConfig", "decoder_depth"]

PAPER_DEFAULTS: dict[int, dict[str, Any]] = {
    # decoder depth -> Table tab:macer_defaults (Qwen2.5-Omni-7B has 28 decoder layers, 3B has 36).
    28: {"audio_layer": 3, "video_layer": 5, "audio_share": 0.30, "coverage_weight": 0.20},
    36: {"audio_layer": 4, "video_layer": 7, "audio_share": 0.32, "coverage_weight": 0.30},
}
"""The paper's frozen per-scale settings, keyed by the number of decoder layers (28 = 7B, 36 = 3B)."""


def _check_int(name: str, value: object, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < lo:
        raise ValueError(f"MacerConfig.{name} must be an integer >= {lo}, got {value!r}")
    return int(value)


def _check_real(name: str, value: object, lo: float, hi: float, *, lo_open: bool = False) -> float:
    interval = f"{'(' if lo_open else '['}{lo}, {hi}{')' if math.isinf(hi) else ']'}"
    ok = not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)
    if ok:
        ok = (value > lo if lo_open else value >= lo) and value <= hi
    if not ok:
        raise ValueError(f"MacerConfig.{name} must be a finite real number in {interval}, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class MacerConfig:
    """Settings of MACER's staged pruning inside one prefill (Sec. 4, Appendix B, ``tab:macer_algorithm``).

    Defaults are the paper's Qwen2.5-Omni-7B values; ``MacerConfig.for_model`` picks the values for the model's scale.
    Every field is validated on construction; errors name the field and the allowed range.

    Attributes:
        keep_ratio: rho in (0, 1], the share of the prompt's audio + video tokens kept (``K_mm``, Sec. 4).
        audio_share: alpha in [0, 1], the retained-audio share of ``K_mm`` (``eq:capacity_nominal``).
        audio_layer: l_a >= 1, counted from 1: audio scores are read from the attention inside the ``audio_layer``-th
            decoder layer (``layers[audio_layer - 1]``) and dropped audio tokens are gone from ``layers[audio_layer]``
            on. Must be below the model's depth (checked when the model is known).
        video_layer: l_v >= 1, the same for video (and image) tokens. Any order of the two layers is allowed; equal
            layers prune both modalities after that layer.
        coverage_weight: lambda_c >= 0 of the video chunk-coverage greedy (``eq:chunk_coverage_greedy``); 0 = top-k.
        num_chunks: C >= 1 temporal chunks of the video tokens (from the temporal M-RoPE row).
        query_tokens: |Q| >= 1, the question rows whose attention is read: the last ``query_tokens`` tokens before the
            prompt's last end-of-turn token (Appendix B: "the last K = 4 tokens of the question span").
        eps: epsilon >= 0 of ``eq:macer_score``.
        end_of_turn_token_id: id of the end-of-turn token that closes the user's question (``<|im_end|>`` = 151645
            in the Qwen2.5 vocabulary), or None to read the question span from the last tokens of the prompt.
        trim_early_cache: also remove the dropped tokens from the KV caches of the layers before each stage after
            prefill (smaller decode memory; not the paper's setting, which keeps those caches full).
    """

    keep_ratio: float = 0.25
    audio_share: float = 0.30
    audio_layer: int = 3
    video_layer: int = 5
    coverage_weight: float = 0.20
    num_chunks: int = 8
    query_tokens: int = 4
    eps: float = 1e-6
    end_of_turn_token_id: int | None = 151645
    trim_early_cache: bool = False

    def __post_init__(self) -> None:
        setattr_ = object.__setattr__  # frozen dataclass: normalise the validated values in place
        setattr_(self, "keep_ratio", _check_real("keep_ratio", self.keep_ratio, 0.0, 1.0, lo_open=True))
        setattr_(self, "audio_share", _check_real("audio_share", self.audio_share, 0.0, 1.0))
        setattr_(self, "audio_layer", _check_int("audio_layer", self.audio_layer, 1))
        setattr_(self, "video_layer", _check_int("video_layer", self.video_layer, 1))
        setattr_(self, "coverage_weight", _check_real("coverage_weight", self.coverage_weight, 0.0, math.inf))
        setattr_(self, "num_chunks", _check_int("num_chunks", self.num_chunks, 1))
        setattr_(self, "query_tokens", _check_int("query_tokens", self.query_tokens, 1))
        setattr_(self, "eps", _check_real("eps", self.eps, 0.0, math.inf))
        if self.end_of_turn_token_id is not None:
            setattr_(self, "end_of_turn_token_id", _check_int("end_of_turn_token_id", self.end_of_turn_token_id, 0))
        if not isinstance(self.trim_early_cache, bool):
            raise ValueError(f"MacerConfig.trim_early_cache must be True or False, got {self.trim_early_cache!r}")

    @property
    def stage_layers(self) -> tuple[int, int]:
        """``(audio_layer, video_layer)``, 1-based."""
        return self.audio_layer, self.video_layer

    def check_depth(self, num_layers: int) -> None:
        """Raise ``ValueError`` unless both readout layers lie in ``[1, num_layers - 1]`` (a later layer must exist
        for the pruned sequence to enter)."""
        for name in ("audio_layer", "video_layer"):
            value = getattr(self, name)
            if not 1 <= value <= num_layers - 1:
                raise ValueError(
                    f"MacerConfig.{name} must be in [1, {num_layers - 1}] for a decoder with {num_layers} layers "
                    f"(layers are counted from 1 and pruning needs a later layer), got {value}"
                )

    def replace(self, **changes: Any) -> MacerConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def for_model(cls, model_or_config: Any, **overrides: Any) -> MacerConfig:
        """The paper's defaults for the model's scale, then ``overrides``.

        Qwen2.5-Omni-7B (28 decoder layers): ``(l_a, l_v, alpha, lambda_c) = (3, 5, 0.30, 0.20)``;
        3B (36 layers): ``(4, 7, 0.32, 0.30)`` (``tab:macer_defaults``). For any other depth the paper has no
        calibrated layers: pass ``audio_layer`` and ``video_layer`` explicitly (the other fields then take the class
        defaults, the 7B values, unless overridden).

        Args:
            model_or_config: a model (full Qwen2.5-Omni, its thinker, or anything with a text config) or its config.
            overrides: any ``MacerConfig`` field, e.g. ``keep_ratio=0.25``.
        """
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"MacerConfig.for_model got unknown fields {sorted(unknown)}; allowed: "
                             f"{[f.name for f in dataclasses.fields(cls)]}")
        depth = decoder_depth(model_or_config)
        if depth in PAPER_DEFAULTS:
            config = cls(**{**PAPER_DEFAULTS[depth], **overrides})
        elif "audio_layer" in overrides and "video_layer" in overrides:
            config = cls(**overrides)
        else:
            raise ValueError(
                f"MacerConfig.for_model: the paper's defaults exist for decoders of 28 layers (Qwen2.5-Omni-7B) and "
                f"36 layers (3B); this model has {depth}: pass audio_layer= and video_layer= explicitly"
            )
        config.check_depth(depth)
        return config


def decoder_depth(model_or_config: Any) -> int:
    """Number of decoder layers of a model or config (through ``.config``, ``thinker_config``, ``text_config``)."""
    config = getattr(model_or_config, "config", model_or_config)
    config = getattr(config, "thinker_config", None) or config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    depth = getattr(text, "num_hidden_layers", None)
    if not isinstance(depth, int):
        raise ValueError(f"cannot find the decoder depth (num_hidden_layers) of {type(model_or_config).__name__}")
    return depth
