"""The size of a built-in workload: given (``--size``), or chosen from a quick calibration.

The calibration (``python -m ampatch.workloads.calibrate``, started as the runs will be, so
that it also shows what a run's start-up costs here) times a few steps per step kind (FP32,
each half dtype) from the smallest size up. The choice is the largest size at which every
level, start-up and exit included, runs ``TARGET_STEPS`` steps in the time there is (the
budget, or about ``DEFAULT_BUDGET_S`` for a fixed ``--steps``), with ``MARGIN`` to spare for a
busy machine.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from ampatch import workloads
from ampatch.base.dtypes import HALF_NAMES
from ampatch.config import env as envvars
from ampatch.runs.budget import EXIT_S, MARGIN, TARGET_STEPS
from ampatch.runs.runner import Launch, child_env, failure_line, popen, read_json, run_child
from ampatch.workloads.calibrate import step_kinds

CALIBRATION_LIMIT_S = 6.0  # of measuring, beyond the calibration's own start-up


@dataclass(frozen=True)
class SizeChoice:
    """The size a comparison trains at, why, and what the calibration measured there."""

    size: str
    dims: str                                   # e.g. "d_model 128, seq 32"
    reason: str                                 # how it was chosen, for the title
    weights: dict[str, float] = field(default_factory=dict)  # level -> measured step seconds
    start_s: float | None = None                # measured: a run's launch to its first step's end
    calibration: dict[str, Any] | None = None   # the measurements, for --json

    def describe(self) -> str:
        return f"size {self.size} ({self.dims}), {self.reason}"


def dims_of(workload: str, size: str) -> str:
    """The dimensions of ``workload`` at ``size``, in words."""
    return importlib.import_module(f"ampatch.workloads.{workload}").SIZES[size].describe()


def sizes_in_words(workload: str) -> str:
    """Every size of ``workload`` and its dimensions, e.g. for ``--help``."""
    return "; ".join(f"{size} = {dims_of(workload, size)}" for size in workloads.SIZES)


def given(workload: str, size: str) -> SizeChoice:
    """The size the user gave with ``--size``."""
    return SizeChoice(size, dims_of(workload, size), "from --size")


@dataclass(frozen=True)
class Goal:
    """What the size must allow: each of ``levels`` runs its steps within ``seconds``, start-up
    and exit included: ``TARGET_STEPS`` of them in a budget, else (``budgeted`` False: a fixed
    ``--steps``, timed against about ``DEFAULT_BUDGET_S``) all ``steps``."""

    levels: tuple[str, ...]
    seconds: float
    steps: int
    budgeted: bool

    @property
    def need(self) -> int:
        return min(self.steps, TARGET_STEPS) if self.budgeted else self.steps

    def reason(self, met: bool) -> str:
        """Why the chosen size, for the title."""
        if met:
            return (f"chosen so that every level runs >= {self.need} steps in the budget" if self.budgeted
                    else f"chosen so that every level runs its {self.steps} steps in about {self.seconds:.0f}s")
        return ("the smallest size (the calibration expected fewer than "
                f"{self.need} steps per level in the budget)" if self.budgeted else
                f"the smallest size (the calibration expected more than {self.seconds:.0f}s for "
                f"{self.steps} steps of every level)")


def choose(calibration: dict[str, Any], goal: Goal, overhead_s: float) -> SizeChoice:
    """The largest measured size that meets ``goal`` (with ``MARGIN`` to spare); the smallest
    measured when none does. ``overhead_s``: a run's start and exit beyond its build and steps
    (the calibration's wall time less its measuring); ``goal.seconds``: the time left."""
    kinds, measured = calibration["kinds"], calibration["sizes"]
    build_s = max(max(m["build"].values()) for m in measured)  # the first build pays torch's lazy imports

    def start_s(m: dict[str, Any]) -> float:
        return overhead_s + build_s + max(m["first"].values())

    def steps_at(m: dict[str, Any]) -> float:
        room = goal.seconds - len(goal.levels) * (start_s(m) + EXIT_S)
        return max(0.0, room) / sum(m["step"][kinds[lv]] for lv in goal.levels)

    fitting = [m for m in measured if steps_at(m) >= goal.need * MARGIN]
    chosen = fitting[-1] if fitting else measured[0]
    return SizeChoice(chosen["size"], chosen["dims"], goal.reason(bool(fitting)),
                      {lv: chosen["step"][kinds[lv]] for lv in goal.levels}, start_s(chosen),
                      {**calibration, "chosen": chosen["size"], "overhead_s": overhead_s,
                       "predicted_steps": steps_at(chosen)})


def calibrate(workload: str, device: str, threads: int, half_dtype: str | None, goal: Goal,
              log: TextIO, launch: Launch = popen) -> SizeChoice:
    """Calibrate (a child process, started by ``launch``), then `choose`; progress lines on
    ``log``. ``goal.seconds`` counts the calibration too. A failed calibration picks the
    smallest size and says why."""
    began = time.perf_counter()
    kinds = list(dict.fromkeys(step_kinds(goal.levels, device, half_dtype).values()))
    # the longest round that could fit, start-ups left out: sizes past it are not worth measuring
    stop_above = goal.seconds / (goal.need * MARGIN)
    log.write(f"calibrating: timing {' and '.join(kinds)} steps of {workload} from size "
              f"{workloads.SIZES[0]} up (a few seconds)\n")
    log.flush()
    with tempfile.TemporaryDirectory(prefix="ampatch-calibrate-") as tmp:
        out = Path(tmp, "calibration.json")
        timed = dict.fromkeys(goal.levels)  # a kind is timed at the first level of its own (calibrate.step_kinds)
        cmd = [sys.executable, "-m", "ampatch.workloads.calibrate", workload, "--levels", ",".join(timed),
               "--device", device, "--threads", str(threads), "--stop-above", f"{stop_above:.4f}",
               "--time-limit", str(CALIBRATION_LIMIT_S), "--out", str(out)]
        if half_dtype in HALF_NAMES:
            cmd += ["--half-dtype", half_dtype]
        done = run_child(cmd, child_env(None, None, base=envvars.without_ampatch()), launch=launch)
        data, unreadable = read_json(out)
    spent = time.perf_counter() - began
    error = failure_line(done.returncode, done.stderr) or unreadable
    if error or not data or not data.get("sizes"):
        smallest = workloads.SIZES[0]
        log.write(f"calibration failed after {spent:.1f}s ({error or 'no size measured'}): size {smallest}\n")
        log.flush()
        return SizeChoice(smallest, dims_of(workload, smallest), f"calibration failed: {error or 'no size measured'}")
    choice = choose(data, dataclasses.replace(goal, seconds=goal.seconds - spent),
                    overhead_s=max(0.0, done.wall_s - data["busy_s"]))
    per_step = ", ".join(f"{m['size']} " + "/".join(f"{1000 * m['step'][k]:.0f}" for k in kinds)
                         for m in data["sizes"])
    predicted = choice.calibration["predicted_steps"] if choice.calibration else 0.0  # `choose` always sets it
    log.write(f"calibrated in {spent:.1f}s: {per_step} ms per step ({'/'.join(kinds)}) -> {choice.describe()}"
              f" (about {predicted:.0f} steps per level)\n")
    log.flush()
    return choice
