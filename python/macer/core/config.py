"""``MacerConfig``: the settings of one MACER run (the ``"macer"`` policy), with the paper's defaults per model
(``tab:macer_defaults``), found by model identity through the model's family (``macer.core.families``)."""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Any

from macer.core.checks import field_bool, field_choice, field_int, field_real
from macer.core.families import MODEL_TYPE_TO_FAMILY, family_for, text_config
from macer.core.policy import AUDIO, QUESTION_SPANS, SCORINGS, VISUAL, Policy, Scoring, Selection, StageSpec
from macer_kernels import Budget
from macer_kernels.split_budget import exact_ratio, split_budget_exact

__all__ = ["PAPER_DEFAULTS", "MacerConfig", "decoder_depth", "paper_defaults"]


class _PaperDefaults(dict):
    """``{model name: MacerConfig fields}``. Keyed by model identity; a depth key fails with a pointer (the table
    used to be keyed by depth, which gave any 28-layer model Omni-7B's layers)."""

    def _refuse(self, key: object) -> None:
        if isinstance(key, int) and not isinstance(key, bool):
            raise KeyError(f"macer.PAPER_DEFAULTS is keyed by model name ({sorted(self)}), not by decoder depth "
                           f"({key}); use macer.paper_defaults(model) or MacerConfig.for_model(model)")

    def __getitem__(self, key: object) -> Any:
        self._refuse(key)
        return super().__getitem__(key)

    def get(self, key: object, default: Any = None) -> Any:
        self._refuse(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self._refuse(key)
        return super().__contains__(key)


def _collect_defaults() -> _PaperDefaults:
    table = _PaperDefaults()
    for family in MODEL_TYPE_TO_FAMILY.values():
        table.update(family.PAPER_DEFAULTS)
    return table


PAPER_DEFAULTS: dict[str, dict[str, Any]] = _collect_defaults()
"""The paper's frozen per-model settings (``tab:macer_defaults``), by model name (``"qwen2.5-omni-7b"``, ...)."""




@dataclass(frozen=True)
class MacerConfig(Policy):
    """Settings of MACER's staged pruning inside one prefill (Sec. 4, Appendix B, ``tab:macer_algorithm``); the
    ``"macer"`` policy of ``macer.compress``.

    Defaults are the paper's Qwen2.5-Omni-7B values; ``MacerConfig.for_model`` picks the values for the model.
    Every field is validated on construction; errors name the field and the allowed range. The README lists the
    fields with their ranges; ``docs/integration.md`` maps the paper's ablations to settings.

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
        end_of_turn_token_id: id of the token that closes the user's question, or None (default) for the model's own
            (``<|im_end|>``: 151645 in the Qwen2 vocabulary; ``macer.testing`` models name theirs), from its adapter.
            If it does not occur in a prompt, ``compress`` raises instead of guessing.
        question_span: ``"end_of_turn"`` (default: the rows before the last end-of-turn token) or ``"prompt_end"``
            (the prompt's last ``query_tokens`` tokens, for prompts without a chat template's end-of-turn token).
        scoring: ``"anms"`` (default, ``eq:macer_score``) or ``"raw"`` (the ablation without per-modality
            renormalisation: the attention probability averaged over heads and question rows).
        trim_early_cache: also remove the dropped tokens from the KV caches of the layers before each stage after
            prefill (smaller decode memory; not the paper's setting, which keeps those caches full).
    """

    name = "macer"

    keep_ratio: float = 0.25
    audio_share: float = 0.30
    audio_layer: int = 3
    video_layer: int = 5
    coverage_weight: float = 0.20
    num_chunks: int = 8
    query_tokens: int = 4
    eps: float = 1e-6
    end_of_turn_token_id: int | None = None
    trim_early_cache: bool = False
    question_span: str = "end_of_turn"
    scoring: Scoring = "anms"

    def __post_init__(self) -> None:
        owner, setattr_ = "MacerConfig", object.__setattr__  # frozen: normalise the validated values in place
        setattr_(self, "keep_ratio", field_real(owner, "keep_ratio", self.keep_ratio, 0.0, 1.0, lo_open=True))
        setattr_(self, "audio_share", field_real(owner, "audio_share", self.audio_share, 0.0, 1.0))
        setattr_(self, "audio_layer", field_int(owner, "audio_layer", self.audio_layer, 1))
        setattr_(self, "video_layer", field_int(owner, "video_layer", self.video_layer, 1))
        setattr_(self, "coverage_weight", field_real(owner, "coverage_weight", self.coverage_weight, 0.0, math.inf))
        setattr_(self, "num_chunks", field_int(owner, "num_chunks", self.num_chunks, 1))
        setattr_(self, "query_tokens", field_int(owner, "query_tokens", self.query_tokens, 1))
        setattr_(self, "eps", field_real(owner, "eps", self.eps, 0.0, math.inf))
        if self.end_of_turn_token_id is not None:
            setattr_(self, "end_of_turn_token_id",
                     field_int(owner, "end_of_turn_token_id", self.end_of_turn_token_id, 0))
        field_bool(owner, "trim_early_cache", self.trim_early_cache)
        field_choice(owner, "question_span", self.question_span, QUESTION_SPANS)
        field_choice(owner, "scoring", self.scoring, SCORINGS)

    @property
    def stage_layers(self) -> tuple[int, int]:
        """``(audio_layer, video_layer)``, 1-based."""
        return self.audio_layer, self.video_layer

    @property
    def prune_layer(self) -> int:
        """``L_p = max(l_a, l_v)`` of the paper's cost model (no credit for the earlier stage)."""
        return max(self.audio_layer, self.video_layer)

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

    def budget(self, n_audio: int, n_video: int) -> Budget:
        # macer_kernels.split_budget on the validated fields, without its checks: integer arithmetic on the ratios'
        # exact decimal values (read once per value).
        return split_budget_exact(n_audio, n_video, exact_ratio(self.keep_ratio), exact_ratio(self.audio_share))

    def stage_specs(self, n_audio: int, n_video: int) -> list[StageSpec]:
        if not n_audio + n_video:
            return []
        return self._specs(self.budget(n_audio, n_video), n_audio, n_video)

    def budget_and_specs(self, n_audio: int, n_video: int) -> tuple[Budget, list[StageSpec]]:
        if type(self).stage_specs is not MacerConfig.stage_specs:  # a subclass's own stages
            return super().budget_and_specs(n_audio, n_video)
        budget = self.budget(n_audio, n_video)
        return budget, (self._specs(budget, n_audio, n_video) if n_audio + n_video else [])

    def _specs(self, budget: Budget, n_audio: int, n_video: int) -> list[StageSpec]:
        audio = (Selection((AUDIO,), budget.audio),) if n_audio else ()
        video = (Selection((VISUAL,), budget.video, "coverage", self.coverage_weight, self.num_chunks),) \
            if n_video else ()
        a, v = self.audio_layer, self.video_layer
        if a == v:  # one stage: audio's selection first
            return [StageSpec(a, audio + video, self.scoring)]
        stages = ((a, audio), (v, video)) if a < v else ((v, video), (a, audio))
        return [StageSpec(layer, selections, self.scoring) for layer, selections in stages if selections]

    def replace(self, **changes: Any) -> MacerConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def for_model(cls, model_or_config: Any, **overrides: Any) -> MacerConfig:
        """The paper's defaults for this model, then ``overrides``.

        The model is identified by its model type and text-model sizes (``macer.core.families``): Qwen2.5-Omni-7B
        gets ``(l_a, l_v, alpha, lambda_c) = (3, 5, 0.30, 0.20)``, 3B ``(4, 7, 0.32, 0.30)`` (``tab:macer_defaults``).
        Qwen3-Omni-30B-A3B (48 layers, not in the paper) gets ``(5, 9, 0.30, 0.20)``, derived from the paper's depth
        fractions, with a ``UserWarning`` saying so (``docs/integration.md``).
        For any other model the paper has no calibrated layers: pass ``audio_layer`` and ``video_layer``
        explicitly (the other fields then take the class defaults, the 7B values, unless overridden). For the
        random-weight models of ``macer.testing``, ``macer.testing.macer_config_for(model, ...)`` does that.

        Args:
            model_or_config: a model (full Qwen2.5-Omni, its thinker, ...) or its config.
            overrides: any ``MacerConfig`` field, e.g. ``keep_ratio=0.25``.
        """
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"MacerConfig.for_model got unknown fields {sorted(unknown)}; allowed: "
                             f"{[f.name for f in dataclasses.fields(cls)]}")
        depth = decoder_depth(model_or_config)
        defaults = paper_defaults(model_or_config)
        derived = _derived_defaults(model_or_config) if defaults is None else None
        if defaults is not None:
            config = cls(**{**defaults, **overrides})
        elif derived is not None:
            name, fields = derived
            if not {"audio_layer", "video_layer"} <= set(overrides):
                warnings.warn(
                    f"MacerConfig.for_model: {name} is not in the paper; its defaults {fields} are derived from the "
                    "paper's depth fractions (docs/integration.md), not the paper's calibrated values. Confirm the "
                    "readout layers with the diagnostics' readout-layer sweep on real weights (macer diagnose).",
                    UserWarning, stacklevel=2)
            config = cls(**{**fields, **overrides})
        elif "audio_layer" in overrides and "video_layer" in overrides:
            config = cls(**overrides)
        else:
            raise ValueError(
                f"MacerConfig.for_model: the paper's defaults exist for {sorted(PAPER_DEFAULTS)} only; this model "
                f"({_describe(model_or_config)}) is none of them: pass audio_layer= and video_layer= explicitly "
                "(for a macer.testing model: macer.testing.macer_config_for(model, ...))")
        config.check_depth(depth)
        return config


def _derived_defaults(model_or_config: Any) -> tuple[str, dict[str, Any]] | None:
    """(model name, settings) the family derived for a known model the paper does not report, or None."""
    family = family_for(model_or_config)
    fields = family.derived_defaults(model_or_config) if family is not None else None
    name = None if family is None or fields is None else family.identify(model_or_config)
    return None if name is None or fields is None else (name, fields)


def paper_defaults(model_or_config: Any) -> dict[str, Any] | None:
    """The paper's ``MacerConfig`` settings for a model it reports (identified by model type and text-model sizes
    through the model's family), or None."""
    family = family_for(model_or_config)
    return family.paper_defaults(model_or_config) if family is not None else None


def _describe(model_or_config: Any) -> str:
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    text = text_config(model_or_config)
    sizes = {k: getattr(text, k, None) for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                                   "num_key_value_heads")}
    return f"model_type {model_type!r}, " + ", ".join(f"{k}={v}" for k, v in sizes.items())


def decoder_depth(model_or_config: Any) -> int:
    """Number of decoder layers of a model or config (through ``.config``, ``thinker_config``, ``text_config``)."""
    text = text_config(model_or_config)
    depth = getattr(text, "num_hidden_layers", None)
    if not isinstance(depth, int):
        raise ValueError(f"cannot find the decoder depth (num_hidden_layers) of {type(model_or_config).__name__}")
    return depth
