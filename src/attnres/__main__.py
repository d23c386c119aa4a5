"""``python -m attnres``: the command line (see :mod:`attnres.cli`)."""

from attnres.cli import main

raise SystemExit(main())
