"""The search: O0 for reference, every candidate, repairs of the failed ones, interleaved
re-timing of the fastest that qualify, and the choice, within a time budget.

Ctrl-C (KeyboardInterrupt) stops the run in progress; the result then holds what was
measured and the best qualifying policy so far (`Result.interrupted`). The budget stops the
search before a run that would not fit (the last run's wall time is the estimate).
"""
from __future__ import annotations

import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TextIO

from ampatch.runs import process
from ampatch.tune import timing
from ampatch.tune.candidates import REFERENCE, Candidate
from ampatch.tune.measure import Job, Measured, measured, run_candidate
from ampatch.tune.repair import MAX_REPAIRS, suggest

__all__ = ["Result", "Search", "NoReference"]


class NoReference(RuntimeError):
    """The O0 run failed or never trained under amp: nothing to judge the candidates against."""


@dataclass
class Result:
    """What the search measured and chose."""

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


class Search:
    """One search (see the module docstring); progress lines go to `log`."""

    def __init__(self, job: Job, candidates: Sequence[Candidate], tolerance: float, budget_s: float | None,
                 log: TextIO, repair: bool = True, rounds: int = timing.ROUNDS) -> None:
        self.job, self.todo, self.log, self.repair, self.rounds = job, list(candidates), log, repair, rounds
        self.result = Result(tolerance)
        self.deadline = None if budget_s is None else time.time() + budget_s
        self.last_wall = 0.0
        self.runs = 0
        self.retimed: list[Candidate] = []   # the candidates re-timed against O0 (the finalists)

    def say(self, text: str) -> None:
        self.log.write(f"ampatch tune: {text}\n")
        self.log.flush()

    def fits(self) -> bool:
        """Whether another run fits in the budget."""
        return self.deadline is None or time.time() + self.last_wall * 1.1 < self.deadline

    def left(self) -> str:
        return "" if self.deadline is None else f", {max(0.0, self.deadline - time.time()):.0f}s of budget left"

    def measure(self, c: Candidate, why: str) -> Measured:
        self.runs += 1
        self.say(f"[{self.runs}] {c.label}: {why}{self.left()}")
        start = time.time()
        done = run_candidate(c, self.job, self.log)
        self.last_wall = max(self.last_wall, time.time() - start) if self.runs > 1 else time.time() - start
        ref = self.result.reference.row if self.result.reference is not None else None
        m = measured(c, done, ref, self.result.tolerance)
        if m.step_ms is not None:
            self.result.timings.setdefault(c.label, []).append(m.step_ms)
        self.say(f"    {'qualifies' if m.qualifies else 'fails'}: {m.reason}"
                 + (f"; {m.step_ms:.1f} ms/step" if m.step_ms else ""))
        return m

    def run(self) -> Result:
        """The whole search; raises `NoReference` when O0's run fails."""
        try:
            self._run()
        except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM/SIGHUP (process.Stopped)
            self.result.interrupted = process.signal_of(exc)
            self.result.notes.append(f"interrupted ({signal.Signals(self.result.interrupted).name}): the choice is "
                                     "the best of what was measured.")
        self.choose()
        return self.result

    def _run(self) -> None:
        r = self.result
        ref = self.measure(REFERENCE, "the FP32 reference")
        if not ref.row.ok:
            raise NoReference(f"the O0 reference run failed: {ref.row.error}")
        if not ref.row.losses:
            raise NoReference("the O0 reference run never completed an optimizer step after amp.scale_loss: "
                              "the loss's backward must run inside `with amp.scale_loss(loss, optimizer) as "
                              "scaled: scaled.backward()`.")
        r.reference = ref
        runs = len(self.todo) + timing.RETIME * self.rounds + self.rounds
        self.say(f"trying {len(self.todo)} candidate(s): {', '.join(c.label for c in self.todo)}; about "
                 f"{self.last_wall:.1f}s a run: {runs} runs, about {runs * self.last_wall / 60:.1f} min, plus 2 "
                 "per repair" + ("" if self.deadline is None else ", within the budget"))
        failed = []
        for i, c in enumerate(self.todo, 1):
            if not self.fits():
                r.notes.append(f"budget reached before {c.label} ran.")
                return
            m = self.measure(c, f"candidate {i}/{len(self.todo)}")
            r.candidates.append(m)
            if not m.qualifies and m.row.ok:
                failed.append(c)
        if self.repair:
            for c in sorted(failed, key=Candidate.simplicity):
                self.repair_one(c)
        self.retime()

    def repair_one(self, c: Candidate) -> None:
        r = self.result
        for _ in range(MAX_REPAIRS):
            if not self.fits():
                r.notes.append(f"budget reached before repairing {c.label}.")
                return
            self.runs += 1
            self.say(f"[{self.runs}] {c.label}: recording it to find what to keep in FP32{self.left()}")
            s = suggest(c, self.job, self.log)
            if s.candidate is None:
                self.say(f"    no repair: {s.why}")
                m = r.measured_of(c)
                if m is not None and s.step_fault:
                    r.candidates[r.candidates.index(m)] = Measured(
                        m.candidate, m.row, False, f"{m.reason}; {s.why}", m.finite, m.deviation, True)
                return
            if not self.fits():
                return
            m = self.measure(s.candidate, f"repair of {c.label}: {s.why}")
            r.candidates.append(m)
            if m.qualifies or not m.row.ok:
                return
            c = s.candidate

    def retime(self) -> None:
        r = self.result
        qual = sorted((m for m in r.candidates if m.qualifies and m.step_ms), key=lambda m: m.step_ms)[:timing.RETIME]
        if not qual or self.rounds < 1:
            return
        by_label = {REFERENCE.label: REFERENCE, **{m.candidate.label: m.candidate for m in qual}}
        plan = timing.order(REFERENCE.label, [m.candidate.label for m in qual], self.rounds)
        self.say(f"re-timing {', '.join(by_label)} interleaved ({self.rounds} round(s))")
        for label in plan:
            if not self.fits():
                r.notes.append("budget reached during re-timing: fewer repeats than planned.")
                break
            c = by_label[label]
            self.runs += 1
            self.say(f"[{self.runs}] {label}: re-timing{self.left()}")
            done = run_candidate(c, self.job, self.log)
            ms = measured(c, done, None, r.tolerance).step_ms
            if ms is not None:
                r.timings.setdefault(label, []).append(ms)
                r.repeats.setdefault(label, []).append(ms)
                self.say(f"    {ms:.1f} ms/step")
        self.retimed = [m.candidate for m in qual]

    def choose(self) -> None:
        """The fastest qualifying policy (ties, within the spread, to the simpler one); O0
        when none qualifies or O0 is faster beyond the spread."""
        r = self.result
        r.spread = timing.spread(r.repeats if any(len(v) > 1 for v in r.repeats.values()) else r.timings)
        ms = timing.step_ms(r.compared())
        qual = [m.candidate for m in r.candidates if m.qualifies and m.candidate.label in ms]
        if self.retimed:  # the finalists: the others were slower at their first timing
            qual = [c for c in qual if c in self.retimed]
        if not qual:
            r.chosen = REFERENCE
            r.why = ("no half policy trains like FP32 within the tolerance" if r.candidates
                     else "no candidate was measured") + ": O0 (FP32)."
            return
        labels = {c.label: c for c in qual}
        best = labels[timing.simplest_of_fastest(list(labels), ms, r.spread, lambda x: labels[x].simplicity())]
        fastest = min(labels, key=lambda x: ms[x])
        o0 = ms.get(REFERENCE.label)
        if o0 is not None and timing.faster(o0, ms[best.label], r.spread):
            r.chosen = REFERENCE
            r.why = (f"every qualifying half policy is slower than O0 here beyond the {r.spread:.1%} spread "
                     f"between repeats (best: {best.label}, {ms[best.label]:.1f} ms against {o0:.1f}).")
            return
        r.chosen = best
        dev = r.measured_of(best).deviation
        o0_text = "speed unknown" if not o0 else (
            f"{o0 / ms[best.label]:.2f}x O0's speed" + ("" if timing.faster(ms[best.label], o0, r.spread) else
                                                        f", within the {r.spread:.1%} spread of O0's"))
        tie = "" if best.label == fastest else (f"; as fast as {fastest} within the {r.spread:.1%} spread between "
                                                "repeats, and simpler")
        r.why = f"the fastest policy that trains like FP32 ({o0_text}; deviation {dev:.2%}){tie}."
