"""`apex.testing.common_utils` under the alias: what Apex's own tests import from it."""
from __future__ import annotations

import functools
import os
import unittest
from collections.abc import Callable
from typing import Any

__all__ = ["TEST_WITH_ROCM", "skipIfRocm"]

TEST_WITH_ROCM = os.getenv("APEX_TEST_WITH_ROCM", "0") == "1"


def skipIfRocm(fn: Callable) -> Callable:  # noqa: N802 - Apex's name
    """Skip the test when APEX_TEST_WITH_ROCM=1, as Apex's helper did."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if TEST_WITH_ROCM:
            raise unittest.SkipTest("test doesn't currently work on ROCm stack.")
        return fn(*args, **kwargs)
    return wrapper
