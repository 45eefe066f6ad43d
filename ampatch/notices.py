"""Warnings the user must see: logged to the "ampatch" logger, and raised as a Python
warning that points at the user's own line (the first frame outside ampatch), however
deep in ampatch the warning was decided. `verbosity=0` silences both.
"""
from __future__ import annotations

import logging
import os
import sys
import warnings

logger = logging.getLogger("ampatch")

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def set_verbosity(verbosity: int) -> None:
    """The "ampatch" logger's level for a session's `verbosity`: 0 errors only, 1 info, 2 debug."""
    logger.setLevel(logging.ERROR if verbosity <= 0 else logging.INFO if verbosity == 1 else logging.DEBUG)


def user_stacklevel() -> int:
    """The `stacklevel` that makes `warnings.warn`, called by the function that calls this,
    name the first frame outside the ampatch package (1 would name that function, 2 its
    caller)."""
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    return level


def warn(message: str, verbosity: int = 1, category: type[Warning] = UserWarning) -> None:
    """Log `message` as a warning and, at verbosity >= 1, warn at the user's line."""
    logger.warning(message)
    if verbosity >= 1:
        warnings.warn(message, category, stacklevel=user_stacklevel())
