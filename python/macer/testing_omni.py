"""``macer.testing_omni``: tiny random Qwen-Omni checkpoints with their processor files. The code lives in
``macer.tools.synthetic.checkpoints`` (the tools room, docs/architecture.md); this module re-exports its public
names, the same objects, so that ``import macer.testing_omni`` and ``from macer.testing_omni import ...`` work as
before."""

from macer.tools.synthetic.checkpoints import *  # noqa: F403
from macer.tools.synthetic.checkpoints import __all__ as __all__

if __name__ == "__main__":  # python -m macer.testing_omni FAMILY DIR (docs/serving.md)
    raise SystemExit(main())  # noqa: F405
