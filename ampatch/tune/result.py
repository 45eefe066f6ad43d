"""What a search measured and chose (`Result`): O0's runs at each length, every candidate's
verdict, the timings, the choice and why, or why the search stopped without one."""
from __future__ import annotations

from dataclasses import dataclass, field

from ampatch.runs.deviation import Reference
from ampatch.runs.verdict import Decider, Rule
from ampatch.tune import timing
from ampatch.tune.candidates import REFERENCE, Candidate
from ampatch.tune.measure import Measured

__all__ = ["Result"]


@dataclass
class Result:
    """What the search measured and chose (`chosen` None with `cannot_tell`: nothing was)."""

    tolerance: float
    reference: Measured | None = None
    candidates: list[Measured] = field(default_factory=list)
    timings: dict[str, list[float]] = field(default_factory=dict)   # label -> each run's median step ms
    repeats: dict[str, list[float]] = field(default_factory=dict)   # ... of the interleaved re-timing runs only
    spread: float | None = None
    chosen: Candidate | None = None
    why: str = ""
    interrupted: int | None = None   # the signal that stopped the search (SIGINT: Ctrl-C)
    notes: list[str] = field(default_factory=list)
    objective: str = "speed"   # "memory": the fewest bytes per trained parameter (see the module docstring)
    references: dict[int, Measured] = field(default_factory=dict)   # O0 at each step count it ran
    stopped: str | None = None   # why the search stopped before a choice (no reference, no progress)
    no_reference: bool = False   # ... because O0's run cannot be a reference (failed, unsound), not for progress
    decide: Decider | None = None  # ... and what would decide, when something would

    @property
    def rule(self) -> Rule:
        return Rule(self.tolerance)

    @property
    def basis(self) -> Reference | None:
        """O0's curve as the reference: what the deviations are relative to."""
        return self.reference.row.reference() if self.reference is not None else None

    @property
    def cannot_tell(self) -> bool:
        """The search ended without a verdict it can stand by: no policy chosen, no policy file."""
        return self.interrupted is None and self.chosen is None and (
            self.stopped is not None or any(m.undecided for m in self.candidates))

    @property
    def steps(self) -> list[int]:
        """The step counts O0 ran at, in order (the last: the longest)."""
        return sorted(self.references)

    def compared(self) -> dict[str, list[float]]:
        """The timings that compare: a re-timed policy's interleaved repeats (run side by side
        with O0's), else its one timing."""
        return {k: self.repeats.get(k) or v for k, v in self.timings.items()}

    def step_ms(self, c: Candidate) -> float | None:
        return timing.step_ms(self.compared()).get(c.label)

    def measured_of(self, c: Candidate) -> Measured | None:
        if c == REFERENCE:
            return self.reference
        return next((m for m in self.candidates if m.candidate == c), None)
