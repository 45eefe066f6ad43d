"""Running longer where the runs cannot tell yet: the one rule `tune` and `diagnose` follow.

A verdict the runs cannot give at the steps asked for (O0's progress not yet beyond its noise
or its rounding, paired differences too noisy for the tolerance) may come with more steps. The
runs that cannot tell run again with twice the steps, as long as

- the script goes that far (one that ended before the steps asked for cannot run longer);
- the budget fits them: each at twice the wall time of the slowest run so far (start-up
  included, so an overestimate);
- without a budget, at most `MAX_DOUBLINGS` doublings of the first steps (a run whose loss never
  moves would double forever).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

__all__ = ["MAX_DOUBLINGS", "DEFAULT_BUDGET_S", "Longer"]

MAX_DOUBLINGS = 6          # without a budget: at most 2**6 times the first steps
DEFAULT_BUDGET_S = 600.0   # tune's --budget, and diagnose's for its verification runs


@dataclass
class Longer:
    """The steps runs take now (`steps`), from `first`; `deadline` a time.time() (None: no budget);
    `script_ends`: the steps the script stopped at by itself (None: not seen to stop early)."""

    first: int
    steps: int
    deadline: float | None = None
    script_ends: int | None = None

    def why_not(self, runs: int, wall_s: float) -> str | None:
        """Why `runs` runs of twice the steps cannot be made, each `wall_s` at the present steps
        (None: they can)."""
        if self.script_ends is not None and self.script_ends <= self.steps:
            return f"the script ends after {self.script_ends} optimizer steps"
        if self.deadline is None:
            if self.steps >= self.first * 2 ** MAX_DOUBLINGS:
                return f"{self.steps} steps is {2 ** MAX_DOUBLINGS} times the first, the most without a budget"
            return None
        if time.time() + runs * 2.0 * wall_s * 1.1 >= self.deadline:
            return f"the budget does not fit {runs} run(s) of {2 * self.steps} steps"
        return None

    def saw(self, asked: int, ran: int | None) -> None:
        """A run asked for `asked` steps made `ran`: fewer means the script ends there."""
        if ran is not None and ran < asked:
            self.script_ends = ran

    def double(self) -> int:
        self.steps *= 2
        return self.steps
