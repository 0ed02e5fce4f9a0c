"""Checks of the figures the project draws (``macer demo``'s PNG, ``diagnostics.png``, the benchmark plot)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def texts_outside(fig: Any) -> list[str]:
    """What of ``fig`` reaches past its edges: the texts (titles, labels, notes) by content, and ``"<ticks>"`` when
    only the tick labels do (matplotlib keeps undrawn tick labels outside the view, so those are judged by the
    figure's tight bounding box, which counts only what is drawn)."""
    from matplotlib.text import Text

    fig.canvas.draw()
    renderer, box = fig.canvas.get_renderer(), fig.bbox
    outside = []
    ticks = {id(label) for ax in fig.axes for label in (*ax.get_xticklabels(), *ax.get_yticklabels())}
    for text in fig.findobj(Text):
        if id(text) in ticks or not text.get_visible() or not text.get_text().strip():
            continue
        ext = text.get_window_extent(renderer)
        if ext.x0 < box.x0 - 1 or ext.x1 > box.x1 + 1 or ext.y0 < box.y0 - 1 or ext.y1 > box.y1 + 1:
            outside.append(text.get_text())
    tight, inches = fig.get_tightbbox(renderer), fig.bbox_inches
    eps = 1 / fig.dpi
    if not outside and (tight.x0 < inches.x0 - eps or tight.x1 > inches.x1 + eps or tight.y0 < inches.y0 - eps
                        or tight.y1 > inches.y1 + eps):
        outside.append("<ticks>")
    return outside


@contextlib.contextmanager
def kept_figures() -> Iterator[list[Any]]:
    """The figures given to ``matplotlib.pyplot.close`` inside the block, kept open to be read back there and closed
    on leaving it."""
    import matplotlib.pyplot as plt

    close, figures = plt.close, []
    plt.close = figures.append
    try:
        yield figures
    finally:
        plt.close = close
        for fig in figures:
            close(fig)
