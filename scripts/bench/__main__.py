"""`python scripts/bench ...` (or `python -m bench ...` with scripts/ on the path): the bench's
command line, see bench/__init__.py."""
import sys
from pathlib import Path

if not __package__:  # run as a folder: Python put scripts/bench/ on the path, the package needs scripts/
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from bench.cli import main  # noqa: E402  (after the path is set)

raise SystemExit(main())
