"""What MACER did to each request inside the engine: one ``RequestRecord`` per request, made at its first prefill
(a recompute after preemption makes none), with vLLM's request id and the kept prompt positions per modality.

Where a user reads it:

* **in the request's output**: ``RequestOutput.kv_transfer_params["macer"]`` (``LLM.generate``) and the
  ``kv_transfer_params`` field of the OpenAI-compatible server's completion and chat completion responses, a JSON
  object (``RequestRecord.as_dict``). The MACER worker sends the step's new records to the engine core with the
  step's output (``drain``; vLLM's CPU build runs the worker in a process of its own), and the MACER scheduler
  (``macer.vllm.scheduler``) attaches a request's record when it finishes; vLLM carries that field to the caller.
  MACER engines refuse KV transfer connectors, so the field is otherwise unused. With ``n > 1`` the output carries
  one child request's record (the children share the prompt and the policy, so their kept rows are the same).
* **in the log**: one line on the ``vllm.macer`` logger (vLLM's handler and ``VLLM_LOGGING_LEVEL``) in the process
  that runs the model, INFO, or WARNING when the record has a note::

      macer: request 0-1a2b3c4d policy=macer keep_ratio=0.25 budget=22 (audio 7, video 15) kept audio 7/24
      video 15/64 layers [103x3, 86x2, 46]

* **in-process** (tests, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``): ``RECORDS`` (the last ``MAX_RECORDS``), ``last()``,
  ``by_request(request_id)``.

A request has one record. Its first is kept: a later one for the same request id (a recompute after preemption
that the scheduler cut before a multimodal item and the worker served unpruned, a later turn of a streaming-input
session) never replaces it, and its note, when it says something new, is appended to the first's (``record``).

The kept positions are device data. The model starts one non-blocking copy of them (and of the stages' non-finite
flags) after the request's last stage; the record is finished on the host after the step's sampler
(``finish_pending``, called by the MACER worker), or when the scheduler asks for it (``take``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import groupby
from typing import Any

import torch

from macer.core.policy import AUDIO, MODALITY_NAMES, VISUAL, PromptFacts
from macer_kernels import Budget

__all__ = ["LATER", "MAX_RECORDS", "RECORDS", "RequestRecord", "by_request", "claim_pending", "clear", "drain",
           "empty_budget_note", "external_id", "finish", "finish_pending", "format_layers", "kept_rows", "last",
           "nonfinite_note", "prompt_counts", "receive", "record", "start_pending", "take"]

# A child of vLLM's "vllm" logger, so the line goes through vLLM's handler and level (VLLM_LOGGING_LEVEL) in every
# process of the engine; a logger of our own would have no handler there and drop INFO.
logger = logging.getLogger("vllm.macer")

MAX_RECORDS = 1024


@dataclass(frozen=True)
class RequestRecord:
    """One request under MACER.

    Attributes:
        request_id: vLLM's internal request id (``"<your id>-<8 characters>"``), or None outside an engine.
        external_id: the id the caller gave (``RequestOutput.request_id``), derived from ``request_id``.
        policy: the policy's name (``"macer"``, ``"fastv"``, ...); keep_ratio: its keep ratio.
        budget: the retained budget (``total``, ``audio``, ``video``; audio and video None for a joint selection), or
            None for a prompt without audio/video or one served unpruned.
        prompt: ``{"audio": n_a, "video": n_v, "text": n_t}`` token counts of the prompt.
        kept: ``{"audio": k_a, "video": k_v}`` tokens kept after the last stage.
        kept_rows: ``{"audio": (...), "video": (...)}`` the prompt positions kept after the last stage.
        layer_tokens: prompt rows entering each decoder layer (length = decoder depth).
        note: what went wrong for this request, if anything (a prompt served unpruned and why; non-finite attention
            scores at a stage); the log line is then a WARNING.
    """

    request_id: str | None
    external_id: str | None
    policy: str
    keep_ratio: float | None
    budget: Budget | None
    prompt: Mapping[str, int]
    kept: Mapping[str, int]
    kept_rows: Mapping[str, tuple[int, ...]]
    layer_tokens: tuple[int, ...]
    note: str | None = None

    def line(self) -> str:
        """The log line of this record."""
        if self.budget is None:
            media = self.prompt.get("audio", 0) + self.prompt.get("video", 0)
            budget = "none (served unpruned)" if media else "none (no audio/video)"
        elif self.budget.audio is None:  # a joint selection (FastV, Random): the split is whatever it keeps
            budget = f"{self.budget.total} (audio and video jointly)"
        else:
            budget = f"{self.budget.total} (audio {self.budget.audio}, video {self.budget.video})"
        kept = " ".join(f"{m} {self.kept.get(m, 0)}/{self.prompt.get(m, 0)}" for m in ("audio", "video"))
        return (f"macer: request {self.request_id} policy={self.policy} keep_ratio={self.keep_ratio} "
                f"budget={budget} kept {kept} layers {format_layers(self.layer_tokens)}"
                + (f" NOTE: {self.note}" if self.note else ""))

    def as_dict(self) -> dict[str, Any]:
        """A JSON object of the record (what the request's output carries)."""
        budget = None if self.budget is None else {"total": self.budget.total, "audio": self.budget.audio,
                                                   "video": self.budget.video}
        return {"request_id": self.request_id, "external_id": self.external_id, "policy": self.policy,
                "keep_ratio": self.keep_ratio, "budget": budget, "prompt": dict(self.prompt), "kept": dict(self.kept),
                "kept_rows": {m: list(rows) for m, rows in self.kept_rows.items()},
                "layer_tokens": list(self.layer_tokens), "note": self.note}


RECORDS: deque[RequestRecord] = deque(maxlen=MAX_RECORDS)
"""The last ``MAX_RECORDS`` records of this process, oldest first."""

_BY_ID: OrderedDict[str, dict[str, Any]] = OrderedDict()  # records (as_dict) not yet taken by the scheduler
_OUTBOX: list[dict[str, Any]] = []  # records made here, not yet sent to the scheduler's process (``drain``)


@dataclass
class _Pending:
    """A record waiting for its device copy (``start_pending``)."""

    host: torch.Tensor
    event: Any
    build: Callable[[list[int]], RequestRecord]
    done: bool = field(default=False)


_PENDING: dict[str, _Pending] = {}
_LOCK = threading.RLock()  # the tables above: the executor's output thread finishes records (``finish``)
_COLLECTING = threading.local()  # ``entries``: where ``finish`` collects the records it makes on this thread


def external_id(request_id: str | None) -> str | None:
    """The caller's id of vLLM's internal ``"<id>-<8 random characters>"`` (``assign_request_id``); the id itself
    when vLLM does not randomise (``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION``) or it has no such suffix."""
    import os

    if request_id is None or os.environ.get("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "0") not in ("0", ""):
        return request_id
    head, dash, tail = request_id.rpartition("-")
    return head if dash and len(tail) == 8 else request_id


def format_layers(layer_tokens: Sequence[int]) -> str:
    """``[103x3, 86x2, 46]``: run-length form of the per-layer sequence lengths."""
    runs = [(value, len(list(group))) for value, group in groupby(layer_tokens)]
    return "[" + ", ".join(f"{v}x{n}" if n > 1 else f"{v}" for v, n in runs) + "]"


def prompt_counts(facts: PromptFacts) -> dict[str, int]:
    """``{"audio": n_a, "video": n_v, "text": n_t}`` of a prompt."""
    counts = {"audio": facts.count(AUDIO), "video": facts.count(VISUAL)}
    counts["text"] = facts.length - counts["audio"] - counts["video"]
    return counts


def kept_rows(labels: torch.Tensor, kept: Sequence[int]) -> dict[str, tuple[int, ...]]:
    """``{"audio": (...), "video": (...)}``: the kept prompt positions of each modality (host ``labels``)."""
    names = labels.tolist()
    return {name: tuple(p for p in kept if names[p] == label) for label, name in MODALITY_NAMES.items()}


def record(request_id: str | None, budget: Budget | None, kept: Mapping[str, Sequence[int]],
           layer_tokens: Sequence[int], *, policy: str, keep_ratio: float | None, prompt: Mapping[str, int],
           note: str | None = None) -> RequestRecord:
    """Store and log (INFO; WARNING with a ``note``) one request's record; returns it (the request's first record,
    with ``note`` appended, when it has one already: the module docstring). A prompt with audio or video of which
    the budget keeps none gets a note saying so.

    Args:
        request_id: vLLM's internal request id, or None.
        budget: the plan's budget (None: nothing pruned).
        kept: ``{"audio": positions, "video": positions}`` kept after the last stage (host).
        layer_tokens: prompt rows entering each decoder layer.
        policy, keep_ratio: the request's policy.
        prompt: ``prompt_counts`` of the prompt.
        note: what went wrong for this request (``RequestRecord.note``).
    """
    rows = {name: tuple(int(p) for p in kept.get(name, ())) for name in ("audio", "video")}
    note = _join(note, empty_budget_note(budget, prompt, keep_ratio))
    entry = RequestRecord(request_id, external_id(request_id), policy, keep_ratio, budget, dict(prompt),
                          {name: len(positions) for name, positions in rows.items()}, rows,
                          tuple(int(n) for n in layer_tokens), note)
    with _LOCK:
        first = _earlier(request_id)
        if first is not None:
            return _append_note(first, note)
        RECORDS.append(entry)
        if request_id is not None:
            receive([entry.as_dict()])
            _send(entry)
    logger.log(logging.WARNING if note else logging.INFO, "%s", entry.line())
    return entry


def _join(first: str | None, second: str | None) -> str | None:
    return first if not second else second if not first else f"{first}; {second}"


def empty_budget_note(budget: Budget | None, prompt: Mapping[str, int], keep_ratio: float | None) -> str | None:
    """The note of a pruned prompt with audio or video whose budget keeps none of it (``K_mm = round(rho n)`` is 0:
    a keep ratio far below ``1 / n``, e.g. 0.001 typed for 0.01), else None."""
    media = prompt.get("audio", 0) + prompt.get("video", 0)
    if budget is None or budget.total > 0 or media == 0:
        return None
    return (f"the keep ratio {keep_ratio} keeps no audio or video token of this prompt (its budget round({keep_ratio} "
            f"x {media}) is 0): every audio and video row was dropped after its stage")


LATER = "then, in a later pass of this request (a recompute after preemption, a session's next turn): "
"""How ``record`` introduces the note of a request's later record, appended to its first record's note."""


def _earlier(request_id: str | None) -> RequestRecord | None:
    """The first record of ``request_id`` made in this process (among the last ``MAX_RECORDS``), or None."""
    if request_id is None:
        return None
    return next((entry for entry in RECORDS if entry.request_id == request_id), None)


def _append_note(first: RequestRecord, note: str | None) -> RequestRecord:
    """``first`` with ``note`` appended to its note (unchanged when ``note`` says nothing new), stored and sent in its
    place, and logged as a WARNING (under ``_LOCK``)."""
    if not note or (first.note is not None and note in first.note):
        return first
    entry = dataclasses.replace(first, note=_join(first.note, f"{LATER}{note}"))
    RECORDS[RECORDS.index(first)] = entry
    receive([entry.as_dict()])
    _send(entry)
    logger.warning("%s", entry.line())
    return entry


def _send(entry: RequestRecord) -> None:
    """Queue ``entry`` for the scheduler: in the records ``finish`` is collecting on this thread, else in ``_OUTBOX``
    (``drain``)."""
    collecting = getattr(_COLLECTING, "entries", None)
    if collecting is not None:
        collecting.append(entry.as_dict())
        return
    _OUTBOX.append(entry.as_dict())
    del _OUTBOX[:-MAX_RECORDS]


def start_pending(request_id: str, tensors: list[torch.Tensor], build: Callable[[list[int]], RequestRecord]) -> None:
    """Copy ``tensors`` (1-D integer device tensors) to the host without waiting; ``build(values)`` makes the record
    from their concatenated values once the copy is done (``claim_pending`` and ``finish``, ``finish_pending``,
    ``take``)."""
    packed = torch.cat([t.reshape(-1).long() for t in tensors]) if tensors else torch.empty(0, dtype=torch.long)
    event = None
    if packed.device.type != "cpu":
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=packed.device.type == "cuda")
        host.copy_(packed, non_blocking=True)
        event = torch.cuda.Event() if packed.device.type == "cuda" else None
        if event is not None:
            event.record()
        packed = host
    with _LOCK:
        _PENDING[request_id] = _Pending(packed, event, build)


def claim_pending() -> list[_Pending]:
    """The records waiting for their copies, taken from the table: the MACER worker claims a step's records after its
    sampler and finishes them (``finish``) once the step's forward is done, in the async output's ``get_output``
    under asynchronous scheduling."""
    with _LOCK:
        claimed = list(_PENDING.values())
        _PENDING.clear()
    return claimed


def finish(claimed: Sequence[_Pending]) -> list[dict[str, Any]]:
    """Make the records of ``claimed`` (``claim_pending``), waiting for their copies; returns them as JSON objects,
    for the step's output (they are not queued for ``drain``). Thread-safe: under asynchronous scheduling it runs on
    the executor's output thread while the worker's thread plans the next step."""
    collected: list[Any] = []
    _COLLECTING.entries = collected
    try:
        for pending in claimed:
            if pending.event is not None and not pending.event.query():
                pending.event.synchronize()
            pending.build(pending.host.tolist())
    finally:
        _COLLECTING.entries = None
    return collected


def finish_pending(block: bool = False) -> None:
    """Make the records whose copies are done (all of them with ``block``)."""
    with _LOCK:
        ready = [request_id for request_id, pending in _PENDING.items()
                 if block or pending.event is None or pending.event.query()]
        claimed = [_PENDING.pop(request_id) for request_id in ready]
    for pending in claimed:
        if pending.event is not None:
            pending.event.synchronize()
        pending.build(pending.host.tolist())


def drain() -> list[dict[str, Any]]:
    """The records made in this process since the last call, as JSON objects: the MACER worker sends them to the
    scheduler with the step's output (vLLM may run the worker in a process of its own)."""
    with _LOCK:
        out = list(_OUTBOX)
        _OUTBOX.clear()
    return out


def receive(entries: list[dict[str, Any]] | None) -> None:
    """Keep records (``drain``'s objects) for the scheduler to ``take`` when their requests finish."""
    with _LOCK:
        for entry in entries or ():
            _BY_ID[entry["request_id"]] = entry
        while len(_BY_ID) > MAX_RECORDS:  # the scheduler takes them; without it, keep the newest
            _BY_ID.popitem(last=False)


def take(request_id: str) -> dict[str, Any] | None:
    """The request's record as a JSON object, removed from the table (the scheduler attaches it to the output)."""
    with _LOCK:
        pending = _PENDING.pop(request_id, None)
    if pending is not None:
        if pending.event is not None:
            pending.event.synchronize()
        pending.build(pending.host.tolist())
    with _LOCK:
        return _BY_ID.pop(request_id, None)


def by_request(request_id: str) -> RequestRecord:
    """The record of vLLM's (internal or external) request id in this process; ``LookupError`` if none."""
    finish_pending(block=True)
    with _LOCK:
        made = list(RECORDS)
    for entry in reversed(made):
        if request_id in (entry.request_id, entry.external_id):
            return entry
    raise LookupError(f"macer.vllm.records: no record of request {request_id!r} in this process (records live in "
                      "the engine core's process: read RequestOutput.kv_transfer_params['macer'], or set "
                      "VLLM_ENABLE_V1_MULTIPROCESSING=0)")


def nonfinite_note(layers: Sequence[int]) -> str | None:
    """The record's note when the stages reading ``layers`` ranked non-finite scores (their device flags). The
    transformers runtime raises there; inside the engine an error would stop every request, so the request goes on
    and its record is a WARNING that names the layer: its selection is the non-finite rule's (NaN ranks last), not a
    ranking by attention."""
    if not layers:
        return None
    return (f"the attention scores of the stage reading layer {min(layers)} are not finite (NaN or inf in that layer's "
            "queries or keys: its weights or the hidden states entering it); the stage kept tokens by the non-finite "
            "rule, not by attention, and the outputs are likely NaN too")


def last() -> RequestRecord:
    """The most recent record; ``LookupError`` if none was made in this process."""
    finish_pending(block=True)
    if not RECORDS:
        raise LookupError("macer.vllm.records: no request has been recorded in this process (with multiprocessing "
                          "on, records live in the engine core's process: read RequestOutput.kv_transfer_params"
                          "['macer'], or set VLLM_ENABLE_V1_MULTIPROCESSING=0 to read them in-process)")
    return RECORDS[-1]


def clear() -> None:
    """Forget every record (tests)."""
    finish_pending(block=True)
    with _LOCK:
        RECORDS.clear()
        _BY_ID.clear()
        _OUTBOX.clear()
