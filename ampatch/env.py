"""Every environment variable ampatch reads, named once.

The `ampatch` command talks to the runs it starts through these (a forced level, where to
write the report, live progress, ...); a user can set them by hand for the same effect.
Each name is read or written only through this module's constants.
"""
from __future__ import annotations

import os

__all__ = ["OPT_LEVEL", "HALF_DTYPE", "KEEP_FP32", "LOSS_SCALE", "MAX_STEPS", "REPORT", "PROGRESS",
           "TIME_WRAPPERS", "DIAGNOSE", "POLICY", "ALL", "get", "flag", "positive_int", "without_ampatch"]

OPT_LEVEL = "AMPATCH_OPT_LEVEL"          # force every initialize to this level
HALF_DTYPE = "AMPATCH_HALF_DTYPE"        # force the half dtype of O1-O3 (float16/bfloat16)
KEEP_FP32 = "AMPATCH_KEEP_FP32"          # modules to keep in FP32, comma-separated names
LOSS_SCALE = "AMPATCH_LOSS_SCALE"        # force the loss scale: a number or "dynamic"
MAX_STEPS = "AMPATCH_MAX_STEPS"          # end the process after this many optimizer steps
REPORT = "AMPATCH_REPORT"                # write the session's report() as JSON here at exit
PROGRESS = "AMPATCH_PROGRESS"            # append "step loss" lines here while recording
TIME_WRAPPERS = "AMPATCH_TIME_WRAPPERS"  # "1": time every O1 wrapper's own work
DIAGNOSE = "AMPATCH_DIAGNOSE"            # write per-module precision statistics here at exit
POLICY = "AMPATCH_POLICY"                # apply this policy file (ampatch tune's) to every initialize

ALL = (OPT_LEVEL, HALF_DTYPE, KEEP_FP32, LOSS_SCALE, MAX_STEPS, REPORT, PROGRESS, TIME_WRAPPERS, DIAGNOSE, POLICY)
PREFIX = "AMPATCH_"


def get(name: str) -> str | None:
    """The variable's value, or None where it is unset or empty."""
    return os.environ.get(name) or None


def flag(name: str) -> bool:
    """A switch: set to anything but "" or "0"."""
    return os.environ.get(name, "") not in ("", "0")


def positive_int(name: str) -> int | None:
    """A count given in the variable (None when unset); anything but a positive integer is
    a ValueError naming the variable."""
    value = get(name)
    if value is None:
        return None
    if not value.strip().isdigit() or int(value) < 1:
        raise ValueError(f"{name}={value!r}: expected a positive integer (or leave it unset).")
    return int(value)


def without_ampatch(environ: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of `environ` (default: this process's) with no AMPATCH_* variable."""
    source = os.environ if environ is None else environ
    return {k: v for k, v in source.items() if not k.startswith(PREFIX)}
