"""The baselines and ablations next to ``MacerConfig`` (``macer.core.config``), and ``make_policy`` to pick one by name.

Every policy is accepted by ``macer.compress(model, policy)`` and records its budget and kept sets in the trace.
``docs/integration.md`` ("Policies") maps the paper's ``tab:main`` and ``tab:ablation`` rows to these settings.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal

from macer.core.checks import field_bool, field_choice, field_int, field_real
from macer.core.config import MacerConfig
from macer.core.policy import AUDIO, QUESTION_SPANS, VISUAL, Policy, Selection, StageSpec
from macer_kernels import Budget
from macer_kernels.split_budget import exact_ratio, split_budget_exact

__all__ = ["ABLATIONS", "ABLATION_FIELDS", "POLICY_NAMES", "FastVConfig", "FullConfig", "RandomConfig", "make_policy",
           "policy_class"]

_MEDIA = (AUDIO, VISUAL)
_HALF = Fraction(1, 2)


def _joint_budget(n_audio: int, n_video: int, keep_ratio: float) -> Budget:
    # K_mm as MACER's (split_budget's rounding); the audio/video split is whatever the joint selection picks, so it
    # is unknown before the selection runs (the trace's record reports the split that was kept).
    total = split_budget_exact(n_audio, n_video, exact_ratio(keep_ratio), _HALF).total
    return Budget(total, None, None)  # type: ignore[arg-type]


@dataclass(frozen=True)
class FullConfig(Policy):
    """No pruning (the ``"full"`` row of ``tab:main``): the trace records the prompt and its full layer lengths."""

    name = "full"
    keep_ratio: float = 1.0

    def __post_init__(self) -> None:
        value = self.keep_ratio  # True == 1.0 in Python: a bool (or a non-number) is refused by type first
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or value != 1.0:
            raise ValueError(f"FullConfig.keep_ratio must be 1.0 (a real number: full keeps everything), got "
                             f"{value!r}")
        object.__setattr__(self, "keep_ratio", 1.0)

    @property
    def prune_layer(self) -> int:
        return 0

    def budget(self, n_audio: int, n_video: int) -> Budget:
        return Budget(n_audio + n_video, n_audio, n_video)

    def stage_specs(self, n_audio: int, n_video: int) -> list[StageSpec]:
        return []


@dataclass(frozen=True)
class FastVConfig(Policy):
    """FastV (Chen et al., 2024) on the omni prompt: one stage after decoder layer ``layer`` (1-based, as MACER's
    layers) keeps one joint top-``K_mm`` of the audio and visual tokens by the raw attention probability each
    receives, averaged over heads and the query rows; ties go to the lower index; text is always kept.

    Attributes:
        keep_ratio: rho in (0, 1]; ``K_mm`` as MACER's (``split_budget``'s total).
        layer: the readout layer, in ``[1, L - 1]``. FastV's paper prunes after layer 2; ``tab:main`` charges its
            FastV rows as if ``L_p = 5`` (``macer.cost.FASTV_PRUNE_LAYER``).
        query: ``"last"`` (the prompt's final row, as FastV; ``query_tokens`` is then unused) or ``"question"``
            (MACER's question rows: the shared top-K ablation).
        query_tokens, end_of_turn_token_id, question_span: the question rows, as in ``MacerConfig``.
        trim_early_cache: as in ``MacerConfig``.
    """

    name = "fastv"
    keep_ratio: float
    layer: int
    query: Literal["question", "last"] = "last"
    query_tokens: int = 4
    end_of_turn_token_id: int | None = None
    question_span: str = "end_of_turn"
    trim_early_cache: bool = False

    def __post_init__(self) -> None:
        owner, setattr_ = "FastVConfig", object.__setattr__
        setattr_(self, "keep_ratio", field_real(owner, "keep_ratio", self.keep_ratio, 0.0, 1.0, lo_open=True))
        setattr_(self, "layer", field_int(owner, "layer", self.layer, 1))
        field_choice(owner, "query", self.query, ("last", "question"))
        setattr_(self, "query_tokens", field_int(owner, "query_tokens", self.query_tokens, 1))
        if self.end_of_turn_token_id is not None:
            setattr_(self, "end_of_turn_token_id",
                     field_int(owner, "end_of_turn_token_id", self.end_of_turn_token_id, 0))
        field_choice(owner, "question_span", self.question_span, QUESTION_SPANS)
        field_bool(owner, "trim_early_cache", self.trim_early_cache)

    @property
    def prune_layer(self) -> int:
        return self.layer

    def check_depth(self, num_layers: int) -> None:
        if not 1 <= self.layer <= num_layers - 1:
            raise ValueError(f"FastVConfig.layer must be in [1, {num_layers - 1}] for a decoder with {num_layers} "
                             f"layers (layers are counted from 1 and pruning needs a later layer), got {self.layer}")

    def budget(self, n_audio: int, n_video: int) -> Budget:
        return _joint_budget(n_audio, n_video, self.keep_ratio)

    def stage_specs(self, n_audio: int, n_video: int) -> list[StageSpec]:
        if not n_audio + n_video:
            return []
        k = self.budget(n_audio, n_video).total
        return [StageSpec(self.layer, (Selection(_MEDIA, k),), "raw", self.query)]

    def replace(self, **changes: Any) -> FastVConfig:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class RandomConfig(Policy):
    """Random pruning (the ``"random"`` row of ``tab:main``): before the first decoder layer, keep a uniformly
    random ``K_mm``-subset of the audio and visual tokens (``K_mm`` as MACER's). The subset is drawn on the CPU with
    ``torch.Generator().manual_seed(seed)`` (``randperm`` of the prompt's audio/visual positions), so a seed gives
    the same tokens on every device and every run.

    Attributes:
        keep_ratio: rho in (0, 1].
        seed: integer in ``[0, 2**63)``.
    """

    name = "random"
    keep_ratio: float = 0.25
    seed: int = 0

    def __post_init__(self) -> None:
        owner = "RandomConfig"
        object.__setattr__(self, "keep_ratio",
                           field_real(owner, "keep_ratio", self.keep_ratio, 0.0, 1.0, lo_open=True))
        object.__setattr__(self, "seed", field_int(owner, "seed", self.seed, 0))
        if self.seed >= 2**63:
            raise ValueError(f"RandomConfig.seed must be an integer in [0, 2**63), got {self.seed}")

    @property
    def prune_layer(self) -> int:
        return 0

    def budget(self, n_audio: int, n_video: int) -> Budget:
        return _joint_budget(n_audio, n_video, self.keep_ratio)

    def stage_specs(self, n_audio: int, n_video: int) -> list[StageSpec]:
        if not n_audio + n_video:
            return []
        k = self.budget(n_audio, n_video).total
        return [StageSpec(0, (Selection(_MEDIA, k, "random", seed=self.seed),))]

    def replace(self, **changes: Any) -> RandomConfig:
        return dataclasses.replace(self, **changes)


ABLATIONS: dict[str, str] = {
    "macer_raw": "MacerConfig(scoring='raw'): no per-modality renormalisation of the attention",
    "shared_topk": "FastVConfig(layer=video_layer, query='question'): one shared top-K over audio and video",
    "no_coverage": "MacerConfig(coverage_weight=0): video by plain top-k",
    "single_readout": "MacerConfig(audio_layer=video_layer): both modalities read at the video layer",
}
"""The paper's ablations (``tab:ablation``) by ``make_policy`` name, with the setting each one is."""

POLICY_NAMES = ("full", "macer", "fastv", "random", *ABLATIONS)

ABLATION_FIELDS: dict[str, tuple[str, ...]] = {"macer_raw": ("scoring",), "no_coverage": ("coverage_weight",),
                                               "single_readout": ("audio_layer",)}
"""The ``MacerConfig`` fields an ablation sets itself (``make_policy`` refuses them as parameters)."""


_CLASSES: dict[str, type] = {"full": FullConfig, "fastv": FastVConfig, "random": RandomConfig}


def policy_class(name: str) -> type:
    """The class whose fields ``make_policy(name, ...)`` takes (``MacerConfig`` for MACER and the ablations)."""
    if name not in POLICY_NAMES:
        raise ValueError(f"make_policy: unknown policy {name!r}; known: {list(POLICY_NAMES)}")
    return _CLASSES.get(name, MacerConfig)


def _check_params(name: str, params: dict[str, Any]) -> None:
    """Unknown and missing fields of the class ``name`` is built from, named before the dataclass's bare TypeError
    (which names no policy and, for an ablation, a class the caller never wrote)."""
    cls = policy_class(name)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    unknown = sorted(set(params) - {f.name for f in fields})
    if unknown:
        hint = ""
        if name == "shared_topk":
            hint = (" (shared_topk is FastVConfig(layer=video_layer, query='question') built from MACER's fields: its "
                    "readout layer is video_layer)")
        raise TypeError(f"make_policy({name!r}) got unknown parameters {unknown}; it takes the fields of "
                        f"{cls.__name__}: {[f.name for f in fields]}{hint}")
    missing = [f.name for f in fields if f.name not in params and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise TypeError(f"make_policy({name!r}) needs {missing} ({cls.__name__} has no default for them), e.g. "
                        f"make_policy({name!r}, " + ", ".join(f"{m}=..." for m in missing) + ")")


def make_policy(name: str, model: Any = None, **params: Any) -> Policy:
    """A policy by name, for code that picks policies from a string (an evaluation wrapper, a command line).

    Args:
        name: one of ``POLICY_NAMES``: ``"full"``, ``"macer"``, ``"fastv"``, ``"random"`` or an ablation of
            ``ABLATIONS`` (``"macer_raw"``, ``"shared_topk"``, ``"no_coverage"``, ``"single_readout"``).
        model: optional; MACER and the ablations then start from ``MacerConfig.for_model(model)`` (the paper's
            defaults for that model), else from ``MacerConfig()``'s defaults (the 7B values).
        params: fields of the policy's class (``MacerConfig`` for MACER and the ablations except
            ``shared_topk``, which takes MACER fields and reads ``keep_ratio``, ``video_layer`` and the question
            settings from them; ``FastVConfig`` needs ``keep_ratio`` and ``layer``; ``RandomConfig``).
    """
    if name not in POLICY_NAMES:
        raise ValueError(f"make_policy: unknown policy {name!r}; known: {list(POLICY_NAMES)}")
    _check_params(name, params)
    if name == "full":
        return FullConfig(**params)
    if name == "fastv":
        return FastVConfig(**params)
    if name == "random":
        return RandomConfig(**params)
    ablations: dict[str, dict[str, Any]] = {"macer_raw": {"scoring": "raw"}, "no_coverage": {"coverage_weight": 0.0}}
    fixed = ablations.get(name, {})
    clash = sorted(set(ABLATION_FIELDS.get(name, ())) & set(params))
    if clash:
        raise ValueError(f"make_policy({name!r}) sets {clash} itself ({ABLATIONS[name]}); do not pass them")
    if name == "single_readout" and "video_layer" in params:
        # The single readout layer given: both stages read there (a model without the paper's layers needs this).
        params = {**params, "audio_layer": params["video_layer"]}
    base = MacerConfig.for_model(model, **params) if model is not None else MacerConfig(**params)
    if name == "shared_topk":
        return FastVConfig(keep_ratio=base.keep_ratio, layer=base.video_layer, query="question",
                           query_tokens=base.query_tokens, end_of_turn_token_id=base.end_of_turn_token_id,
                           question_span=base.question_span, trim_early_cache=base.trim_early_cache)
    if name == "single_readout":
        return base.replace(audio_layer=base.video_layer)
    return base.replace(**fixed)
