"""The end-to-end benchmark's PNG (``benchmarks.e2e.output.plot``) on the committed results: nothing it writes is
clipped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from figure_checks import kept_figures, texts_outside

from benchmarks import common
from benchmarks.e2e import output


@pytest.mark.parametrize("name", ["bench_e2e_cpu", "bench_e2e_cpu_policies"])
def test_benchmark_plot_titles_fit_the_figure(name, tmp_path):
    """The committed plots' column title listed every policy's decode time on one line, which ran past the figure's
    right edge (its third title line was clipped); it is wrapped to the column."""
    data = json.loads((Path(common.RESULTS_DIR) / f"{name}.json").read_text())
    with kept_figures() as figures:
        device = data["meta"]["machine"]["device"]
        output.plot(data["rows"], tmp_path / f"{name}.png", title=device)
        assert len(figures) == 1
        assert texts_outside(figures[0]) == []
        assert figures[0].get_suptitle() == device
