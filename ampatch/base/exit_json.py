"""JSON written about a session at interpreter exit (or earlier, when its job is done): the
report ``AMPATCH_REPORT`` asks for (`exit_report`), and the diagnose recording
(`ampatch.record.child` makes its own `ExitJson`). Under torchrun only rank 0 writes.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ampatch.errors import ConfigError

logger = logging.getLogger("ampatch")

__all__ = ["ExitJson", "exit_report", "process_rank", "check_writable"]


def check_writable(path: str, variable: str) -> None:
    """Raise `ValueError` naming `variable` when the JSON it asks for could not be written to
    `path` (a missing or read-only folder, a folder in its place): found at `initialize`,
    not at exit, when the run is over and nothing is written."""
    folder = os.path.dirname(os.path.abspath(path))
    reason = ("it is a folder" if os.path.isdir(path)
              else f"the folder {folder} does not exist" if not os.path.isdir(folder)
              else "the file is read-only" if os.path.exists(path) and not os.access(path, os.W_OK)
              else f"the folder {folder} is not writable" if not os.access(folder, os.W_OK)
              else None)
    if reason:
        raise ConfigError(f"{variable}={path!r}: the file cannot be written ({reason}); point {variable} at a file "
                          "in a writable folder, or unset it.")


class ExitJson:
    """Writes JSON about the newest tracked source to its path at interpreter exit, or
    earlier through `write(source)`; at most once per tracking.

    One hook per process and kind: a script that calls `initialize` several times writes
    about its last session (one exit hook per session would run newest-first and leave the
    oldest). Under torchrun every rank inherits the same path: only rank 0 writes it.
    """

    def __init__(self, produce: Callable[[Any], dict[str, Any]], what: str) -> None:
        self.produce, self.what = produce, what
        self.source: Any = None
        self.final: dict[str, Any] | None = None  # what a released source would have written
        self.path = ""
        self.written = False
        self.registered = False

    def track(self, source: Any, path: str) -> None:
        self.source, self.final, self.path, self.written = source, None, path, False
        if not self.registered:
            atexit.register(self.write)
            self.registered = True

    def holds_source(self) -> bool:
        """Whether a source is tracked, or what a released one would write is kept."""
        return self.source is not None or self.final is not None

    def release(self, source: Any) -> None:
        """`source` is closing: keep what it would write (small, bounded), not the source with
        its models and optimizers."""
        if self.source is source:
            try:
                self.final = self.produce(source)
            except Exception:
                logger.exception("ampatch: could not take the %s of the closing session", self.what)
            self.source = None

    def write(self, source: Any = None) -> None:
        """Write the tracked source's JSON now (given `source`: only if it is the tracked one)."""
        if self.written or (source is not None and source is not self.source) or process_rank() != 0:
            return
        try:
            data = self.produce(self.source) if self.source is not None else self.final
            if data is not None:
                with open(self.path, "w") as f:
                    json.dump(data, f)
                self.written = True
        except Exception as exc:  # at exit or inside a step: say why (whatever the logger's level), never fail the run
            logger.exception("ampatch: could not write the %s to %s", self.what, self.path)
            warnings.warn(f"ampatch: could not write the {self.what} to {self.path}: {exc}", RuntimeWarning,
                          stacklevel=2)


exit_report = ExitJson(lambda session: session.report().to_dict(), "report")


def process_rank() -> int:
    """This process's rank: torchrun's RANK, else torch.distributed's (0 outside distributed runs).
    Read at exit, when the process group may be gone already."""
    if os.environ.get("RANK", "").isdigit():
        return int(os.environ["RANK"])
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
