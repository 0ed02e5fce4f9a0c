"""Reduce pytest-benchmark's raw JSON of ``tests/tools/test_microbench.py`` to a small results file.

The raw file holds every timed round and the CPU flags (100k+ lines); this keeps per op and provider the median,
the interquartile range and the number of rounds, and the naive / torch ratio, with the machine, thread count, timer,
load average, versions and commit the raw file names. On a shared machine, one thread and CPU time
(``time.process_time``) are far less disturbed by other processes than wall time::

    OMP_NUM_THREADS=1 pytest tests/tools/test_microbench.py --benchmark-enable -k bench_ \
        --benchmark-timer time.process_time \
        --benchmark-json /tmp/microbench_raw.json
    python -m benchmarks.microbench_summary /tmp/microbench_raw.json benchmarks/results/microbench_cpu.json
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from benchmarks.common import environment


def summarize(raw: dict) -> dict:
    rows = []
    for bench in raw["benchmarks"]:
        # Names look like "test_bench_modality_scores[naive-cpu-N2.4k]".
        match = re.fullmatch(r"test_bench_(\w+)\[(\w+)-(\w+)(?:-(\S+))?\]", bench["name"])
        if match is None:
            continue
        op, provider, device, size = match.groups()
        stats = bench["stats"]
        rows.append({"op": op, "provider": provider, "device": device, "size": size, "median_ms": 1e3 * stats["median"],
                     "iqr_ms": 1e3 * stats["iqr"], "rounds": stats["rounds"],
                     "torch_threads": bench.get("extra_info", {}).get("torch_threads"),
                     "load_average_1min": bench.get("extra_info", {}).get("load_average")})
    medians = {(r["op"], r["device"], r["size"], r["provider"]): r["median_ms"] for r in rows}
    ratios = {f"{op}[{device}{'-' + size if size else ''}]": medians[(op, device, size, "naive")] / t
              for (op, device, size, provider), t in medians.items()
              if provider == "torch" and (op, device, size, "naive") in medians}
    loads = [r["load_average_1min"] for r in rows if r["load_average_1min"] is not None]
    machine, commit = raw["machine_info"], raw.get("commit_info", {})
    cpu = machine.get("cpu", {})
    meta = {
        "machine": f"{cpu.get('brand_raw', machine.get('processor'))}, {cpu.get('count')} cores ({machine['node']})",
        "torch_threads": sorted({r["torch_threads"] for r in rows if r["torch_threads"] is not None}),
        "commit": commit.get("id", "unknown")[:7] + ("-dirty" if commit.get("dirty") else ""),
        "recorded": raw.get("datetime"),
        "timer": sorted({b.get("options", {}).get("timer") for b in raw["benchmarks"]} - {None}),
        "versions": {k: v for k, v in environment("cpu").items() if k in ("torch", "triton", "python")},
        "load_average_1min_during_run": [min(loads), max(loads)] if loads else None,
        "naive": "macer_kernels.reference: the scorer in fp32 (GQA expanded per head, full softmax materialised), "
                 "the literal O(n k) Python loop of the coverage greedy, the sorted() top-k, Python arithmetic",
    }
    return {"meta": meta, "naive_over_torch": ratios, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw", type=Path, help="pytest-benchmark --benchmark-json output")
    parser.add_argument("out", type=Path, help="summary file to write")
    args = parser.parse_args(argv)
    summary = summarize(json.loads(args.raw.read_text()))
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    for name, ratio in summary["naive_over_torch"].items():
        print(f"{name:32s} naive / torch = {ratio:.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
