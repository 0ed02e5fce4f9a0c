"""The state of one prefill in any engine: the host plan of a prompt, its tables on the device, the rows the sequence
holds as the stages run, and the stages' non-finite flags (``PrefillState``). No engine's cache or layer arguments:
the transformers engine wraps it (``macer.hf.prefill.PromptPrefill``, one per sample of a batch), the vLLM plugin
uses it as it is (``macer.vllm.staged``).
"""

from __future__ import annotations

import torch

from macer.core.policy import AUDIO, VISUAL, Plan
from macer.core.stage import ScoreReduce, StageRows, batched, fused, run_stage
from macer.core.transfer import to_device
from macer_kernels import compact_many

__all__ = ["PrefillState", "nonfinite_hits", "question_range", "stage_buffers"]


def question_range(rows: list[int], prompt_length: int, tokens_before: int) -> range:
    """A stage's question rows (prompt positions, contiguous) as rows of the sequence entering it: every row a
    stage drops lies before the question (``macer.core.policy.question_rows`` checks it), so each question row sits
    ``prompt_length - tokens_before`` rows earlier. An empty range for a stage without scores."""
    if not rows:
        return range(0)
    if rows != list(range(rows[0], rows[0] + len(rows))):
        raise RuntimeError(f"macer: the question rows {rows} are not contiguous (please report this)")
    start = rows[0] - (prompt_length - tokens_before)
    if start < 0:
        raise RuntimeError(f"macer: question row {rows[0]} lies among the {prompt_length - tokens_before} dropped "
                           "rows (please report this)")
    return range(start, start + len(rows))


def stage_buffers(plan: Plan, device: torch.device) -> list[tuple | None]:
    """Per stage, None or (for a fused stage that drops rows) ``((keep, flags, current, labels[, chunks]),
    (keep[0], current[0]))``: the outputs of its ``PreparedStage`` (``[1, tokens_after]`` int64 each, flags
    ``[1]`` bool) and their 1-D views, carved from two allocations made before the first layer, so the stages
    allocate nothing (``macer.core.stage.run_stage``'s ``out``)."""
    work = [i for i, stage in enumerate(plan.stages) if fused(stage) and stage.tokens_after != stage.tokens_before]
    out: list[tuple | None] = [None] * len(plan.stages)
    if not work:
        return out
    per = 3 + (plan.chunks is not None)  # keep, current, labels[, chunks]
    longs = torch.empty(1, per * sum(plan.stages[i].tokens_after for i in work), dtype=torch.long, device=device)
    pieces = iter(longs.split([plan.stages[i].tokens_after for i in work for _ in range(per)], dim=1))
    flags = iter(torch.empty(len(work), dtype=torch.bool, device=device).split(1))
    for i in work:
        keep, *tables = (next(pieces) for _ in range(per))
        out[i] = ((keep, next(flags), *tables), (keep[0], tables[0][0]))
    return out


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

    def __init__(self, plan: Plan, device: torch.device, *, defer: bool = False):
        self.plan = plan
        # defer: the engine compacts its per-token tensors with ``apply`` (never reading ``pending`` itself), so a
        # fused stage's readout is kept until then and its launch gathers those tensors too.
        self.defer = defer
        self._deferred: tuple | None = None
        n = plan.facts.length
        host = [plan.facts.labels]
        host += [pick for stage in plan.stages for pick in stage.picks if pick is not None]
        host += [plan.chunks] if plan.chunks is not None else []
        tables = iter(to_device(host, device))
        self.labels = next(tables)
        self.picks = [tuple(next(tables) if p is not None else None for p in stage.picks) for stage in plan.stages]
        self.chunks = next(tables) if plan.chunks is not None else None
        self.full = torch.arange(n, device=device)
        self.current = self.full
        labels = {AUDIO, VISUAL} | {m for stage in plan.stages for sel in stage.spec.selections for m in sel.modalities}
        self.counts = {m: plan.facts.count(m) for m in labels}
        self.next = 0  # index of the next stage to run
        self.pending: torch.Tensor | None = None  # rows of the current sequence to keep, applied at the next layer
        self.layer_rows: dict[int, torch.Tensor] = {}  # rows present at each hooked layer (= its cache rows)
        self.nonfinite: list[tuple[int, list[int | None], torch.Tensor]] = []  # raise_if_nonfinite's entries
        # The tables of the rows entering the next stage (valid for stage `_rows_for`; a batch that runs a stage
        # itself, macer.hf.batch, skips run(), and the tables are then rebuilt from `current`) and the fused
        # stages' output buffers.
        self._rows = StageRows(self.full[None], self.labels[None], None if self.chunks is None else self.chunks[None])
        self._rows_for = 0
        self._next_current: torch.Tensor | None = None
        # Each stage's question rows as a range of the rows entering it, from the host plan now (nothing is read in
        # the layers; a batch places them in its own layout, macer.hf.batch).
        self.questions = [question_range(stage.query.tolist(), n, stage.tokens_before) for stage in plan.stages]
        self._outs = stage_buffers(plan, device)

    @property
    def layer_tokens(self) -> list[int]:
        return self.plan.layer_tokens

    def has_pending(self) -> bool:
        return self.pending is not None or self._deferred is not None

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
        scores those of all heads (``macer.core.stage.ScoreReduce``); the stage then runs now, composed (never
        deferred to ``apply``), and ``pending`` holds its rows."""
        stage, i = self.plan.stages[self.next], self.next
        self.next += 1
        rows = self._rows if self._rows_for == i else self._rebuild_rows()
        if stage.tokens_after == stage.tokens_before:
            self._rows, self._rows_for = rows, i + 1
            return  # the plan says nothing is dropped (keep ratio 1): no device work
        if self.defer and self._outs[i] is not None and reduce is None:
            # A fused stage: run by apply, with the engine's tensors.
            self._deferred = (i, query, key, scale, eps, rows)
            return
        self._run(i, rows, query, key, scale, eps, reduce=reduce)

    def _run(self, i: int, rows: StageRows, query: torch.Tensor | None, key: torch.Tensor | None,
             scale: float | None, eps: float, extra: list[torch.Tensor] | None = None,
             extra_dims: list[int] | None = None, reduce: ScoreReduce | None = None) -> list[torch.Tensor]:
        stage = self.plan.stages[i]
        out = self._outs[i] if reduce is None else None  # with a reduce the stage is composed: new tensors
        keep, flag, self._rows, compacted = run_stage(
            stage, query, key, rows, self.questions[i], self.picks[i], prompt_length=self.plan.facts.length,
            scale=scale, eps=eps, out=None if out is None else out[0], extra=extra or (), extra_dims=extra_dims or (),
            reduce=reduce)
        self._rows_for = i + 1
        self.pending, self._next_current = (keep[0], self._rows.current[0]) if out is None else out[1]
        if flag is not None:
            self.nonfinite.append((stage.spec.layer, [0], flag))
        return compacted

    def take_pending(self) -> torch.Tensor:
        """The pending rows to keep (``[tokens_after]``, of the current sequence), applied: ``current`` becomes their
        prompt positions, which the stage gathered itself (an engine that indexes ``current[keep]`` gets the same
        rows with one more launch). A deferred stage runs now."""
        if self._deferred is not None:
            return self.apply([], [])[0]
        keep = self._applied()
        return keep

    def _applied(self) -> torch.Tensor:
        """The pending keep, cleared, with the prompt positions of its rows made current."""
        keep, current = self.pending, self._next_current
        if keep is None or current is None:
            raise RuntimeError("macer: no stage is pending here (please report this)")
        self.pending, self.current = None, current
        return keep

    def apply(self, tensors: list[torch.Tensor], dims: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Before the next layer: ``(keep, compacted)``, the pending stage applied (as ``take_pending``) and the
        engine's per-token tensors (hidden states, RoPE tables, position ids: sequence dim ``dims[i]``) compacted to
        the kept rows. A deferred fused stage (``defer=True``) scores, selects and compacts them in its one call;
        otherwise one ``compact_many``."""
        if self._deferred is None:
            keep = self.take_pending()
            return keep, compact_many(tensors, keep, dims) if tensors else []
        i, query, key, scale, eps, rows = self._deferred
        self._deferred = None
        views, view_dims, inserted = batched(tensors, dims)
        compacted = self._run(i, rows, query, key, scale, eps, views, view_dims)
        keep = self._applied()
        return keep, [t.squeeze(d - 1) if add else t for t, d, add in zip(compacted, view_dims, inserted, strict=True)]

    def resume(self, next_stage: int, current: torch.Tensor) -> None:
        """Take over a prefill whose stages before ``next_stage`` ran in another process (a later pipeline rank of a
        serving engine): ``current`` holds the prompt positions of the rows it received (device); the next stage's
        tables are gathered from the prompt's."""
        self.next, self.current = next_stage, current
        self.pending, self._deferred, self._next_current = None, None, None
        self._rows_for = -1  # the tables in _rows are not those of the received rows

    def _rebuild_rows(self) -> StageRows:
        """The tables of the current rows from the prompt's (after a stage that a batch ran itself)."""
        current = self.current
        return StageRows(current[None], self.labels[current][None],
                         None if self.chunks is None else self.chunks[current][None])

    def nonfinite_flags(self) -> list[tuple[int, list[int | None], torch.Tensor]]:
        """The stages' non-finite flags (``raise_if_nonfinite``); a prompt alone is sample 0."""
        return self.nonfinite
