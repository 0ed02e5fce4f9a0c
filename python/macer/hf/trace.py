"""What one ``macer.compress`` context did: budgets, kept tokens, sequence lengths per layer, cache sizes.

A record is filled without reading the device during the prefill: lengths come from the host plan, and the kept
positions stay a device tensor until first read (``audio_kept`` / ``video_kept`` / ``budget`` copy them to the host
once, when the caller asks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from macer_kernels import Budget

__all__ = ["PrefillRecord", "Stage", "Trace"]

_AUDIO, _VISUAL = 1, 2  # macer.core.policy's labels (kept literal: this module is read by code that knows no policy)


@dataclass
class Stage:
    """One pruning stage of a prefill.

    Attributes:
        layer: readout layer, 1-based (scores read inside ``layers[layer - 1]``; tokens gone from ``layers[layer]``);
            0 for a stage before the first decoder layer (``RandomConfig``).
        modalities: ``("audio",)``, ``("video",)`` or both (equal readout layers, or one joint selection).
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
        budget: ``macer_kernels.Budget`` of the prefill (None when nothing is pruned). Policies with one joint
            selection (FastV, Random) fix only ``total``; their ``audio`` / ``video`` are the counts they kept.
        query_positions: 0-based prompt positions of the question rows whose attention was read.
        audio_kept, video_kept: sorted 0-based prompt positions of the kept audio / visual tokens.
        layer_tokens: sequence length entering each decoder layer.
        cache_lengths: KV-cache length of each layer right after the prefill (empty without a cache).
        stages: the stages in the order they ran.
        overhead_s: seconds spent in MACER's own work (planning, scoring, selection, compaction); measured with
            device synchronisation only under ``compress(..., profile=True)``, else None.
        policy: the policy's name (``"macer"``, ``"fastv"``, ...).
        padding: the prompt's left padding in its batch (0 alone). Every index the record reports
            (``query_positions``, ``audio_kept``, ``video_kept``) points into the prompt's own row of the batch's
            ``input_ids``, padding included; ``prompt_length``, ``layer_tokens``, ``cache_lengths`` and ``stages``
            count the prompt's own tokens, as if it ran alone.
    """

    prompt_length: int
    n_audio: int
    n_video: int
    planned_budget: Budget | None
    query_positions: list[int]
    layer_tokens: list[int] = field(default_factory=list)
    cache_lengths: list[int] = field(default_factory=list)
    stages: list[Stage] = field(default_factory=list)
    overhead_s: float | None = None
    policy: str = "macer"
    padding: int = 0
    labels: torch.Tensor | None = field(default=None, repr=False)  # [N] host modality labels
    kept_positions: torch.Tensor | None = field(default=None, repr=False)  # prompt positions after the last stage
    _kept: tuple[list[int], list[int]] | None = field(default=None, repr=False)

    def _read(self) -> tuple[list[int], list[int]]:
        if self._kept is None:
            if self.labels is None:
                self._kept = ([], [])
            else:
                kept = (torch.arange(self.prompt_length) if self.kept_positions is None
                        else self.kept_positions.cpu())  # the record's one device read, on the caller's request
                labels = self.labels[kept]
                kept = kept + self.padding
                self._kept = kept[labels == _AUDIO].tolist(), kept[labels == _VISUAL].tolist()
        return self._kept

    @property
    def audio_kept(self) -> list[int]:
        return self._read()[0]

    @property
    def video_kept(self) -> list[int]:
        return self._read()[1]

    @property
    def budget(self) -> Budget | None:
        planned = self.planned_budget
        if planned is None or planned.audio is not None:
            return planned
        audio, video = self._read()
        return Budget(planned.total, len(audio), len(video))

    @property
    def pruned(self) -> bool:
        """Whether any audio or visual token was dropped."""
        return len(self.audio_kept) < self.n_audio or len(self.video_kept) < self.n_video


class Trace:
    """Returned by ``macer.compress``: the records of every prefill run inside the context.

    ``samples`` is the last prefill's list of per-prompt records (length B for a batch of B prompts, 1 alone);
    ``history`` holds one record per prompt of every prefill, in order (a batch adds its B records in sample order).
    The attributes below read the last prefill of a single prompt (``None`` / empty before the first prefill); after
    a batch of B > 1 they raise ``ValueError``: read ``trace.samples[b]`` instead.
    """

    def __init__(self) -> None:
        self.history: list[PrefillRecord] = []
        self.samples: list[PrefillRecord] = []

    def add(self, records: list[PrefillRecord]) -> None:
        """Record one prefill's per-prompt records (the runtime calls this)."""
        self.history.extend(records)
        self.samples = list(records)

    @property
    def last(self) -> PrefillRecord | None:
        """The last prefill's record (a single prompt)."""
        if len(self.samples) > 1:
            raise ValueError(f"macer.Trace: the last prefill ran a batch of {len(self.samples)} prompts; read "
                             "trace.samples[b] (one PrefillRecord per prompt) instead of the single-prompt "
                             "attributes (trace.last, audio_kept, video_kept, budget, layer_tokens, cache_lengths)")
        return self.samples[0] if self.samples else None

    def _get(self, name: str, default):
        last = self.last
        return getattr(last, name) if last is not None else default

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
        if len(self.samples) > 1:
            return f"Trace(prefills with {len(self.history)} prompts, last a batch of {len(self.samples)})"
        last = self.last
        if last is None:
            return "Trace(no prefill yet)"
        return (f"Trace(prefills={len(self.history)}, policy={last.policy!r}, budget={last.budget}, "
                f"audio_kept={len(last.audio_kept)}/{last.n_audio}, video_kept={len(last.video_kept)}/"
                f"{last.n_video}, layer_tokens={last.layer_tokens})")
