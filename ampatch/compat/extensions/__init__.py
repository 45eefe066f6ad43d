"""`apex.extensions` under the alias, where some Apex versions import their compiled modules
from: `amp_C` and `apex_C` (ampatch's foreach-op stand-ins), the one place of Apex's compiled
modules here (top-level `amp_C` / `apex_C` under the alias are these modules too; the kernels
themselves are in `kernels` and `optim_kernels`). Its other compiled modules fail
to import with the PyTorch replacement named (`missing.NOT_PROVIDED`)."""
from __future__ import annotations

from typing import Any

from ..missing import NotProvidedError, not_provided_message
from . import amp_C, apex_C

__all__ = ["amp_C", "apex_C"]
__path__ = []  # a package, so `import apex.extensions.syncbn` reaches the alias's finder


def __getattr__(name: str) -> Any:
    """`from apex.extensions import syncbn`: the ImportError naming the replacement."""
    if name.startswith("__"):
        raise AttributeError(name)
    raise NotProvidedError(not_provided_message(f"apex.extensions.{name}"), name=f"apex.extensions.{name}")
