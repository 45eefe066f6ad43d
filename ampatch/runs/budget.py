"""The time budget of a comparison on a built-in workload: each level's deadline and step cap.

A level's weight is the cost of one of its steps. With a calibration (``ampatch.runs.sizing``)
the weights are the measured step times in seconds; without one (``--size`` given) they are
guessed from the hardware: 1 for FP32 and native half, ``SLOW_HALF_WEIGHT`` where the half
dtype is emulated, and the first run teaches their scale in seconds.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ampatch.config.levels import uses_half, variant
from ampatch.errors import ConfigError
from ampatch.machine import hardware
from ampatch.workloads.calibrate import dtype_of_kind, step_kinds

DEFAULT_BUDGET_S = 120.0  # built-in workloads: the whole compare, calibration and start-ups included
TARGET_STEPS = 30         # the steps every level should run: fewer say little (the losses barely move)
MARGIN = 1.3              # plan for steps this much slower than measured (a shared, busy machine)
FIRST_STEP_S = 1.5        # a run's model build and first (warm-up) step, beyond its imports
SLOW_HALF_WEIGHT = 3.0    # a half level's step against O0's where the half dtype is emulated (measured
                          # 2-3x on the lm workload on an AVX-512 CPU without BF16)
START_S = 4.0             # first guess of a run's time from launch to its first step's end
EXIT_S = 1.0              # first guess of a run's time from its last step to its exit


def parse_seconds(text: str) -> float | None:
    """A budget as given: ``120``, ``120s``, ``2m``, ``1.5min``; None for ``none``/``off``/``0``.
    Raises ValueError for anything else."""
    t = text.strip().lower()
    if t in ("none", "off", "0", "0s"):
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(s|sec|m|min)?", t)
    if not m or float(m.group(1)) <= 0:
        raise ConfigError(f"expected a time such as 120, 120s or 2m (or none), got {text!r}")
    return float(m.group(1)) * (60 if m.group(2) in ("m", "min") else 1)


@dataclass
class Budget:
    """A time budget for the whole comparison of a built-in workload.

    Every level should run the same number of steps, so that the losses compare step for
    step: a level runs at most as many steps as the levels before it. Until the weights'
    scale in seconds is known, its deadline is a share of the time left: its start-up and
    exit, plus a part of the rest in proportion to its weight. Once it is known (``scale``: 1
    for measured weights, else learnt from the last run), a level runs at most as many steps
    as every level left can run in the time left (or ``TARGET_STEPS``, if that is more: a
    level faster than expected gets there), and its deadline keeps for the later levels the
    time of ``TARGET_STEPS`` each, with ``MARGIN`` (or of the steps they can afford, if
    fewer). A level that
    ends early leaves its rest to the later ones. The workload itself stops before its
    deadline (``--deadline``), timing its own steps.
    """

    seconds: float
    max_steps: int
    weights: dict[str, float] = field(default_factory=dict)  # level -> cost of a step (missing: 1)
    scale: float | None = None  # seconds per unit of weight (None: not known yet)
    clock: Callable[[], float] = time.time  # wall clock shared with the runs (their --deadline)
    start_s: float = START_S  # a run's time from launch to its first step's end (imports, build); learnt
    exit_s: float = EXIT_S    # a run's time from its last step to its exit (report, teardown); learnt
    start: float | None = None  # the clock when the comparison began (default: now)
    began: float = field(init=False)  # `start`, or the clock when the budget was made

    def __post_init__(self) -> None:
        if self.start is None:
            self.start = self.clock()
        self.began = self.start

    def left(self) -> float:
        """Seconds left of the budget (never negative)."""
        return max(0.0, self.began + self.seconds - self.clock())

    def next_run(self, levels: Sequence[str], steps_done: Sequence[int]) -> tuple[int, float]:
        """(step cap, time.time() deadline for its last step) for ``levels[0]``, the next of
        the levels still to run."""
        now = self.clock()
        left = max(0.0, self.began + self.seconds - now)
        fixed = self.start_s + self.exit_s
        spare = max(0.0, left - fixed * len(levels))
        weights = [self.weights.get(level, 1.0) for level in levels]
        cap = min([self.max_steps, *steps_done])
        if self.scale is None:  # a share in proportion to the weights
            return cap, now + fixed + spare * weights[0] / sum(weights) - self.exit_s
        afford = spare / (self.scale * sum(weights))   # the steps every level left can run
        cap = min(cap, max(TARGET_STEPS, int(afford)))
        keep = min(TARGET_STEPS * MARGIN, afford, cap)  # what the later levels are sure to get
        later = (len(levels) - 1) * fixed + keep * self.scale * sum(weights[1:])
        return cap, now + max(fixed, left - later) - self.exit_s

    def ran(self, start_s: float | None, exit_s: float | None, level: str | None = None,
            step_s: float | None = None) -> None:
        """Learn from a finished run: its start-up (the latest counts), exit (the slowest) and,
        from ``level``'s seconds per step, the weights' scale (the latest counts: a shared
        machine's speed drifts)."""
        if start_s is not None:
            self.start_s = start_s
        if exit_s is not None:
            self.exit_s = max(self.exit_s, exit_s)
        if level is not None and step_s:
            self.scale = step_s / self.weights.get(level, 1.0)


def half_dtypes(device: str, levels: Sequence[str], half_dtype: str | None) -> dict[str, str]:
    """The half dtype each level will use on ``device`` (O0: none)."""
    return {lv: dtype_of_kind(kind) for lv, kind in step_kinds(levels, device, half_dtype).items()
            if uses_half(variant(lv).level)}


def step_weights(device: str, levels: Sequence[str], half_dtype: str | None) -> dict[str, float]:
    """Expected cost of a step per level, relative to O0's, guessed from the hardware."""
    native = hardware.describe(device).native
    return {lv: SLOW_HALF_WEIGHT if native.get(d) is False else 1.0
            for lv, d in half_dtypes(device, levels, half_dtype).items()}
