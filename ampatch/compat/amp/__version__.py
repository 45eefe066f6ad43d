"""`apex.amp.__version__`: Apex amp's version number (it said 0.1 to the end)."""
from __future__ import annotations

__all__ = ["VERSION", "__version__"]

VERSION = (0, 1, 0)
__version__ = ".".join(map(str, VERSION))
