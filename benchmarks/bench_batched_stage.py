"""Host cost of one MACER stage over a left-padded batch of B prompts (issue 37 items 1 and 4): the prepared stage
that ``macer.hf.batch`` runs now against the composed ops it ran before.

    python -m benchmarks.bench_batched_stage             # CPU: host time against a recording _C
    python -m benchmarks.bench_batched_stage --record    # benchmarks/results/bench_batched_stage_cpu.{csv,json}

One stage of a batch of B prompts around the 2.4k clip (Qwen2.5-Omni-7B readout shapes: 28 query heads, 4 KV heads,
head dim 128, bf16; hidden 3584; an audio top-K and a video coverage selection at keep 0.25 with per-sample budgets;
unequal lengths, so per-sample padding), from the readout to the next layer's inputs:

* ``prepared`` (now): ``BatchPrefill._run_deferred``, the code the engine runs at the next layer's entry: the cached
  prepared stage's key and lookup, its one call (scoring, selection and the gather of the row tables and the layer
  inputs: hidden states, RoPE cos/sin, M-RoPE position ids), and the two ``torch.where`` that restore the padding
  of the row and label tables. ``prepared, per-sample rows``: the same with the questions ending at different
  distances from their prompts' ends (one ``torch.gather`` of the query's rows more).
* ``composed`` (before, the op sequence of ``macer.hf.batch`` at 182449c, reproduced here): the question rows
  uploaded and found by ``searchsorted``, the query rows gathered, the label and chunk tables gathered from the
  current rows, ``select_stage`` (its host checks, the budget table's upload, scoring and selection), then the
  re-pack: the row table gathered and ``compact_many`` of the layer inputs.

On CPU the CUDA backend's host code runs against a recording stand-in for ``macer_kernels._C`` (as
``bench_own_work``): every Python and torch step runs, the kernel launches are recorded, not made (the stand-in
copies a precomputed valid keep into the selection's output so that the ops after it read valid indices: a
``memmove`` of ``B x W x 8`` bytes, in both paths). The torch ops that stay (gathers, ``where``, ``searchsorted``)
run on CPU tensors here, where on a GPU each is a kernel launch: ``torch_ops`` counts them (every ATen call of the
stage, views included) and ``ext_calls`` the module's launch calls, so the per-stage launch count on a GPU is their
sum minus the views. ``host_us`` is the median over ``--calls`` stages, one thread, after ``--warmup``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.bench_own_work import _RecordingExt, recording_cuda_stage
from benchmarks.e2e import output

HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 28, 4, 128, 3584
WIDTH = 2385  # the 2.4k clip's prompt (bench_own_work's "paper" clip)
PAD_STEPS = (0, 37, 120, 301, 9, 64, 211, 150)  # sample b's left padding: unequal lengths
QUESTION, TAIL = 4, 5  # the question's last rows, then the chat template's rows after it
KEEP = 0.25
AUDIO, VIDEO = 1, 2
VIEWS = {"aten.view.default", "aten.expand.default", "aten.slice.Tensor", "aten.select.int", "aten.unsqueeze.default",
         "aten.t.default", "aten.transpose.int", "aten.alias.default", "aten.squeeze.dim", "aten._unsafe_view.default"}


class _Ext(_RecordingExt):
    """``bench_own_work``'s recording ``_C`` with the composed path's launchers: each records its call; the two
    selections write ``keep`` (and zero flags) so that the ops after them read valid indices."""

    def __init__(self) -> None:
        super().__init__()
        self.keep: torch.Tensor | None = None
        self.calls = 0
        self._values["modality_scores_path"] = ("sa", "")

    def write_keep(self, keep: int, flags: int) -> None:
        assert self.keep is not None
        ctypes.memmove(keep, self.keep.data_ptr(), self.keep.numel() * 8)
        if flags:
            ctypes.memset(flags, 0, self.keep.shape[0])

    def StagePlan(self, *args: Any, **kwargs: Any) -> Any:
        ext = self

        class Plan:
            def launch(self, **call: Any) -> None:
                ext.launches += 1
                ext.calls += 1
                ext.write_keep(call["keep"], call["nonfinite"])

        return Plan()

    def select_cta(self, **call: Any) -> None:
        self.calls += 1
        self.write_keep(call["out"], call["nonfinite"])

    def modality_scores(self, **call: Any) -> None:
        self.calls += 1

    def compact_layouts(self, **call: Any) -> None:
        self.calls += 1


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _batch(b: int, shift: bool, g: torch.Generator) -> dict[str, Any]:
    """The batch's tables and the stage's inputs: labels by original padded row (PAD_LABEL on the padding), chunk
    ids, the current rows (no stage before: the original rows), the readout's query and key and the layer inputs."""
    from macer_kernels import PAD_LABEL, StageModality

    pads = list(PAD_STEPS[:b])
    labels = torch.full((b, WIDTH), PAD_LABEL, dtype=torch.long)
    chunks = torch.zeros(b, WIDTH, dtype=torch.long)
    counts: dict[int, list[int]] = {AUDIO: [], VIDEO: []}
    questions = []
    for i, pad in enumerate(pads):
        n = WIDTH - pad
        tail = TAIL + (3 * i if shift else 0)  # shifted: each question ends at its own distance from the end
        media = n - 16 - QUESTION - tail - 12
        row = torch.zeros(n, dtype=torch.long)
        kinds = torch.tensor([VIDEO] * 7 + [AUDIO] * 3).repeat(media // 10 + 1)[:media]
        row[16:16 + media] = kinds
        labels[i, pad:] = row
        chunks[i, pad + 16:pad + 16 + media] = torch.arange(media) * 8 // media
        counts[AUDIO].append(int((kinds == AUDIO).sum()))
        counts[VIDEO].append(int((kinds == VIDEO).sum()))
        questions.append(range(WIDTH - tail - QUESTION, WIDTH - tail))
    mods = [StageModality(AUDIO, counts[AUDIO], [round(KEEP * c) for c in counts[AUDIO]]),
            StageModality(VIDEO, counts[VIDEO], [round(KEEP * c) for c in counts[VIDEO]], coverage_weight=0.2,
                          num_chunks=8)]
    valid = labels != PAD_LABEL
    rows = torch.where(valid, torch.arange(WIDTH), -1)
    query = torch.randn(b, WIDTH, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16).transpose(1, 2)
    key = torch.randn(b, WIDTH, KV_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16).transpose(1, 2)
    hidden = torch.randn(b, WIDTH, HIDDEN, generator=g).to(torch.bfloat16)
    cos = torch.randn(b, WIDTH, HEAD_DIM, generator=g).to(torch.bfloat16)
    sin = torch.randn(b, WIDTH, HEAD_DIM, generator=g).to(torch.bfloat16)
    position_ids = torch.randint(0, 4000, (3, b, WIDTH), generator=g)
    lengths = [WIDTH - pad - sum(c[i] - k[i] for c, k in ((m.count, m.keep) for m in mods))
               for i, pad in enumerate(pads)]
    return dict(pads=pads, labels=labels, chunks=chunks, rows=rows, mods=mods, questions=questions, query=query,
                key=key, tensors=[hidden, cos, sin, position_ids], dims=[1, 1, 1, 2], lengths=lengths)


def _true_keep(x: dict[str, Any]) -> torch.Tensor:
    """The stage's keep from the PyTorch backend (what the stand-in writes)."""
    from macer_kernels import select_stage, use_backend

    positions = torch.tensor([list(r) for r in x["questions"]])
    b = len(x["pads"])
    q = x["query"].gather(2, positions[:, None, :, None].expand(b, HEADS, QUESTION, HEAD_DIM))
    with use_backend("torch"):
        return select_stage(q, x["key"], x["labels"], x["mods"], chunk_ids=x["chunks"], query_positions=positions,
                            padding=x["pads"]).contiguous()


def _prepared(x: dict[str, Any]) -> Any:
    """``BatchPrefill._run_deferred`` on a batch holding just what it reads."""
    from macer.hf.batch import BatchPrefill, _BatchedStage

    batch = BatchPrefill.__new__(BatchPrefill)
    b = len(x["pads"])

    def call() -> Any:
        batch.rows, batch.labels, batch.chunks = x["rows"], x["labels"], x["chunks"]
        # The first stage of a prefill: the prompt's tables are the current rows' (BatchPrefill.__init__).
        batch.pads, batch._tables, batch.nonfinite = list(x["pads"]), (x["labels"], x["chunks"]), []
        batch.deferred = _BatchedStage(3, x["mods"], x["questions"], x["query"], x["key"], None, 1e-6,
                                       list(range(b)), x["lengths"])
        return batch._run_deferred(list(x["tensors"]), list(x["dims"]))

    return call


def _composed(x: dict[str, Any]) -> Any:
    """The op sequence of ``macer.hf.batch`` at 182449c: ``_run_batched`` at the readout, then ``compact``'s
    re-pack (the mask is rebuilt in both paths alike and is not counted)."""
    from macer.core.transfer import upload

    from macer_kernels import PAD_LABEL, compact_many, select_stage

    original = [[r for r in q] for q in x["questions"]]  # no stage before: original rows = current rows

    def call() -> Any:
        rows_table, query, key = x["rows"], x["query"], x["key"]
        rows = upload(torch.tensor(original, dtype=torch.long), rows_table.device)
        positions = torch.searchsorted(rows_table, rows)
        b, hq, _, d = query.shape
        q = query.gather(2, positions[:, None, :, None].expand(b, hq, positions.shape[1], d))
        safe = rows_table.clamp(min=0)
        labels = torch.where(rows_table >= 0, x["labels"].gather(1, safe), PAD_LABEL)
        chunks = x["chunks"].gather(1, safe).clamp_(min=0)
        keep, _flags = select_stage(q, key, labels, x["mods"], chunk_ids=chunks, query_positions=positions,
                                   scale=None, eps=1e-6, padding=x["pads"], return_flags=True)
        real = keep >= 0
        new_rows = torch.where(real, rows_table.gather(1, keep.clamp(min=0)), -1)
        return keep, new_rows, compact_many(list(x["tensors"]), keep, list(x["dims"]))

    return call


def measure(b: int, calls: int, warmup: int, fake: _Ext) -> list[dict[str, Any]]:
    rows = []
    for path, shift in (("composed (before)", False), ("prepared (now)", False),
                        ("prepared, per-sample rows (now)", True)):
        x = _batch(b, shift, torch.Generator().manual_seed(b))
        fake.keep = _true_keep(x)
        call = _composed(x) if path.startswith("composed") else _prepared(x)
        times = []
        for i in range(warmup + calls):
            t0 = time.perf_counter_ns()
            call()
            if i >= warmup:
                times.append((time.perf_counter_ns() - t0) / 1e3)
        before = fake.calls
        with _Ops() as ops:
            call()
        torch_ops = [op for op in ops.ops if op not in VIEWS]
        rows.append({"batch": b, "width": WIDTH, "path": path, "host_us": round(statistics.median(times), 1),
                     "host_us_min": round(min(times), 1), "ext_calls": fake.calls - before,
                     "torch_ops": len(torch_ops), "views": len(ops.ops) - len(torch_ops),
                     "torch_op_names": " ".join(sorted(set(o.replace("aten.", "") for o in torch_ops)))})
    return rows


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    machine = output.machine(torch.device("cpu"))
    load_start = list(os.getloadavg())
    rows: list[dict[str, Any]] = []
    import benchmarks.bench_own_work as own

    saved = own._RecordingExt
    own._RecordingExt = _Ext  # type: ignore[misc]  (recording_cuda_stage makes the stand-in)
    try:
        with recording_cuda_stage() as fake:
            from macer_kernels.cuda import compact, modality_scores

            patched = [(m, name, getattr(m, name)) for m in (compact, modality_scores)
                       for name in ("launch_args", "check_cuda_tensor")]
            compact.launch_args = modality_scores.launch_args = lambda t: (0, 7)  # type: ignore[assignment]
            compact.check_cuda_tensor = modality_scores.check_cuda_tensor = lambda *a: None  # type: ignore[assignment]
            try:
                for b in args.batch:
                    rows += measure(b, args.calls, args.warmup, fake)  # type: ignore[arg-type]
            finally:
                for module, name, value in patched:
                    setattr(module, name, value)
    finally:
        own._RecordingExt = saved  # type: ignore[misc]
    meta = {"machine": machine, "settings": {"calls": args.calls, "warmup": args.warmup, "width": WIDTH,
                                             "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                                             "hidden": HIDDEN, "dtype": "bfloat16", "keep": KEEP,
                                             "pads": list(PAD_STEPS), "torch_threads": 1},
            "host": "recording _C (launches recorded, not made; torch ops run on CPU tensors)",
            "load_average_at_start": load_start}
    from benchmarks import common

    common.report(args.name or "bench_batched_stage_cpu", rows, meta, output.output_dir(args.out, args.record),
                  f"{machine.get('cpu_model')} (cpu, recording _C)  git {machine['git_sha']}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_batched_stage",
                                     description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--batch", nargs="+", type=int, default=[2, 4, 8], help="batch sizes (1 to 8)")
    parser.add_argument("--calls", type=int, default=100, help="timed stages per path")
    parser.add_argument("--warmup", type=int, default=10, help="untimed stages first")
    parser.add_argument("--record", action="store_true", help="write to benchmarks/results/ (default out/bench/)")
    parser.add_argument("--out", type=Path, default=None, help="results folder")
    parser.add_argument("--name", default=None, help="file stem of the results (default bench_batched_stage_cpu)")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.warmup < 0 or not all(1 <= b <= len(PAD_STEPS) for b in args.batch):
        raise SystemExit(f"--calls must be >= 1, --warmup >= 0 and every --batch in [1, {len(PAD_STEPS)}]")
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
