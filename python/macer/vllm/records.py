"""What MACER did to each request inside the engine: one ``RequestRecord`` per prefill, kept in ``RECORDS`` (in the
process that runs the model) and logged at INFO on the ``vllm.macer`` logger (through vLLM's handler, at
``VLLM_LOGGING_LEVEL``)::

    macer: prefill 1 policy=macer budget=22 (audio 7, video 15) kept audio 7/24 video 15/64 layers [103x3, 86x2, 46]

The model calls ``record_prefill`` (or ``record_unpruned``) once per prefill; ``record(...)`` takes host values the
model already has (the plan's budget and counts) and reads nothing back from the device (``kept_counts`` reads a
joint selection's split once, after the prefill's last layer). Prefills are numbered from 1 in each process; vLLM's
V1 runner does not tell the model which request a step serves, so ``request_id`` is None there (with
``max_num_seqs=1`` the n-th prefill is the n-th request the engine scheduled). ``RECORDS`` keeps the last
``MAX_RECORDS`` requests; in a test with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` the engine core runs in the test's
process and the test reads them directly.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import groupby

from macer.core.policy import AUDIO, MODALITY_NAMES, VISUAL, PromptFacts
from macer.core.prefill import PrefillState, nonfinite_hits
from macer_kernels import Budget

__all__ = ["MAX_RECORDS", "RECORDS", "RequestRecord", "clear", "format_layers", "kept_counts", "last",
           "nonfinite_note", "prompt_counts", "record", "record_prefill", "record_unpruned"]

# A child of vLLM's "vllm" logger, so the line goes through vLLM's handler and level (VLLM_LOGGING_LEVEL) in every
# process of the engine; a logger of our own would have no handler there and drop INFO.
logger = logging.getLogger("vllm.macer")

MAX_RECORDS = 1024


@dataclass(frozen=True)
class RequestRecord:
    """One request's prefill under MACER.

    Attributes:
        index: the prefill's number in this process (from 1).
        request_id: vLLM's request id (None where the forward cannot tell).
        policy: the policy's name (``"macer"``, ``"fastv"``, ...).
        budget: the retained budget (``total``, ``audio``, ``video``; audio and video None for a joint selection), or
            None for a prompt without audio/video or one served unpruned.
        prompt: ``{"audio": n_a, "video": n_v, "text": n_t}`` token counts of the prompt.
        kept: ``{"audio": k_a, "video": k_v}`` tokens kept after the last stage.
        layer_tokens: sequence length entering each decoder layer (length = decoder depth).
        note: what went wrong for this request, if anything (a prompt the plan refused, served unpruned; non-finite
            attention scores at a stage); the log line is then a WARNING.
    """

    index: int
    request_id: str | None
    policy: str
    budget: Budget | None
    prompt: Mapping[str, int]
    kept: Mapping[str, int]
    layer_tokens: tuple[int, ...]
    note: str | None = None

    def line(self) -> str:
        """The INFO log line of this record."""
        if self.budget is None:
            media = self.prompt.get("audio", 0) + self.prompt.get("video", 0)
            budget = "none (served unpruned)" if media else "none (no audio/video)"
        elif self.budget.audio is None:  # a joint selection (FastV, Random): the split is whatever it keeps
            budget = f"{self.budget.total} (audio and video jointly)"
        else:
            budget = f"{self.budget.total} (audio {self.budget.audio}, video {self.budget.video})"
        kept = " ".join(f"{m} {self.kept.get(m, 0)}/{self.prompt.get(m, 0)}" for m in ("audio", "video"))
        request = f" request {self.request_id}" if self.request_id is not None else ""
        return (f"macer: prefill {self.index}{request} policy={self.policy} budget={budget} kept {kept} "
                f"layers {format_layers(self.layer_tokens)}" + (f" NOTE: {self.note}" if self.note else ""))


RECORDS: deque[RequestRecord] = deque(maxlen=MAX_RECORDS)
"""The last ``MAX_RECORDS`` records of this process, oldest first."""

_COUNT = [0]  # prefills recorded in this process (``RECORDS`` is bounded, so it cannot count them)


def format_layers(layer_tokens: Sequence[int]) -> str:
    """``[103x3, 86x2, 46]``: run-length form of the per-layer sequence lengths."""
    runs = [(value, len(list(group))) for value, group in groupby(layer_tokens)]
    return "[" + ", ".join(f"{v}x{n}" if n > 1 else f"{v}" for v, n in runs) + "]"


def record(request_id: str | None, budget: Budget | None, kept_counts: Mapping[str, int],
           layer_tokens: Sequence[int], *, policy: str = "", prompt_counts: Mapping[str, int] | None = None,
           note: str | None = None) -> RequestRecord:
    """Store and log (INFO; WARNING with a ``note``) one request's record; returns it.

    Args:
        request_id: vLLM's request id, or None.
        budget: the plan's budget (None: nothing to prune).
        kept_counts: ``{"audio": k_a, "video": k_v}`` kept after the last stage (host integers).
        layer_tokens: the plan's sequence length entering each decoder layer.
        policy: the policy's name.
        prompt_counts: ``{"audio": n_a, "video": n_v, "text": n_t}`` of the prompt.
        note: what went wrong for this request (``RequestRecord.note``).
    """
    _COUNT[0] += 1
    entry = RequestRecord(_COUNT[0], request_id, policy, budget, dict(prompt_counts or {}),
                          {k: int(v) for k, v in kept_counts.items()}, tuple(int(n) for n in layer_tokens),
                          note)
    RECORDS.append(entry)
    logger.log(logging.WARNING if note else logging.INFO, "%s", entry.line())
    return entry


def record_prefill(prefill: PrefillState, policy: str) -> RequestRecord:
    """Record a prefill the stages ran on: its plan's budget and layer lengths, the tokens it kept, and a note if a
    stage ranked non-finite scores."""
    plan = prefill.plan
    # The V1 runner does not tell the model which request a step serves: request_id stays None (one request at a
    # time, so records come in the order the prefills ran).
    return record(None, plan.budget, kept_counts(prefill), list(plan.layer_tokens), policy=policy,
                  prompt_counts=prompt_counts(plan.facts), note=nonfinite_note(prefill))


def record_unpruned(facts: PromptFacts, num_layers: int, policy: str, note: str) -> RequestRecord:
    """Record a prompt served without pruning (``note`` says why): every layer sees the whole prompt."""
    counts = prompt_counts(facts)
    return record(None, None, {"audio": counts["audio"], "video": counts["video"]}, [facts.length] * num_layers,
                  policy=policy, prompt_counts=counts, note=note)


def prompt_counts(facts: PromptFacts) -> dict[str, int]:
    """``{"audio": n_a, "video": n_v, "text": n_t}`` of a prompt."""
    counts = {"audio": facts.count(AUDIO), "video": facts.count(VISUAL)}
    counts["text"] = facts.length - counts["audio"] - counts["video"]
    return counts


def nonfinite_note(prefill: PrefillState) -> str | None:
    """The record's note when a stage ranked non-finite scores (``run_stage``'s device flags, read in one copy after
    the prefill's last layer, as the transformers runtime reads them). The transformers runtime raises there; inside
    the engine an error would stop every request, so the request goes on and its record is a WARNING that names the
    layer: its selection is the non-finite rule's (NaN ranks last), not a ranking by attention."""
    hits = nonfinite_hits(prefill.nonfinite_flags())
    if not hits:
        return None
    return (f"the attention scores of the stage reading layer {hits[0][0]} are not finite (NaN or inf in that layer's "
            "queries or keys: its weights or the hidden states entering it); the stage kept tokens by the non-finite "
            "rule, not by attention, and the outputs are likely NaN too")


def kept_counts(prefill: PrefillState) -> dict[str, int]:
    """Audio and video tokens the prefill kept. From the host plan where it fixes them (one selection per modality,
    the random rule's host picks); a joint selection's split (FastV) is data-dependent and read from the device
    once, after the prefill's last layer."""
    plan, counts = prefill.plan, {}
    for label, name in MODALITY_NAMES.items():
        count = prefill.label_count(label)
        if count is None:
            kept = prefill.current.cpu()  # joint top-k only: its split is known on the device alone
            count = int((plan.facts.labels[kept] == label).sum())
        counts[name] = count
    return counts


def last() -> RequestRecord:
    """The most recent record; ``LookupError`` if none was made in this process."""
    if not RECORDS:
        raise LookupError("macer.vllm.records: no request has been recorded in this process (with multiprocessing "
                          "on, records live in the engine core's process: set VLLM_ENABLE_V1_MULTIPROCESSING=0 to "
                          "read them in-process, or read the INFO log lines)")
    return RECORDS[-1]


def clear() -> None:
    """Forget every record and restart the numbering (tests)."""
    RECORDS.clear()
    _COUNT[0] = 0
