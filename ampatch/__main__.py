"""``python -m ampatch``: the ``ampatch`` command."""

from ampatch.cli import main

raise SystemExit(main())
