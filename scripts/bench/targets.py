"""Targets: a measured ratio and the limit it should stay under ("measured <= limit"),
printed and recorded in one format."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Target:
    limit: float
    what: str  # what is compared, as the report's line says it

    def met(self, value: float) -> bool:
        return value <= self.limit

    def line(self, value: float, width: int = 55) -> str:
        """The report's line: what, the value, the limit, met or MISSED."""
        return f"  {self.what:<{width}} {value:>8.3f}  <= {self.limit:<5} {'met' if self.met(value) else 'MISSED'}"

    def record(self, value: float) -> dict[str, Any]:
        """The JSON form."""
        return {"limit": self.limit, "value": value, "met": self.met(value), "what": self.what}


@dataclass(frozen=True)
class TargetBlock:
    """Targets listed under one heading ("targets (issue 8)"), keyed by their flat ratio key."""

    title: str
    targets: dict[str, Target]
    width: int = 55  # of the "what" column

    def lines(self, flat: dict[str, float]) -> list[str]:
        """The heading, then a line per target that was measured (the heading always)."""
        return [self.title] + [t.line(flat[k], self.width) for k, t in self.targets.items() if k in flat]

    def records(self, flat: dict[str, float]) -> dict[str, dict[str, Any]]:
        return {k: t.record(flat[k]) for k, t in self.targets.items() if k in flat}
