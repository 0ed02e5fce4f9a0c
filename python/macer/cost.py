"""``macer.cost``: the paper's cost model and exact run accounting. The code lives in ``macer.tools.cost`` (the tools
room, docs/architecture.md); this module re-exports its public names, the same objects, so that ``import macer.cost``
and ``from macer.cost import ...`` work as before."""

from macer.tools.cost import *  # noqa: F403
from macer.tools.cost import __all__ as __all__
