"""``python -m macer ...`` is the ``macer`` console script."""

from macer.tools.cli import main

raise SystemExit(main())
