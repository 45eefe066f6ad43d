"""The choice among what the search measured (`search.Result`), and the line that says why.

- Speed: the fastest finalist that qualified on every run; a tie (within the spread between
  repeats) goes to the simpler policy, and the why-line names every policy that looks faster
  than the one chosen, with its speed-up, so that the line never contradicts the table. O0 is
  chosen when every candidate was judged and none qualifies, or when O0 is faster than that
  choice beyond the spread; a tie with O0 goes to the half policy (it trains like FP32: the
  measurement cannot tell the two apart on speed).
- When no candidate qualifies and the runs could not tell for some (`Outcome.CANNOT_TELL`),
  nothing is chosen: the search *cannot tell* (`Result.cannot_tell`), and the why-line says what
  would decide it (more steps, a wider tolerance). It never reads as "no half policy trains like
  FP32".
- Memory: the qualifying policy (O0 included) that holds the fewest bytes per trained parameter
  for training (`Report.training_bytes_per_param`, counted, not timed); footprints within
  `SAME_BYTES` of each other go by speed as above.
"""
from __future__ import annotations

from collections.abc import Sequence

from ampatch.runs.verdict import Decider
from ampatch.tune import timing
from ampatch.tune.candidates import REFERENCE, Candidate
from ampatch.tune.result import Result

__all__ = ["SAME_BYTES", "choose", "choose_memory", "undecided_decider"]

SAME_BYTES = 0.1      # footprints (bytes per trained parameter) this close are the same memory


def undecided_decider(r: Result) -> Decider | None:
    """What would decide every candidate the runs could not tell: the most steps and the widest
    tolerance any of them needs (None: every candidate was decided)."""
    left = [m for m in r.candidates if m.undecided]
    if not left:
        return None
    steps = [m.decide.steps for m in left if m.decide is not None and m.decide.steps is not None]
    tols = [m.decide.tolerance for m in left if m.decide is not None and m.decide.tolerance is not None]
    return Decider(max(steps) if steps else None, max(tols) if tols else None)


def _cannot_tell(r: Result) -> None:
    left = [m for m in r.candidates if m.undecided]
    decide = undecided_decider(r) or Decider()
    ran = sorted({m.steps for m in left if m.steps})
    at = f" at {'/'.join(map(str, ran))} steps" if ran else ""
    r.chosen = None
    r.why = (f"cannot tell whether {', '.join(m.candidate.label for m in left)} train(s) like FP32 within the "
             f"{r.tolerance:.2%} tolerance{at}, and no other half policy qualifies. What would decide: "
             f"{decide.describe()} (--steps, --budget" + (", --tolerance" if decide.tolerance else "") +
             "). No policy written.")


def _spread(r: Result) -> float:
    """The relative spread between repeats that counts as a tie, kept in `r.spread`: the
    interleaved re-timing runs' where any policy was re-timed, else the first timings'."""
    r.spread = timing.spread(r.repeats if any(len(v) > 1 for v in r.repeats.values()) else r.timings)
    return r.spread


def _faster_looking(labels: Sequence[str], best: str, ms: dict[str, float], o0: float | None) -> str:
    """The tied policies that show a lower step time than `best`, with their speed-ups."""
    shown = sorted((x for x in labels if x != best and ms[x] < ms[best]), key=lambda x: ms[x])
    return ", ".join(f"{x} ({o0 / ms[x]:.2f}x)" if o0 else x for x in shown)


def choose(r: Result, retimed: Sequence[Candidate]) -> None:
    """The speed objective (module docstring); sets `r.spread`, `r.chosen` and `r.why`."""
    spread = _spread(r)
    ms = timing.step_ms(r.compared())
    qual = [m.candidate for m in r.candidates if m.qualifies and not m.emulated and m.candidate.label in ms]
    if retimed:  # the finalists: the others were slower at their first timing
        qual = [c for c in qual if c in retimed]
    if not qual:
        if any(m.undecided for m in r.candidates):
            return _cannot_tell(r)
        r.chosen = REFERENCE
        r.why = ("no half policy trains like FP32 within the tolerance" if r.candidates
                 else "no candidate was measured") + ": O0 (FP32)."
        return
    labels = {c.label: c for c in qual}
    best = labels[timing.simplest_of_fastest(list(labels), ms, spread, lambda x: labels[x].simplicity())]
    o0 = ms.get(REFERENCE.label)
    if o0 is not None and timing.faster(o0, ms[best.label], spread):
        r.chosen = REFERENCE
        r.why = (f"every qualifying half policy is slower than O0 beyond the {spread:.1%} spread between repeats "
                 f"(best: {best.label}, {ms[best.label]:.1f} ms against {o0:.1f}).")
        return
    r.chosen = best
    chosen = r.measured_of(best)
    dev = chosen.deviation if chosen is not None else None
    if not o0:
        speed = "speed unknown"
    elif timing.faster(ms[best.label], o0, spread):
        speed = f"{o0 / ms[best.label]:.2f}x O0's speed"
    else:
        speed = (f"{o0 / ms[best.label]:.2f}x O0's speed, a tie with O0 within the {spread:.1%} spread between "
                 "repeats, which goes to the half policy")
    tied = [x for x in labels if not timing.faster(ms[x], ms[best.label], spread)]
    faster = _faster_looking(tied, best.label, ms, o0)
    tie = "" if not faster else (f"; {faster} {'shows' if ',' not in faster else 'show'} a higher speed-up, but "
                                 f"within the {spread:.1%} spread between repeats that is a tie, which goes to the "
                                 "simpler policy")
    dev_text = "deviation -" if dev is None else f"deviation {dev:.2%}"
    r.why = f"the fastest policy that trains like FP32 ({speed}; {dev_text}){tie}."


def choose_memory(r: Result) -> None:
    """The memory objective (module docstring); sets `r.spread`, `r.chosen` and `r.why`."""
    spread = _spread(r)
    ms = timing.step_ms(r.compared())
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
    best = tied[timing.simplest_of_fastest(list(tied), ms, spread, lambda x: tied[x].simplicity())]
    if best == REFERENCE and any(m.undecided for m in r.candidates) and not any(m.qualifies for m in r.candidates):
        return _cannot_tell(r)
    r.chosen = best
    o0 = held.get(REFERENCE.label)
    if best == REFERENCE:
        r.why = (f"no qualifying half policy holds fewer bytes per trained parameter than O0 ({least:.1f}): "
                 "O0 (FP32).")
        return
    chosen = r.measured_of(best)
    dev = chosen.deviation if chosen is not None else None
    speed = f"{ms[REFERENCE.label] / ms[best.label]:.2f}x O0's speed" if ms.get(REFERENCE.label) else "speed unknown"
    dev_text = "deviation -" if dev is None else f"deviation {dev:.2%}"
    r.why = (f"the policy that trains like FP32 with the least memory: {held[best.label][1]:.1f} bytes per trained "
             f"parameter (weight, masters, optimizer state)"
             + (f" against O0's {o0[1]:.1f}" if o0 is not None else "") + f" ({speed}; {dev_text}).")
