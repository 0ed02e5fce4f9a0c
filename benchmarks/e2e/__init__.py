"""Parts of the end-to-end benchmark (``python -m benchmarks.bench_e2e``): measurement, the naive comparison, output."""
