"""``macer.cli``: the ``macer`` command line. The code lives in ``macer.tools.cli`` (the tools room,
docs/architecture.md); this module re-exports its public names, the same objects, so that ``import macer.cli`` and
``from macer.cli import ...`` work as before."""

from macer.tools.cli import *  # noqa: F403
from macer.tools.cli import __all__ as __all__
