"""The per-request record (issue 28 item 1, issue 30 item 5): what it holds, its log line and level, the JSON object a
request's output carries, and how it is found by request id. The engine's records: ``test_batched.py``."""

from __future__ import annotations

import json
import logging

import pytest
from macer.vllm.records import RECORDS, by_request, clear, external_id, format_layers, last, record, take
from vllm_cases import macer_log

from macer_kernels import Budget

pytestmark = pytest.mark.vllm


def test_a_record_is_kept_logged_and_found_by_request_id():
    """Each record is kept, logged on `vllm.macer` (INFO; WARNING when it carries a note) and found by vLLM's
    internal id or the caller's; the scheduler takes it once, as a JSON object of every field."""
    clear()
    with pytest.raises(LookupError, match="kv_transfer_params"):
        last()
    with macer_log() as seen:
        entry = record("req-7-0a1b2c3d", Budget(3, 1, 2), {"audio": [4], "video": [9, 12]}, [20, 20, 17, 17],
                       policy="macer", keep_ratio=0.25, prompt={"audio": 4, "video": 8, "text": 8})
        second = record("8-deadbeef", None, {}, [9, 9], policy="full", keep_ratio=1.0,
                        prompt={"audio": 0, "video": 0, "text": 9}, note="served without pruning: why")
    assert [r.levelno for r in seen] == [logging.INFO, logging.WARNING]
    assert seen[0].getMessage() == ("macer: request req-7-0a1b2c3d policy=macer keep_ratio=0.25 budget=3 (audio 1, "
                                    "video 2) kept audio 1/4 video 2/8 layers [20x2, 17x2]")
    assert seen[1].getMessage().endswith("kept audio 0/0 video 0/0 layers [9x2] NOTE: served without pruning: why")
    assert last() is second and list(RECORDS) == [entry, second]
    assert entry.external_id == "req-7" and entry.kept == {"audio": 1, "video": 2}
    assert entry.kept_rows == {"audio": (4,), "video": (9, 12)}
    assert by_request("req-7") is entry and by_request("8-deadbeef") is second
    with pytest.raises(LookupError, match="no record of request 'nope'"):
        by_request("nope")
    as_json = json.loads(json.dumps(take("req-7-0a1b2c3d")))
    assert as_json == {"request_id": "req-7-0a1b2c3d", "external_id": "req-7", "policy": "macer", "keep_ratio": 0.25,
                       "budget": {"total": 3, "audio": 1, "video": 2}, "prompt": {"audio": 4, "video": 8, "text": 8},
                       "kept": {"audio": 1, "video": 2}, "kept_rows": {"audio": [4], "video": [9, 12]},
                       "layer_tokens": [20, 20, 17, 17], "note": None}
    assert take("req-7-0a1b2c3d") is None  # taken once
    assert format_layers([5]) == "[5]"
    clear()


def test_external_id_strips_vllms_suffix(monkeypatch):
    assert external_id("chat-1-abcdefgh") == "chat-1"
    assert external_id("0_parent-1a2b3c4d") == "0_parent"
    assert external_id("short-abc") == "short-abc"
    monkeypatch.setenv("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "1")
    assert external_id("chat-1-abcdefgh") == "chat-1-abcdefgh"


def test_a_later_record_of_a_request_appends_its_note_to_the_first():
    """Guards a request's first record being overwritten (review finding 8: a pruned request whose recompute the
    scheduler cut was served unpruned from then on, and its second record replaced the first, so the caller read
    "served without pruning" for a request whose first tokens were pruned): the first record stays, in this process,
    in what the scheduler takes and in what the worker sends, with the later note appended once (a WARNING); a later
    record with nothing new changes nothing."""
    from macer.vllm.records import LATER, drain

    clear()
    first = record("9-0a1b2c3d", Budget(3, 1, 2), {"audio": [4], "video": [9, 12]}, [20, 20, 17, 17],
                   policy="macer", keep_ratio=0.25, prompt={"audio": 4, "video": 8, "text": 8})
    cut = "served without pruning: the scheduler split the prompt"
    with macer_log() as seen:
        merged = record("9-0a1b2c3d", None, {"audio": [0, 1, 2, 3]}, [20, 20, 20, 20], policy="macer",
                        keep_ratio=0.25, prompt={"audio": 4, "video": 8, "text": 8}, note=cut)
    assert [r.levelno for r in seen] == [logging.WARNING] and seen[0].getMessage().endswith(f"NOTE: {LATER}{cut}")
    assert merged.note == f"{LATER}{cut}"
    assert (merged.budget, merged.kept_rows, merged.layer_tokens) == (first.budget, first.kept_rows, first.layer_tokens)
    assert list(RECORDS) == [merged]
    assert record("9-0a1b2c3d", None, {}, [20] * 4, policy="macer", keep_ratio=0.25, prompt={}, note=cut) is merged
    assert record("9-0a1b2c3d", None, {}, [20] * 4, policy="macer", keep_ratio=0.25, prompt={}) is merged
    sent = drain()
    assert sent[-1] == merged.as_dict() and all(entry["kept"] == {"audio": 1, "video": 2} for entry in sent)
    assert take("9-0a1b2c3d") == merged.as_dict()
    clear()
