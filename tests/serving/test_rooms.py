"""The plugin loads the core and itself only (issue 26, docs/architecture.md): vLLM's entry point, its call, the
labelled architecture's model class and the request guard bring no module of the transformers engine (``macer.hf``)
nor of the tools beside it. A fresh interpreter: this test process has imported ``macer.hf`` for other tests. The
Omni thinker's class imports torchvision, which does not import beside the CPU torch build; its imports are held to
the same rule on the source by ``tests/project/test_layout.py``.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.vllm


def test_the_plugin_and_its_model_classes_load_no_transformers_engine(tmp_path):
    code = ("import sys\n"
            "import macer.vllm\n"
            "macer.vllm.register()\n"
            "from macer.vllm.model import MacerQwen2ForCausalLM\n"
            "from macer.vllm.guard import MacerRequestGuard\n"
            "loaded = sorted(m for m in sys.modules if m == 'macer' or m.startswith('macer.'))\n"
            "others = [m for m in loaded if m != 'macer' and not m.startswith(('macer.core', 'macer.vllm'))]\n"
            "assert {'macer.vllm.model', 'macer.vllm.staged', 'macer.core.prefill'} <= set(loaded), loaded\n"
            "assert others == [], others\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
