"""MACER's own work per 7B prefill (issue 37 item 5: < 0.3 ms at the 2.4k clip, < 1 ms at 16.3k): what a prefill pays
for MACER on the host and on the device, added up row by row.

    python -m benchmarks.bench_own_work                  # CPU: host part measured, device part estimated
    python -m benchmarks.bench_own_work --record         # benchmarks/results/bench_own_work_cpu.{csv,json}
    python -m benchmarks.bench_own_work --device cuda    # GPU: host and device parts measured (not run yet)

The parts of one prefill (Qwen2.5-Omni-7B readout shapes: 28 query heads, 4 KV heads, head dim 128, bf16, 28
layers; MACER at rho = 0.25 with the paper's 7B settings; the processor's layout of the 2.4k and 16.3k clips, as
``bench_plan``):

* ``plan``: ``plan_prefill`` on a fresh ``PromptFacts`` (``cold``: a layout never seen; ``cached``: seen before);
* ``setup``: ``PrefillState(plan, device)``: the prompt's tables uploaded, the stages' output buffers carved, and
  the stages prepared (``prepared`` setting: the layout's ``PreparedStage`` already cached, as on every prefill
  after the first of a clip shape; ``first`` setting: prepared now);
* ``stage <layer>``: the stage's host call (``PrefillState.run`` then ``take_pending``: one ``StagePlan.launch`` on
  the CUDA path) and, in ``device_us``, its kernels;
* ``flag read``: ``nonfinite_hits`` on the stages' non-finite flags at the end of the prefill (one device-to-host
  copy on a GPU).

On CPU the CUDA path's host code runs against a recording stand-in for ``macer_kernels._C`` (as
``tests/core/test_prepared_stage.py``): every Python and torch step of the stage runs, the launch itself is recorded,
not made. ``host_us`` is then measured (median over ``--calls`` prefills, one thread) and excludes the real
``cudaLaunchKernelEx`` calls (five per stage, ~2.5-4 us each on an H200 host, *est.*: ``launch_us_est``).
``device_us`` is an estimate on CPU (``device_source``): the kernel plan's budget for the restructured kernels
(docs/cuda.md lists it per kernel). With ``--device cuda`` both are measured: host time of each call alone
(its kernels run after the clock stops), device time between CUDA events around it.

Not counted here (reported beside it in docs/cuda.md): the transformers engine's compaction of its own tensors
before the next layer (``PromptPrefill.compact``: ``compact_many`` on the hidden states, RoPE tables and position
ids), which the deferred prepared stage folds into the stage's launch once the engine uses it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_e2e import CLIPS
from benchmarks.bench_plan import clip_facts
from benchmarks.e2e import output

TARGET_US = {"paper": 300.0, "long": 1000.0}
"""Issue 37's bound on MACER's own work per 7B prefill."""

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 28, 4, 128, 28
"""Qwen2.5-Omni-7B's thinker."""

LAUNCH_US_EST = 3.0
"""Host cost of one ``cudaLaunchKernelEx`` on an H200 host (*est.*, 2.5-4 us); a stage makes five."""

LAUNCHES_PER_STAGE = 5

DEVICE_US_EST = {"paper": (10.0, 10.0), "long": (61.0, 31.0)}
"""Kernel time per stage (scores + selection + compaction), the kernel plan's budget for the restructured kernels
(``kernel-plan.md`` 5.4: 2.4k ~4+2+4 and ~3.5+4+2.5 us; 16.3k ~8+3+50 and ~7+10+14 us): *estimates*."""

FLAG_READ_DEVICE_US_EST = 10.0
"""One small device-to-host copy and its synchronisation at the end of the prefill (*est.*)."""


class _Plan:
    def __init__(self, ext: _RecordingExt):
        self.ext = ext

    def launch(self, *args: Any, **kwargs: Any) -> None:
        self.ext.launches += 1


class _RecordingExt:
    """Stands in for ``macer_kernels._C``: makes plans and counts launches, runs nothing."""

    MAX_STAGE_MODALITIES = 8

    def __init__(self) -> None:
        self.launches = 0
        names = ("float32", "float16", "bfloat16", "float64", "int8", "uint8", "int16", "int32", "int64")
        self.DTYPE_CODES = {name: code for code, name in enumerate(names)}
        self._values = {"modality_scores_max_head_dim": 256, "modality_scores_workspace_bytes": 4096,
                        "modality_scores_counter_count": 72, "stage_chain_supported": True,
                        "select_cta_max_n": 1 << 15}

    def StagePlan(self, *args: Any, **kwargs: Any) -> _Plan:  # the extension's name
        return _Plan(self)

    def __getattr__(self, name: str) -> Any:
        if name not in self._values:
            raise AttributeError(name)
        value = self._values[name]
        return lambda *args, **kwargs: value


@contextlib.contextmanager
def recording_cuda_stage() -> Iterator[_RecordingExt]:
    """The ``cuda`` backend's prepared stage run on CPU tensors against ``_RecordingExt`` (the device and stream
    queries and the CUDA-tensor check stubbed: they read metadata only; validation off, as in serving)."""
    import macer_kernels as mk
    import macer_kernels.cuda  # registers the cuda implementations
    from macer_kernels import _validate, backend, use_backend
    from macer_kernels.cuda import _ext
    from macer_kernels.cuda import stage as cuda_stage

    fake = _RecordingExt()
    patches = [(_ext, "_ext_module", fake), (_ext, "IMPORT_ERROR", None),
               (cuda_stage, "prepared_on_cuda", lambda labels, coverage: True),
               (cuda_stage, "launch_args", lambda t: (0, 7)), (cuda_stage, "_raw_stream", lambda index: 7),
               (cuda_stage, "check_cuda_tensor", lambda *args: None),
               (backend, "_runs_on", lambda name, device: True), (_validate, "HOST_DEVICE_TYPES", ())]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    had_status, status = "cuda" in backend._status_cache, backend._status_cache.get("cuda")
    env = os.environ.pop("MACER_VALIDATE", None)
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        backend._status_cache["cuda"] = None
        with use_backend("cuda"), mk.validation(False):
            yield fake
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)
        if had_status:
            backend._status_cache["cuda"] = status
        else:
            backend._status_cache.pop("cuda", None)
        if env is not None:
            os.environ["MACER_VALIDATE"] = env


def _readouts(plan: Any, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A readout layer's query and key per stage, at the length entering it (bf16; values do not matter to the
    host path; on a GPU they are random)."""
    out = []
    for i, stage in enumerate(plan.stages):
        g = torch.Generator(device=device).manual_seed(i)
        n = stage.tokens_before
        q = torch.randn(1, HEADS, n, HEAD_DIM, device=device, generator=g, dtype=torch.bfloat16)
        k = torch.randn(1, KV_HEADS, n, HEAD_DIM, device=device, generator=g, dtype=torch.bfloat16)
        out.append((q, k))
    return out


def _prefill(plan: Any, device: torch.device, readouts: list, clock: dict[str, list[float]],
             events: dict[str, list] | None) -> None:
    """One prefill's MACER parts, each timed alone on the host (and between CUDA events with ``events``)."""
    from macer.core.prefill import PrefillState, nonfinite_hits

    def timed(name: str, fn: Any) -> Any:
        if events is not None:
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter_ns()
        result = fn()
        clock.setdefault(name, []).append((time.perf_counter_ns() - t0) / 1e3)
        if events is not None:
            end.record()
            events.setdefault(name, []).append((start, end))
        return result

    state = timed("setup", lambda: PrefillState(plan, device))
    for stage, (q, k) in zip(plan.stages, readouts, strict=True):
        def run(q: torch.Tensor = q, k: torch.Tensor = k) -> None:
            state.run(q, k, None, 1e-6)
            state.take_pending()

        timed(f"stage {stage.spec.layer}", run)
    timed("flag read", lambda: nonfinite_hits(state.nonfinite_flags()))


def measure(clip: str, device: torch.device, calls: int, warmup: int, model: Any, eot: int) -> list[dict]:
    import macer
    from macer.core import policy as core
    from macer.core import stage as core_stage

    facts = clip_facts(model, **CLIPS[clip], num_layers=LAYERS, end_of_turn=eot)
    policy = macer.MacerConfig(keep_ratio=0.25, end_of_turn_token_id=eot)
    clock: dict[str, list[float]] = {}
    for setting in ("cold", "cached"):
        core.plan_prefill(policy, dataclasses.replace(facts))
        for i in range(warmup + calls):
            fresh = dataclasses.replace(facts)
            if setting == "cold":
                core.clear_plan_cache()
            t0 = time.perf_counter_ns()
            core.plan_prefill(policy, fresh)
            if i >= warmup:
                clock.setdefault(f"plan ({setting})", []).append((time.perf_counter_ns() - t0) / 1e3)
    plan = core.plan_prefill(policy, dataclasses.replace(facts))
    readouts = _readouts(plan, device)
    events: dict[str, list] | None = {} if device.type == "cuda" else None
    first: dict[str, list[float]] = {}
    saved = core_stage._PREPARED
    try:
        for _ in range(3):  # the layout's stages prepared at each first prefill
            core_stage._PREPARED = OrderedDict()
            _prefill(plan, device, readouts, first, None)
    finally:
        core_stage._PREPARED = saved
    for i in range(warmup + calls):
        _prefill(plan, device, readouts, clock, events if i >= warmup else None)
    if warmup:
        for name in [n for n in clock if not n.startswith("plan")]:
            clock[name] = clock[name][warmup:]
    if events is not None:
        torch.cuda.synchronize(device)
    rows = []
    est = DEVICE_US_EST[clip]
    for name, times in clock.items():
        row: dict[str, Any] = {"clip": clip, "tokens": facts.length, "part": name,
                               "host_us": round(statistics.median(times), 1)}
        if name == "setup":
            row["host_us_first_prefill"] = round(statistics.median(first["setup"]), 1)
        launches = LAUNCHES_PER_STAGE if name.startswith("stage") else 0
        row["launch_us_est"] = launches * LAUNCH_US_EST if device.type == "cpu" else 0.0
        if events is not None and name in events:
            row["device_us"] = round(statistics.median(s.elapsed_time(e) * 1e3 for s, e in events[name]), 1)
            row["device_source"] = "measured (CUDA events around the call)"
        elif name.startswith("stage"):
            index = [f"stage {s.spec.layer}" for s in plan.stages].index(name)
            row["device_us"], row["device_source"] = est[index], "estimate (kernel-plan.md 5.4)"
        elif name == "flag read":
            row["device_us"], row["device_source"] = FLAG_READ_DEVICE_US_EST, "estimate (one small copy + sync)"
        else:
            row["device_us"], row["device_source"] = 0.0, "host only"
        rows.append(row)
    # The total of one prefill: the cold or the cached plan, and every other part once.
    measured = list(rows)
    for setting in ("cold", "cached"):
        parts = [r for r in measured if not r["part"].startswith("plan") or r["part"] == f"plan ({setting})"]
        host = sum(r["host_us"] + r["launch_us_est"] for r in parts)
        dev = sum(r["device_us"] for r in parts)
        rows.append({"clip": clip, "tokens": facts.length, "part": f"total (plan {setting})",
                     "host_us": round(host, 1), "launch_us_est": None, "device_us": round(dev, 1),
                     "device_source": "sum", "own_work_us": round(host + dev, 1),
                     "target_us": TARGET_US[clip], "within_target": host + dev <= TARGET_US[clip]})
    columns = ("clip", "tokens", "part", "host_us", "host_us_first_prefill", "launch_us_est", "device_us",
               "device_source", "own_work_us", "target_us", "within_target")
    return [{c: r.get(c) for c in columns} for r in rows]


def run(args: argparse.Namespace) -> int:
    from macer.testing import SYNTHETIC_TOKENS, build_thinker

    torch.set_num_threads(1)
    device = torch.device(args.device)
    machine = output.machine(device)
    load_start = list(os.getloadavg())
    model = build_thinker(num_layers=2, hidden_size=32, num_heads=2, num_kv_heads=1)
    rows = []
    context = recording_cuda_stage() if device.type == "cpu" else contextlib.nullcontext()
    with context as fake:
        for clip in args.clips:
            rows += measure(clip, device, args.calls, args.warmup, model, SYNTHETIC_TOKENS.im_end)
        launches = None if fake is None else fake.launches
    meta = {"machine": machine, "settings": {"calls": args.calls, "warmup": args.warmup, "layers": LAYERS,
                                             "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                                             "dtype": "bfloat16", "policy": "MacerConfig(keep_ratio=0.25)",
                                             "torch_threads": 1},
            "host": "recording _C (launches recorded, not made)" if device.type == "cpu" else "real _C",
            "recorded_launches": launches,
            "estimates": {"launch_us_est": LAUNCH_US_EST, "device_us_est": DEVICE_US_EST,
                          "flag_read_device_us_est": FLAG_READ_DEVICE_US_EST},
            "load_average_at_start": load_start}
    from benchmarks import common

    common.report(args.name or f"bench_own_work_{device.type}", rows, meta, output.output_dir(args.out, args.record),
                  f"{machine.get('cpu_model')} ({device})  git {machine['git_sha']}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_own_work",
                                     description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--clips", nargs="+", choices=sorted(CLIPS), default=["paper", "long"])
    parser.add_argument("--calls", type=int, default=200, help="timed prefills")
    parser.add_argument("--warmup", type=int, default=20, help="untimed prefills first")
    parser.add_argument("--record", action="store_true", help="write to benchmarks/results/ (default out/bench/)")
    parser.add_argument("--out", type=Path, default=None, help="results folder")
    parser.add_argument("--name", default=None, help="file stem of the results (default bench_own_work_<device>)")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.warmup < 0:
        raise SystemExit("--calls must be >= 1 and --warmup >= 0")
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
