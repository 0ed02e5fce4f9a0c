"""The README's model snippet runs as written (issue #13 item 4): every ```python block after a
``<!-- readme-snippet`` marker is executed, and what it prints is checked against the run."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def _snippets() -> list[str]:
    text = README.read_text()
    return re.findall(r"<!-- readme-snippet[^>]*-->\s*```python\n(.*?)```", text, flags=re.S)


def test_readme_model_snippet_runs_as_written():
    snippets = _snippets()
    assert len(snippets) == 1 and "macer.compress" in snippets[0]
    out = io.StringIO()
    namespace: dict = {}
    with contextlib.redirect_stdout(out):
        exec(compile(snippets[0], str(README), "exec"), namespace)
    trace = namespace["trace"]
    lines = out.getvalue().splitlines()
    assert lines[0] == str(trace.budget) and trace.budget.total < trace.last.n_audio + trace.last.n_video
    assert lines[1] == str(trace.layer_tokens) and trace.layer_tokens[-1] < trace.layer_tokens[0]
    prompt = namespace["inputs"]["input_ids"].shape[1]
    assert prompt < namespace["out"].shape[1] <= prompt + 8
