"""The `fp8` extra: pyproject pins the torchao release `ampatch.model.fp8` is tested with, and
the test command installs it, so the FP8 tests run in CI instead of skipping."""
from __future__ import annotations

import re
from pathlib import Path

from ampatch.model import fp8

ROOT = Path(__file__).resolve().parents[2]


def test_pyproject_pins_the_tested_torchao_and_the_test_command_installs_it() -> None:
    pins = re.findall(r'^fp8 = \["torchao==([\d.]+)"\]$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert len(pins) == 1 and pins[0].startswith(fp8.TORCHAO_VERSION + ".")
    extras = re.search(r'^EXTRAS="([^"]+)"', (ROOT / "scripts" / "test.sh").read_text(), re.M).group(1)
    assert "fp8" in extras.split(",")
