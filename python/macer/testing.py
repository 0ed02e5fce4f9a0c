"""``macer.testing``: Qwen2.5-Omni thinkers with random weights and synthetic prompts. The code lives in
``macer.tools.synthetic.qwen2_5_omni`` (the tools room, docs/architecture.md); this module re-exports its public
names, the same objects, so that ``import macer.testing`` and ``from macer.testing import ...`` work as before."""

from macer.tools.synthetic.qwen2_5_omni import *  # noqa: F403
from macer.tools.synthetic.qwen2_5_omni import __all__ as __all__
