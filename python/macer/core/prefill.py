"""The state of one prefill in any engine: the host plan of a prompt, its tables on the device, the rows the sequence
holds as the stages run, and the stages' non-finite flags (``PrefillState``). No engine's cache or layer arguments:
the transformers engine wraps it (``macer.hf.prefill.PromptPrefill``, one per sample of a batch), the vLLM plugin
uses it as it is (``macer.vllm.staged``).
"""

from __future__ import annotations

import torch

from macer.core.policy import AUDIO, VISUAL, Plan
from macer.core.stage import ScoreReduce, run_stage
from macer.core.transfer import to_device

__all__ = ["PrefillState", "nonfinite_hits"]


def nonfinite_hits(entries: list[tuple[int, list[int | None], torch.Tensor]]) -> list[tuple[int, int]]:
    """``(layer, batch index)`` of every flagged sample, sorted. ``entries``: per stage ``(layer, samples, flags)``,
    ``flags[i]`` the device flag of batch index ``samples[i]`` (None: a sample the stage did not select for). All
    flags come to the host in one copy: the prefill's only device read after the plan's, made once the decoder has
    run."""
    if not entries:
        return []
    flat = torch.cat([flags.reshape(-1) for _, _, flags in entries]).tolist()
    hits, i = [], 0
    for layer, samples, _ in entries:
        for b in samples:
            if flat[i] and b is not None:
                hits.append((layer, b))
            i += 1
    return sorted(hits)


class PrefillState:
    """One prefill pass through the decoder, in any engine: its host plan, device tables, the rows currently in the
    sequence, the rows a stage keeps (applied by the engine before the next layer) and the stages' non-finite flags.
    An engine adds its own cache and layer inputs around it (``macer.hf.prefill.PromptPrefill``, the vLLM plugin's
    ``macer.vllm.staged.StagedDecoder``)."""

    def __init__(self, plan: Plan, device: torch.device):
        self.plan = plan
        n = plan.facts.length
        host = [plan.facts.labels, *(stage.query for stage in plan.stages)]
        host += [pick for stage in plan.stages for pick in stage.picks if pick is not None]
        host += [plan.chunks] if plan.chunks is not None else []
        tables = iter(to_device(host, device))
        self.labels = next(tables)
        self.queries = [next(tables) for _ in plan.stages]
        self.picks = [tuple(next(tables) if p is not None else None for p in stage.picks) for stage in plan.stages]
        self.chunks = next(tables) if plan.chunks is not None else None
        self.full = torch.arange(n, device=device)
        self.current = self.full
        # Host numbers a batched stage needs, read from the host plan now (nothing is read in the layers).
        self.question_rows = [stage.query.tolist() for stage in plan.stages]
        labels = {AUDIO, VISUAL} | {m for stage in plan.stages for sel in stage.spec.selections for m in sel.modalities}
        self.counts = {m: plan.facts.count(m) for m in labels}
        self.next = 0  # index of the next stage to run
        self.pending: torch.Tensor | None = None  # rows of the current sequence to keep, applied at the next layer
        self.layer_rows: dict[int, torch.Tensor] = {}  # rows present at each hooked layer (= its cache rows)
        self.nonfinite: list[tuple[int, list[int | None], torch.Tensor]] = []  # raise_if_nonfinite's entries

    @property
    def layer_tokens(self) -> list[int]:
        return self.plan.layer_tokens

    def has_pending(self) -> bool:
        return self.pending is not None

    def enter(self, index: int) -> None:
        """``layers[index]`` runs on the current rows (they become its cache rows)."""
        self.layer_rows[index] = self.current

    def stage_at(self, layer: int):
        """The next stage if it reads (or, at 0, applies before) decoder layer index ``layer``."""
        if self.next < len(self.plan.stages) and self.plan.stages[self.next].spec.layer == layer:
            return self.plan.stages[self.next]
        return None

    def label_count(self, label: int) -> int | None:
        """Tokens of ``label`` in the current rows, from the plan (None after a joint selection over it: its share
        of the joint budget is data-dependent)."""
        count = self.counts[label]
        for stage in self.plan.stages[: self.next]:
            for sel in stage.spec.selections:
                if label in sel.modalities:
                    if len(sel.modalities) > 1:
                        return None
                    count = sel.k if stage.tokens_after != stage.tokens_before else count
        return count

    def run(self, query: torch.Tensor | None, key: torch.Tensor | None, scale: float | None, eps: float,
            layer: int | None = None, *, reduce: ScoreReduce | None = None) -> None:
        """The next stage on the current rows (``layer`` is the batch's argument; one prompt has one next stage).
        ``reduce``: where ``query`` holds only this process's share of the heads (tensor parallel), what makes its
        scores those of all heads (``macer.core.stage.ScoreReduce``)."""
        stage, i = self.plan.stages[self.next], self.next
        self.next += 1
        if stage.tokens_after == stage.tokens_before:
            return  # the plan says nothing is dropped (keep ratio 1): no device work
        self.pending, flag = run_stage(stage, query, key, self.current, self.labels, self.chunks, self.queries[i],
                                       self.picks[i], scale=scale, eps=eps, reduce=reduce)
        if flag is not None:
            self.nonfinite.append((stage.spec.layer, [0], flag))

    def nonfinite_flags(self) -> list[tuple[int, list[int | None], torch.Tensor]]:
        """The stages' non-finite flags (``raise_if_nonfinite``); a prompt alone is sample 0."""
        return self.nonfinite
