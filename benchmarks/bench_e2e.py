"""End-to-end benchmark, full prefill vs MACER (the same as ``macer bench``; see ``macer.bench`` for what it measures).

    python benchmarks/bench_e2e.py                 # CPU mode here, GPU mode where CUDA is available
    python benchmarks/bench_e2e.py --mode gpu --text-shapes 7B
"""

import argparse

from macer import bench


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_arguments(parser)
    return bench.run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
