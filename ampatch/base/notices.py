"""Warnings the user must see: logged to the "ampatch" logger, and raised as a Python
warning that points at the user's own line (the first frame outside ampatch), however
deep in ampatch the warning was decided. `verbosity=0` silences both.

The "ampatch" logger carries `RecordGuard`, so that its records never break the logging
configuration of the script they run in (see there).
"""
from __future__ import annotations

import logging
import os
import sys
import types
import warnings

logger = logging.getLogger("ampatch")

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # ampatch/, not base/
_MISSING_FIELD = "-"  # the value of a format field a record lacks
_MAX_FILLS = 8


def _missing_field(exc: BaseException) -> str | None:
    """The record attribute a formatter failed on (KeyError inside logging's ValueError, or an
    AttributeError of a formatter that reads the record itself)."""
    for err in (exc, exc.__context__, exc.__cause__):
        if isinstance(err, KeyError) and err.args and isinstance(err.args[0], str):
            return err.args[0]
        if isinstance(err, AttributeError) and isinstance(getattr(err, "name", None), str):
            return err.name
    return None


class RecordGuard(logging.Filter):
    """A filter on the "ampatch" logger that makes its records safe for any configuration they
    propagate to. Scripts add fields to their records with a filter on the root logger
    (`%(rank)s` in a format, set by `logging.getLogger().addFilter(...)`); a logger's filters
    see only the records logged through it, so ampatch's records reached the root's handlers
    without the field and each broke the format ("--- Logging error ---"). Here:

    - the root logger's filters run on ampatch's records too (a record they reject is dropped,
      as the script asked for its own records);
    - a field that a handler's format still cannot find is set to "-".
    """

    def filter(self, record: logging.LogRecord) -> bool:
        root = logging.getLogger()
        if root.filters:
            try:
                result = root.filter(record)
            except Exception:  # a broken user filter must not stop ampatch's own messages
                result = True
            if not result:
                return False
            if isinstance(result, logging.LogRecord) and result is not record:  # Python 3.12+: a modified copy
                record.__dict__.update(result.__dict__)
        for handler in _handlers(logger):
            _fill_missing_fields(handler, record)
        return True


def _handlers(start: logging.Logger) -> list[logging.Handler]:
    """The handlers a record of `start` reaches (logging's own walk up the hierarchy)."""
    found: list[logging.Handler] = []
    current: logging.Logger | None = start
    while current is not None:
        found.extend(current.handlers)
        if not current.propagate:
            break
        current = current.parent
    return found


def _fill_missing_fields(handler: logging.Handler, record: logging.LogRecord) -> None:
    formatter = handler.formatter
    if formatter is None:
        return
    for _ in range(_MAX_FILLS):
        try:
            formatter.format(record)
            return
        except Exception as exc:  # the same failure would be logging's "--- Logging error ---"
            name = _missing_field(exc)
            if name is None or name in record.__dict__:
                return
            setattr(record, name, _MISSING_FIELD)


RECORD_GUARD = RecordGuard()
if not any(isinstance(f, RecordGuard) for f in logger.filters):
    logger.addFilter(RECORD_GUARD)


def set_verbosity(verbosity: int) -> None:
    """The "ampatch" logger's level for a session's `verbosity`: 0 errors only, 1 info, 2 debug."""
    logger.setLevel(logging.ERROR if verbosity <= 0 else logging.INFO if verbosity == 1 else logging.DEBUG)


def user_stacklevel() -> int:
    """The `stacklevel` that makes `warnings.warn`, called by the function that calls this,
    name the first frame outside the ampatch package (1 would name that function, 2 its
    caller)."""
    frame: types.FrameType | None = sys._getframe(2)
    level = 2
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    return level


def warn(message: str, verbosity: int = 1, category: type[Warning] = UserWarning) -> None:
    """Log `message` as a warning and, at verbosity >= 1, warn at the user's line."""
    logger.warning(message)
    if verbosity >= 1:
        warnings.warn(message, category, stacklevel=user_stacklevel())
