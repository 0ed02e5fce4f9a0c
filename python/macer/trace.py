"""What one ``macer.compress`` context did: budgets, kept tokens, sequence lengths per layer, cache sizes."""

from __future__ import annotations

from dataclasses import dataclass, field

from macer_kernels import Budget

__all__ = ["PrefillRecord", "Stage", "Trace"]


@dataclass
class Stage:
    """One pruning stage of a prefill.

    Attributes:
        layer: readout layer, 1-based (scores read inside ``layers[layer - 1]``; tokens gone from ``layers[layer]``).
        modalities: ``("audio",)``, ``("video",)`` or both when the two readout layers are equal.
        tokens_before, tokens_after: sequence length entering and leaving the stage.
    """

    layer: int
    modalities: tuple[str, ...]
    tokens_before: int
    tokens_after: int


@dataclass
class PrefillRecord:
    """One pruned (or, without audio/video, unpruned) prefill.

    Attributes:
        prompt_length: N, the prompt's token count.
        n_audio, n_video: audio and visual (video + image) token counts of the prompt.
        budget: ``macer_kernels.Budget`` from ``split_budget`` on those counts (None when nothing is pruned).
        query_positions: 0-based prompt positions of the question rows whose attention was read.
        audio_kept, video_kept: sorted 0-based prompt positions of the kept audio / visual tokens.
        layer_tokens: sequence length entering each decoder layer.
        cache_lengths: KV-cache length of each layer right after the prefill (empty without a cache).
        stages: the stages in the order they ran.
        overhead_s: seconds spent in MACER's own work (scoring, selection, compaction); measured with device
            synchronisation only under ``compress(..., profile=True)``, else None.
    """

    prompt_length: int
    n_audio: int
    n_video: int
    budget: Budget | None
    query_positions: list[int]
    audio_kept: list[int] = field(default_factory=list)
    video_kept: list[int] = field(default_factory=list)
    layer_tokens: list[int] = field(default_factory=list)
    cache_lengths: list[int] = field(default_factory=list)
    stages: list[Stage] = field(default_factory=list)
    overhead_s: float | None = None

    @property
    def pruned(self) -> bool:
        """Whether any audio or visual token was dropped."""
        return len(self.audio_kept) < self.n_audio or len(self.video_kept) < self.n_video


class Trace:
    """Returned by ``macer.compress``: one ``PrefillRecord`` per prefill run inside the context (``history``); the
    attributes below read the last one (``None`` / empty before the first prefill)."""

    def __init__(self) -> None:
        self.history: list[PrefillRecord] = []

    @property
    def last(self) -> PrefillRecord | None:
        """The last prefill's record."""
        return self.history[-1] if self.history else None

    def _get(self, name: str, default):
        return getattr(self.last, name) if self.last is not None else default

    @property
    def budget(self) -> Budget | None:
        """``Budget(total, audio, video)`` of the last prefill."""
        return self._get("budget", None)

    @property
    def audio_kept(self) -> list[int]:
        """Sorted 0-based indices into the last prompt's ``input_ids`` of the audio tokens kept."""
        return self._get("audio_kept", [])

    @property
    def video_kept(self) -> list[int]:
        """Sorted 0-based indices into the last prompt's ``input_ids`` of the visual tokens kept."""
        return self._get("video_kept", [])

    @property
    def layer_tokens(self) -> list[int]:
        """Sequence length entering each decoder layer in the last prefill."""
        return self._get("layer_tokens", [])

    @property
    def cache_lengths(self) -> list[int]:
        """Per-layer KV-cache length after the last prefill."""
        return self._get("cache_lengths", [])

    def __repr__(self) -> str:
        last = self.last
        if last is None:
            return "Trace(no prefill yet)"
        return (f"Trace(prefills={len(self.history)}, budget={last.budget}, audio_kept={len(last.audio_kept)}/"
                f"{last.n_audio}, video_kept={len(last.video_kept)}/{last.n_video}, "
                f"layer_tokens={last.layer_tokens})")
