"""The search: O0 for reference, every candidate, runs made longer where the runs cannot tell
yet, repairs of the failed ones, interleaved re-timing of the fastest that qualify (each repeat
judged again), and the choice (`choice`), within a time budget.

- The reference must be sound: an O0 run that fails, records no loss, has a non-finite loss or
  diverges (`deviation.unsound`) stops the search (`NoReference`).
- **Longer runs.** `--steps` is where the search starts. While O0's loss shows no detectable
  progress (beyond its noise and its rounding), O0 runs again with twice the steps; and while
  candidates are left that the runs cannot tell (too noisy at the tolerance, a share of O0's
  progress too uncertain, a loss that cannot resolve O0's fall, and weights that cannot decide
  either), O0 and those candidates run again with twice the steps. Each doubling happens only
  when O0's and the candidates' runs at the new length fit the budget (the slowest run so far,
  scaled to the steps), and only as far as the script goes (a script that ends before the steps
  asked for cannot run longer; without a budget, at most `runs.longer.MAX_DOUBLINGS`). Every
  verdict says the steps it rests on.
- Where O0's loss never shows progress, the weights witness (`ampatch.runs.weights`) judges;
  where they cannot either (O0's own weights barely moved), the search stops with
  `NoProgress` ("run more steps").
- There is no separate noise-floor run: a rerun of O0 with the same seed and data is
  deterministic on a CPU and measures nothing. The noise comes from each run itself.
- Repairs are spent on candidates that fail, never on those the runs cannot tell.
- Ctrl-C (KeyboardInterrupt) stops the run in progress; the result then holds what was
  measured and the best qualifying policy so far (`Result.interrupted`).
- The budget stops the search before a run that would not fit: the slowest plain run so far is
  the estimate for a plain run, the slowest recorded run (the diagnose recorder's shadows make
  it slower) for a recorded one, `RECORD_FACTOR` times a plain run until one is measured.
- A candidate whose FP8 was emulated (`tune.fp8`) is judged like the rest and listed with its
  fidelity, but never re-timed or chosen: emulation's step times say nothing of FP8's speed.
"""
from __future__ import annotations

import signal
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, TextIO

from ampatch.errors import ConfigError, InternalError, NoReference, reason
from ampatch.runs import process
from ampatch.runs.deviation import Basis, Reference, unsound
from ampatch.runs.longer import Longer
from ampatch.runs.stats import RunStats
from ampatch.runs.verdict import Decider, Evidence
from ampatch.runs.weights import compare as compare_weights
from ampatch.tune import choice, timing
from ampatch.tune.candidates import OBJECTIVES, REFERENCE, Candidate
from ampatch.tune.measure import Job, Measured, measured, run_candidate
from ampatch.tune.repair import MAX_REPAIRS, suggest
from ampatch.tune.result import Result

if TYPE_CHECKING:  # command imports this module: only the type comes from there
    pass

__all__ = ["Result", "Search", "NoReference", "NoProgress", "reference_of", "sound_reference", "RECORD_FACTOR"]

RECORD_FACTOR = 3.0   # a recorded run's time against a plain run's, until one is measured
SAME_BYTES = choice.SAME_BYTES


class NoProgress(NoReference):
    """O0's loss did not fall beyond its own noise over the longest run the budget and the script
    allowed, and its weights cannot witness either: "run more steps". `decide`: what would."""

    decide: Decider | None = None


def sound_reference(row: RunStats) -> Reference:
    """O0's row as the reference every candidate is judged against, whether or not it made
    detectable progress; `NoReference` when it cannot be one (failed, no loss, unsound)."""
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
    return row.reference()


def reference_of(row: RunStats, steps: int | None = None) -> Reference:
    """`sound_reference`, and `NoProgress` when its loss made no detectable progress (`steps`:
    the steps it ran, for the message): the loss alone, without the weights."""
    ref = sound_reference(row)
    if ref.basis is not Basis.PROGRESS:
        raise NoProgress(ref.no_progress(steps if steps is not None else row.steps))
    return ref
class Search:
    """One search (see the module docstring); progress lines go to `log`."""

    def __init__(self, job: Job, candidates: Sequence[Candidate], tolerance: float, budget_s: float | None,
                 log: TextIO, repair: bool = True, rounds: int = timing.ROUNDS, objective: str = "speed") -> None:
        if rounds < 0:
            raise ConfigError(f"rounds must be 0 or more (0: no re-timing), got {rounds}")
        if objective not in OBJECTIVES:
            raise ConfigError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
        self.job, self.todo, self.log, self.repair, self.rounds = job, list(candidates), log, repair, rounds
        self.result = Result(tolerance, objective=objective)
        self.objective = objective
        self.deadline = None if budget_s is None else time.time() + budget_s
        self.longer = Longer(job.steps, job.steps, self.deadline)
        self.last_wall = 0.0                 # the slowest plain run so far, at the current steps
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

    def fits(self, recorded: bool = False, runs: int = 1, scale: float = 1.0) -> bool:
        """Whether `runs` more runs (recorded ones: `recorded`), `scale` times as long as so far, fit the budget."""
        return self.deadline is None or time.time() + runs * scale * self.estimate(recorded) * 1.1 < self.deadline

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

    def _reference_row(self) -> RunStats | None:
        ref = self.result.reference
        return ref.row if ref is not None else None

    def measure(self, c: Candidate, why: str) -> Measured:
        self.runs += 1
        self.say(f"[{self.runs}] {c.label}: {why}, {self.job.steps} steps{self.left()}")
        done = self._timed(c)
        m = measured(c, done, self._reference_row(), self.result.rule)
        if m.step_ms is not None:
            self.result.timings.setdefault(c.label, []).append(m.step_ms)
        self.say(f"    {m.outcome.value}: {m.reason}" + (f"; {m.step_ms:.1f} ms/step" if m.step_ms else ""))
        return m

    def run(self) -> Result:
        """The whole search; raises `NoReference` when O0's run cannot be the reference, and
        `NoProgress` when neither its loss nor its weights show it learning in the longest run allowed."""
        try:
            self._run()
        except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM/SIGHUP (process.Stopped)
            self.result.interrupted = process.signal_of(exc)
            self.result.notes.append(f"interrupted ({signal.Signals(self.result.interrupted).name}): the choice is "
                                     "the best of what was measured.")
        except NoReference as exc:
            self.result.stopped, self.result.no_reference = reason(exc), not isinstance(exc, NoProgress)
            raise
        self.choose()
        return self.result

    # ------------------------------------------------------------------ longer runs
    def _longer(self, runs: int) -> bool:
        """Double the steps when `runs` runs of twice the length may be made (`runs.longer`)."""
        why = self.longer.why_not(runs, self.last_wall)
        if why is not None:
            self.result.notes.append(f"{why}: the verdicts rest on at most {self.job.steps} steps.")
            return False
        self.job = replace(self.job, steps=self.longer.double())
        self.last_wall *= 2.0      # until measured at the new length
        return True

    def _measure_reference(self, why: str) -> Reference:
        ref = self.measure(REFERENCE, why)
        ran = ref.row.steps
        self.result.reference = self.result.references[ran or self.job.steps] = ref
        if self.job.script and ref.row.ok:
            self.longer.saw(self.job.steps, ran)
        return sound_reference(ref.row)

    def _o0(self) -> Measured:
        """O0's latest measurement (`_measure_reference` has run)."""
        if self.result.reference is None:
            raise InternalError("ampatch: internal error: O0 was not measured before its progress was read (a bug in "
                                "tune's search)")
        return self.result.reference

    def _no_progress(self, basis: Reference, stalled: str | None = None) -> NoProgress:
        """The stop when O0 shows no progress: more steps would decide, or (`stalled`: why its own
        weights barely move) no run length would."""
        row = self._o0().row
        n = row.steps or self.job.steps
        if stalled is not None:
            exc = NoProgress(f"cannot tell: O0 made no detectable progress in {n} steps ({basis.why_not()}), and "
                             f"{stalled}. No run length makes such a reference one to judge against: a larger "
                             "learning rate would.")
            exc.decide = Decider()
        else:
            exc = NoProgress(basis.no_progress(n))
            z, need = basis.significance, basis.needed
            grow = (need / z) ** (2 / 3) if z and need and z > 0 and z != float("inf") else 2.0
            exc.decide = Decider(int(n * max(2.0, grow)))
        self.result.decide = exc.decide
        return exc

    def _reference(self) -> None:
        """O0 at the first steps, run longer while its loss shows no progress (module docstring).
        Where its own weights barely move (updates below FP32's resolution), no length helps: stop."""
        basis = self._measure_reference("the FP32 reference")
        while basis.basis is not Basis.PROGRESS:
            row = self._o0().row
            weights = compare_weights(row.witness, row.witness, self.result.rule.confidence)
            if weights is not None and not weights.witnesses:
                raise self._no_progress(basis, weights.why_not)
            if not self._longer(runs=1 + len(self.todo)):
                if weights is None:
                    raise self._no_progress(basis)
                self.say(f"    O0's loss shows no progress in {row.steps} steps ({basis.why_not()}); its weights "
                         "moved: candidates are judged on their weights where the loss cannot tell")
                return
            self.say(f"    O0's loss shows no progress yet ({basis.why_not()}): running longer")
            basis = self._measure_reference("the FP32 reference, longer")
        self.say(f"    deviations are {basis.describe()}")

    def _run(self) -> None:
        r = self.result
        self._reference()
        runs = len(self.todo) + timing.RETIME * self.rounds + self.rounds
        self.say(f"trying {len(self.todo)} candidate(s): {', '.join(c.label for c in self.todo)}; about "
                 f"{self.last_wall:.1f}s a run: {runs} runs, about {runs * self.last_wall / 60:.1f} min, plus "
                 f"about {self.estimate(True) + self.last_wall:.0f}s per repair (a recorded run and a rerun)"
                 + ("" if self.deadline is None else ", within the budget"))
        for i, c in enumerate(self.todo, 1):
            if not self.fits():
                r.notes.append(f"budget reached before {c.label} ran.")
                return
            r.candidates.append(self.measure(c, f"candidate {i}/{len(self.todo)}"))
        self.decide_undecided()
        if self.repair:
            failed = [m.candidate for m in r.candidates if not m.qualifies and not m.undecided and m.row.ok]
            for c in sorted(failed, key=Candidate.simplicity):
                self.repair_one(c)
        if self.objective == "speed":
            self.retime()

    def decide_undecided(self) -> None:
        """Run O0 and the candidates the loss cannot tell yet again, twice as long, while the budget
        and the script allow (module docstring): those the runs cannot tell, and those that qualify
        on their weights alone (the loss, the first witness, may yet confirm or fail them)."""
        r = self.result
        while True:
            left = [m.candidate for m in r.candidates
                    if m.undecided or (m.qualifies and m.evidence is Evidence.WEIGHTS)]
            if not left or not self._longer(runs=1 + len(left)):
                return
            self.say(f"cannot tell {', '.join(c.label for c in left)} yet: running O0 and them for "
                     f"{self.job.steps} steps")
            self._measure_reference("the FP32 reference, longer")
            for c in left:
                self._amend_with(c, self.measure(c, "longer"))

    def _amend_with(self, c: Candidate, m: Measured) -> None:
        r = self.result
        old = r.measured_of(c)
        if old is None:
            r.candidates.append(m)
        else:
            r.candidates[r.candidates.index(old)] = m

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
                self._amend_with(c, replace(m, reason=f"{m.reason}; {s.finding}", step_fault=s.step_fault))
            if s.candidate is None:
                self.say(f"    no repair: {s.why}")
                return
            if not self.fits():
                return
            m = self.measure(s.candidate, f"repair of {c.label}: {s.why}")
            r.candidates.append(m)
            if m.qualifies or m.undecided or not m.row.ok:
                return
            c = s.candidate

    def finalists(self) -> list[Measured]:
        """The `timing.RETIME` fastest qualifying candidates (first timings), and the fastest
        qualifying one simpler than all of them: a tie within the spread would go to it, so it
        is timed beside them."""
        qual = sorted((m for m in self.result.candidates if m.qualifies and m.step_ms and not m.emulated),
                      key=lambda m: m.step_ms or 0.0)  # every one has a step time (the filter)
        top = qual[:timing.RETIME]
        if top:
            simplest = min(m.candidate.simplicity() for m in top)
            simpler = [m for m in qual[timing.RETIME:] if m.candidate.simplicity() < simplest]
            top += simpler[:1]
        return top

    def retime(self) -> None:
        """The finalists and O0, interleaved; every repeat is judged again (a finalist that fails
        on one no longer qualifies); O0's are timed only."""
        r = self.result
        qual = self.finalists()
        if not qual or self.rounds < 1:
            return
        by_label = {REFERENCE.label: REFERENCE, **{m.candidate.label: m.candidate for m in qual}}
        plan = timing.order(REFERENCE.label, [m.candidate.label for m in qual], self.rounds)
        self.say(f"re-timing {', '.join(by_label)} interleaved ({self.rounds} round(s)); each run judged again")
        for n, label in enumerate(plan):
            if not self.fits():
                r.notes.append("budget reached during re-timing: fewer repeats than planned.")
                break
            c = by_label[label]
            self.runs += 1
            self.say(f"[{self.runs}] {label}: re-timing{self.left()}")
            again = measured(c, self._timed(c), self._reference_row(), r.rule)
            if c != REFERENCE:
                self._rejudge(c, again, n // len(by_label) + 1)
            if again.step_ms is not None:
                r.timings.setdefault(label, []).append(again.step_ms)
                r.repeats.setdefault(label, []).append(again.step_ms)
                self.say(f"    {again.step_ms:.1f} ms/step" + ("" if c == REFERENCE or again.qualifies
                                                                else f"; {again.outcome.value}: {again.reason}"))
        self.retimed = [m.candidate for m in qual]

    def _rejudge(self, c: Candidate, again: Measured, round_: int) -> None:
        """A finalist's repeat: it keeps qualifying only if this run does not fail (a repeat the runs
        cannot tell leaves it as it was); its deviation is its worst run's."""
        m = self.result.measured_of(c)
        if m is None:
            return
        worst = max((d for d in (m.deviation, again.deviation) if d is not None), default=None)
        if again.qualifies or again.undecided:
            self._amend_with(c, replace(m, deviation=worst))
        elif m.qualifies:
            self._amend_with(c, replace(m, qualifies=False, deviation=worst, finite=m.finite and again.finite,
                                        reason=f"its re-timing run {round_} fails: {again.reason} (its first run: "
                                               f"{m.reason})"))

    def choose(self) -> None:
        """The choice (`choice.choose`, or `choice.choose_memory` for the memory objective; either
        sets the spread between repeats that counts as a tie)."""
        r = self.result
        fp8 = [m.candidate.label for m in r.candidates if m.emulated and m.qualifies]
        if fp8:
            r.notes.append(f"{', '.join(fp8)}: trained like FP32, but on FP8 emulated by torchao here (no FP8 tensor "
                           "cores): listed for their fidelity, never chosen for speed; time them on a GPU with FP8 "
                           "tensor cores (CUDA capability 8.9+).")
        if self.objective == "memory":
            choice.choose_memory(r)
        else:
            choice.choose(r, self.retimed)
