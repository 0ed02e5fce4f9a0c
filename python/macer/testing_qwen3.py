"""``macer.testing_qwen3``: Qwen3-Omni thinkers with random weights and synthetic prompts. The code lives in
``macer.tools.synthetic.qwen3_omni`` (the tools room, docs/architecture.md); this module re-exports its public names,
the same objects, so that ``import macer.testing_qwen3`` and ``from macer.testing_qwen3 import ...`` work as
before."""

from macer.tools.synthetic.qwen3_omni import *  # noqa: F403
from macer.tools.synthetic.qwen3_omni import __all__ as __all__
