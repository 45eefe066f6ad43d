"""`apex.testing` under the alias: what Apex's own tests import (`common_utils`)."""
from __future__ import annotations

from . import common_utils

__all__ = ["common_utils"]
