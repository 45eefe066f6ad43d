"""The search: O0 for reference, every candidate, repairs of the failed ones, interleaved
re-timing of the fastest that qualify (each repeat judged again), and the choice, within a
time budget.

- The reference must be sound and must learn: an O0 run that fails, records no loss, has a
  non-finite loss or diverges (`deviation.unsound`) stops the search (`NoReference`), and so
  does one whose progress is not beyond its own noise (`NoProgress`: "run more steps"):
  nothing can be judged against it.
- There is no separate noise-floor run: a rerun of O0 with the same seed and data is
  deterministic on a CPU and measures nothing. The noise comes from each run itself: O0's
  scatter around its trend, and each candidate's paired differences from O0 on the same
  batches (`deviation.against`).
- Ctrl-C (KeyboardInterrupt) stops the run in progress; the result then holds what was
  measured and the best qualifying policy so far (`Result.interrupted`).
- The budget stops the search before a run that would not fit: the slowest plain run so far is
  the estimate for a plain run, the slowest recorded run (the diagnose recorder's shadows make
  it slower) for a recorded one, `RECORD_FACTOR` times a plain run until one is measured.
- The choice: the fastest finalist that qualified on every run; a tie (within the spread
  between repeats) goes to the simpler policy. O0 is chosen when no half policy qualifies, or
  when O0 is faster than that choice beyond the spread; a tie with O0 goes to the half policy
  (it trains like FP32: the measurement cannot tell the two apart on speed).
- A candidate whose FP8 was emulated (`tune.fp8`) is judged like the rest and listed with its
  fidelity, but never re-timed or chosen: emulation's step times say nothing of FP8's speed.
- With the "memory" objective: the qualifying policy (O0 included) that holds the fewest
  bytes per trained parameter for training (weight, master copy or compensation, optimizer
  state: `Report.training_bytes_per_param`, counted, not timed); equal footprints go by speed
  as above. No re-timing: one timing each breaks those ties.
"""
from __future__ import annotations

import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TextIO

from ampatch.runs.stats import RunStats
from ampatch.runs import process
from ampatch.runs.deviation import Basis, Reference, unsound
from ampatch.tune import timing
from ampatch.tune.candidates import OBJECTIVES, REFERENCE, Candidate
from ampatch.tune.measure import Job, Measured, measured, run_candidate
from ampatch.tune.repair import MAX_REPAIRS, suggest
from ampatch.runs.verdict import Rule

__all__ = ["Result", "Search", "NoReference", "NoProgress", "reference_of", "RECORD_FACTOR"]

RECORD_FACTOR = 3.0   # a recorded run's time against a plain run's, until one is measured
SAME_BYTES = 0.1      # footprints (bytes per trained parameter) this close are the same memory


class NoReference(RuntimeError):
    """The O0 run failed, never trained under amp, or is unsound: nothing to judge the candidates against."""


class NoProgress(NoReference):
    """O0's loss did not fall beyond its own noise over the run: "run more steps"."""


def reference_of(row: RunStats, steps: int | None = None) -> Reference:
    """O0's row as the reference every candidate is judged against; `NoReference` when it
    cannot be one (failed, no loss, unsound), `NoProgress` when it made no detectable progress
    (`steps`: the steps it ran, for the message)."""
    if not row.ok:
        raise NoReference(f"the O0 reference run failed: {row.error}")
    if not row.losses:
        raise NoReference("the O0 reference run never completed an optimizer step after amp.scale_loss: "
                          "the loss's backward must run inside `with amp.scale_loss(loss, optimizer) as "
                          "scaled: scaled.backward()`.")
    curve = {i * row.losses_every: x for i, x in enumerate(row.losses)}
    why = unsound(curve, row.losses_per_step)
    if why is not None:
        raise NoReference(f"the O0 reference is unsound: {why}. No candidate can be judged against it: make the "
                          "run train at O0 first (`ampatch run --opt-level O0 -- ...`), e.g. a lower learning "
                          "rate, or check the loss and the data.")
    ref = row.reference()
    if ref.basis is not Basis.PROGRESS:
        raise NoProgress(ref.no_progress(steps if steps is not None else row.steps))
    return ref


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
    objective: str = "speed"   # "memory": the fewest bytes per trained parameter (see the module docstring)

    @property
    def rule(self) -> Rule:
        return Rule(self.tolerance)

    @property
    def basis(self) -> Reference | None:
        """O0's curve as the reference: what the deviations are relative to."""
        return self.reference.row.reference() if self.reference is not None else None

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
                 log: TextIO, repair: bool = True, rounds: int = timing.ROUNDS, objective: str = "speed") -> None:
        if rounds < 0:
            raise ValueError(f"rounds must be 0 or more (0: no re-timing), got {rounds}")
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
        self.job, self.todo, self.log, self.repair, self.rounds = job, list(candidates), log, repair, rounds
        self.result = Result(tolerance, objective=objective)
        self.objective = objective
        self.deadline = None if budget_s is None else time.time() + budget_s
        self.last_wall = 0.0                 # the slowest plain run so far
        self.record_wall: float | None = None  # the slowest recorded run so far
        self.runs = 0
        self.retimed: list[Candidate] = []   # the candidates re-timed against O0 (the finalists)

    def say(self, text: str) -> None:
        self.log.write(f"ampatch tune: {text}\n")
        self.log.flush()

    def estimate(self, recorded: bool = False) -> float:
        """The expected wall time of the next run (a recorded one: `recorded`)."""
        if not recorded:
            return self.last_wall
        return self.record_wall if self.record_wall is not None else RECORD_FACTOR * self.last_wall

    def fits(self, recorded: bool = False) -> bool:
        """Whether another run (a recorded one: `recorded`) fits in the budget."""
        return self.deadline is None or time.time() + self.estimate(recorded) * 1.1 < self.deadline

    def left(self) -> str:
        return "" if self.deadline is None else f", {max(0.0, self.deadline - time.time()):.0f}s of budget left"

    def _timed(self, c: Candidate, recorded: bool = False):
        start = time.time()
        done = run_candidate(c, self.job, self.log, record=recorded)
        wall = time.time() - start
        if recorded:
            self.record_wall = max(self.record_wall or 0.0, wall)
        else:
            self.last_wall = max(self.last_wall, wall) if self.runs > 1 else wall
        return done

    def measure(self, c: Candidate, why: str) -> Measured:
        self.runs += 1
        self.say(f"[{self.runs}] {c.label}: {why}{self.left()}")
        done = self._timed(c)
        ref = self.result.reference.row if self.result.reference is not None else None
        m = measured(c, done, ref, self.result.rule)
        if m.step_ms is not None:
            self.result.timings.setdefault(c.label, []).append(m.step_ms)
        self.say(f"    {'qualifies' if m.qualifies else 'fails'}: {m.reason}"
                 + (f"; {m.step_ms:.1f} ms/step" if m.step_ms else ""))
        return m

    def run(self) -> Result:
        """The whole search; raises `NoReference` when O0's run cannot be the reference."""
        try:
            self._run()
        except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM/SIGHUP (process.Stopped)
            self.result.interrupted = process.signal_of(exc)
            self.result.notes.append(f"interrupted ({signal.Signals(self.result.interrupted).name}): the choice is "
                                     "the best of what was measured.")
        self.choose()
        return self.result

    def _reference(self) -> None:
        ref = self.measure(REFERENCE, "the FP32 reference")
        basis = reference_of(ref.row, ref.row.steps or self.job.steps)
        self.result.reference = ref
        self.say(f"    deviations are {basis.describe()}")

    def _run(self) -> None:
        r = self.result
        self._reference()
        runs = len(self.todo) + timing.RETIME * self.rounds + self.rounds
        self.say(f"trying {len(self.todo)} candidate(s): {', '.join(c.label for c in self.todo)}; about "
                 f"{self.last_wall:.1f}s a run: {runs} runs, about {runs * self.last_wall / 60:.1f} min, plus "
                 f"about {self.estimate(True) + self.last_wall:.0f}s per repair (a recorded run and a rerun)"
                 + ("" if self.deadline is None else ", within the budget"))
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
        if self.objective == "speed":
            self.retime()

    def _amend(self, c: Candidate, **changes: object) -> None:
        """Replace `c`'s measurement with `changes` made (its reason, verdict, ...)."""
        r = self.result
        m = r.measured_of(c)
        if m is not None:
            r.candidates[r.candidates.index(m)] = replace(m, **changes)  # type: ignore[arg-type]

    def repair_one(self, c: Candidate) -> None:
        r = self.result
        for _ in range(MAX_REPAIRS):
            if not self.fits(recorded=True):
                r.notes.append(f"budget reached before repairing {c.label} (a recorded run takes about "
                               f"{self.estimate(True):.0f}s).")
                return
            self.runs += 1
            self.say(f"[{self.runs}] {c.label}: recording it to find what to repair{self.left()}")
            start = time.time()
            s = suggest(c, self.job, self.log)
            self.record_wall = max(self.record_wall or 0.0, time.time() - start)
            m = r.measured_of(c)
            if s.finding is not None and m is not None:
                self._amend(c, reason=f"{m.reason}; {s.finding}", step_fault=s.step_fault)
            if s.candidate is None:
                self.say(f"    no repair: {s.why}")
                return
            if not self.fits():
                return
            m = self.measure(s.candidate, f"repair of {c.label}: {s.why}")
            r.candidates.append(m)
            if m.qualifies or not m.row.ok:
                return
            c = s.candidate

    def retime(self) -> None:
        """The fastest qualifying candidates and O0, interleaved; every repeat is judged again
        (a finalist that fails on one no longer qualifies); O0's are timed only."""
        r = self.result
        qual = sorted((m for m in r.candidates if m.qualifies and m.step_ms and not m.emulated),
                      key=lambda m: m.step_ms)[:timing.RETIME]
        if not qual or self.rounds < 1:
            return
        by_label = {REFERENCE.label: REFERENCE, **{m.candidate.label: m.candidate for m in qual}}
        plan = timing.order(REFERENCE.label, [m.candidate.label for m in qual], self.rounds)
        self.say(f"re-timing {', '.join(by_label)} interleaved ({self.rounds} round(s)); each run judged again")
        ref_row = r.reference.row  # type: ignore[union-attr]
        for n, label in enumerate(plan):
            if not self.fits():
                r.notes.append("budget reached during re-timing: fewer repeats than planned.")
                break
            c = by_label[label]
            self.runs += 1
            self.say(f"[{self.runs}] {label}: re-timing{self.left()}")
            again = measured(c, self._timed(c), ref_row, r.rule)
            if c != REFERENCE:
                self._rejudge(c, again, n // len(by_label) + 1)
            if again.step_ms is not None:
                r.timings.setdefault(label, []).append(again.step_ms)
                r.repeats.setdefault(label, []).append(again.step_ms)
                self.say(f"    {again.step_ms:.1f} ms/step" + ("" if c == REFERENCE or again.qualifies
                                                                else f"; fails: {again.reason}"))
        self.retimed = [m.candidate for m in qual]

    def _rejudge(self, c: Candidate, again: Measured, round_: int) -> None:
        """A finalist's repeat: it keeps qualifying only if this run qualifies too; its deviation
        is its worst run's."""
        m = self.result.measured_of(c)
        if m is None:
            return
        worst = max((d for d in (m.deviation, again.deviation) if d is not None), default=None)
        if again.qualifies:
            self._amend(c, deviation=worst)
        elif m.qualifies:
            self._amend(c, qualifies=False, deviation=worst, finite=m.finite and again.finite,
                        reason=f"its re-timing run {round_} fails: {again.reason} (its first run: {m.reason})")

    def choose(self) -> None:
        """The fastest finalist that qualified on every run; a tie among them (within the spread)
        goes to the simpler one. O0 when none qualifies, or when O0 is faster than that choice
        beyond the spread: a tie with O0 goes to the half policy (see the module docstring)."""
        r = self.result
        r.spread = timing.spread(r.repeats if any(len(v) > 1 for v in r.repeats.values()) else r.timings)
        ms = timing.step_ms(r.compared())
        fp8 = [m.candidate.label for m in r.candidates if m.emulated and m.qualifies]
        if fp8:
            r.notes.append(f"{', '.join(fp8)}: trained like FP32, but on FP8 emulated by torchao here (no FP8 tensor "
                           "cores): listed for their fidelity, never chosen for speed; time them on a GPU with FP8 "
                           "tensor cores (CUDA capability 8.9+).")
        if self.objective == "memory":
            return self.choose_memory(ms)
        qual = [m.candidate for m in r.candidates if m.qualifies and not m.emulated and m.candidate.label in ms]
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
            r.why = (f"every qualifying half policy is slower than O0 beyond the {r.spread:.1%} spread between repeats "
                     f"(best: {best.label}, {ms[best.label]:.1f} ms against {o0:.1f}).")
            return
        r.chosen = best
        dev = r.measured_of(best).deviation  # type: ignore[union-attr]
        if not o0:
            speed = "speed unknown"
        elif timing.faster(ms[best.label], o0, r.spread):
            speed = f"{o0 / ms[best.label]:.2f}x O0's speed"
        else:
            speed = (f"{o0 / ms[best.label]:.2f}x O0's speed, a tie with O0 within the {r.spread:.1%} spread between "
                     "repeats, which goes to the half policy")
        tie = "" if best.label == fastest else (f"; as fast as {fastest} within the {r.spread:.1%} spread between "
                                                "repeats, and simpler")
        r.why = f"the fastest policy that trains like FP32 ({speed}; deviation {dev:.2%}){tie}."

    def choose_memory(self, ms: dict[str, float]) -> None:
        """The "memory" objective: the qualifying policy, O0 included, with the fewest bytes per
        trained parameter; footprints within `SAME_BYTES` of each other go to the faster (within
        the spread: the simpler), as `choose` decides."""
        r = self.result
        held = {m.candidate.label: (m.candidate, m.row.train_bytes_per_param)
                for m in ([r.reference] if r.reference is not None else []) + r.candidates
                if (m.qualifies or m.candidate == REFERENCE) and not m.emulated
                and m.row.train_bytes_per_param is not None
                and m.candidate.label in ms}
        if not held:
            r.chosen = REFERENCE
            r.why = "no policy's footprint was measured: O0 (FP32)."
            return
        least = min(b for _, b in held.values())
        tied = {label: c for label, (c, b) in held.items() if b <= least + SAME_BYTES}
        best = tied[timing.simplest_of_fastest(list(tied), ms, r.spread, lambda x: tied[x].simplicity())]
        r.chosen = best
        o0 = held.get(REFERENCE.label)
        if best == REFERENCE:
            r.why = (f"no qualifying half policy holds fewer bytes per trained parameter than O0 ({least:.1f}): "
                     "O0 (FP32).")
            return
        dev = r.measured_of(best).deviation  # type: ignore[union-attr]
        speed = f"{ms[REFERENCE.label] / ms[best.label]:.2f}x O0's speed" if ms.get(REFERENCE.label) else "speed unknown"
        r.why = (f"the policy that trains like FP32 with the least memory: {held[best.label][1]:.1f} bytes per trained "
                 f"parameter (weight, masters, optimizer state)"
                 + (f" against O0's {o0[1]:.1f}" if o0 is not None else "") + f" ({speed}; deviation {dev:.2%}).")
