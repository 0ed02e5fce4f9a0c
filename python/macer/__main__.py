"""``python -m macer ...`` is the ``macer`` console script."""

from macer.cli import main

raise SystemExit(main())
