"""``macer.diagnostics``: the paper's attention diagnostics. The code lives in ``macer.tools.diagnostics`` (the tools
room, docs/architecture.md); this module re-exports its public names, the same objects, so that ``import
macer.diagnostics`` and ``from macer.diagnostics import ...`` work as before."""

from macer.tools.diagnostics import *  # noqa: F403
from macer.tools.diagnostics import __all__ as __all__
