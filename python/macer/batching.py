"""``macer.batching``: left-padded batches of single-prompt inputs. The code lives in ``macer.tools.batching`` (the
tools room, docs/architecture.md); this module re-exports its public names, the same objects, so that ``import
macer.batching`` and ``from macer.batching import ...`` work as before."""

from macer.tools.batching import *  # noqa: F403
from macer.tools.batching import __all__ as __all__
