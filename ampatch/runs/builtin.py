"""A comparison on a built-in workload (``ampatch.workloads``): where and how big it trains,
its time budget, each level's command, and the words the table says about it."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, ContextManager, TextIO

import torch

from ampatch.config import env as envvars
from ampatch.config.levels import variant
from ampatch.errors import reason
from ampatch.machine import hardware
from ampatch.machine.device_text import machine_line
from ampatch.runs import UsageError, sizing
from ampatch.runs.budget import DEFAULT_BUDGET_S, FIRST_STEP_S, Budget, half_dtypes, step_weights
from ampatch.runs.forkserver import WarmLauncher
from ampatch.runs.runner import CommandFor, Launch, child_env, popen
from ampatch.runs.sizing import SizeChoice

AUTO = "auto"            # --size and --device: chosen here
# what a run imports before its first step (the first optimizer imports torch._dynamo)
PRELOAD = ("torch", "torch._dynamo", "ampatch", "ampatch.workloads")
# One torch thread by default: on a shared 2-core machine two threads waiting on each other's
# barrier made the lm workload's O0 step 8x slower (2.6 s against 0.34 s with one).
DEFAULT_THREADS = 1
FEW_STEPS = 20           # below this many compared steps, the table says it is thin


def workload_device(name: str | None) -> str:
    """The device the built-in workloads train on: ``auto`` (default) is CUDA when available.
    Raises `UsageError`, naming ``--device``, for a name torch does not parse."""
    if name in (None, AUTO):
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        torch.device(name)
    except (RuntimeError, ValueError) as exc:
        raise UsageError(f"--device: {reason(exc)}") from None
    return name


def launcher(device: str, log: TextIO) -> ContextManager[Launch]:
    """How the workload's runs start: on Linux and a CPU device, forked from one process that
    has done the imports (`forkserver`: a few seconds less per run); else as fresh processes."""
    if sys.platform != "linux" or torch.device(device).type != "cpu":
        return nullcontext(popen)
    env = child_env(None, None, base=envvars.without_ampatch())
    return WarmLauncher(PRELOAD, env, log)


def machine_notice(device: str, levels: Sequence[str], half_dtype: str | None) -> str:
    """What to say before the runs: the machine line, and a warning when a half dtype they use
    is emulated. Raises `UsageError` for a device this machine does not have."""
    try:
        info = hardware.describe(device)
    except (RuntimeError, AssertionError) as exc:  # e.g. cuda asked for on a machine without it
        raise UsageError(f"--device {device}: {reason(exc)}") from None
    dtypes = list(dict.fromkeys(half_dtypes(device, levels, half_dtype).values()))
    lines = [f"machine: {machine_line(info, dtypes)}"]
    slow = [d for d in dtypes if info.native.get(d) is False]
    if slow:
        lines.append(f"note: {' and '.join(slow)} {'has' if len(slow) == 1 else 'have'} no fast path here: "
                     "expect the half levels to be slower than O0 (see the note under the table)")
    return "\n".join(lines)


@dataclass
class Plan:
    """A comparison on a built-in workload, ready to run."""

    workload: str
    device: str
    threads: int
    steps: int                 # the step cap (exactly this many without a budget)
    seconds: float | None      # the budget; None: none
    size: SizeChoice
    budget: Budget | None

    def commands(self, levels: Sequence[str]) -> dict[str, CommandFor]:
        """Each level's command, a function of its (step cap, deadline)."""
        base = [sys.executable, "-m", f"ampatch.workloads.{self.workload}", "--device", self.device,
                "--threads", str(self.threads), "--size", self.size.size]

        def command_for(label: str) -> CommandFor:
            # "O5+kahan": O5 with master_weights="kahan"; "O5+fp8": the environment says (runner.child_env)
            level, mode = variant(label).level, variant(label).master_weights
            masters = [] if mode is None else ["--master-weights", mode]

            def make(steps: int | None, deadline: float | None) -> list[str]:
                return base + ["--opt-level", level, *masters, "--steps", str(steps)] + (
                    [] if deadline is None else ["--deadline", f"{deadline:.3f}"])
            return make
        return {level: command_for(level) for level in levels}

    def title(self, compared: int | None) -> str:
        """Two lines: what ran where and for how long, then the size and why."""
        where = self.device if not self.threads else \
            f"{self.device}, {self.threads} torch thread{'s' if self.threads != 1 else ''}"
        scope = f"{self.steps} steps" if self.seconds is None else (
            f"up to {self.steps} steps in a {self.seconds:g}s budget"
            + (f" (losses compared over the first {compared} steps)" if compared is not None else ""))
        return f"ampatch compare: workload {self.workload} ({where}), {scope}\n{self.size.describe()}"

    def notes(self, compared: int | None) -> list[str]:
        """The notes under the table: a warning when the budget left too few steps to say much."""
        if self.seconds is None or compared is None or compared >= FEW_STEPS:
            return []
        return [f"note: the {self.seconds:g}s budget left time for only {compared} steps per level on this "
                "machine (busy, or slow for this workload), so warm-up weighs on the step times and the "
                "losses have barely moved: give it more time (--budget 5m), fewer levels (--levels O0,O2) "
                "or a smaller --size."]

    def header(self) -> dict[str, Any]:
        """What ``--json`` says about the comparison, before its rows."""
        return {"workload": self.workload, "steps": self.steps, "budget_s": self.seconds, "device": self.device,
                "threads": self.threads, "size": self.size.size, "size_dims": self.size.dims,
                "size_reason": self.size.reason, "calibration": self.size.calibration}


def plan(workload: str, *, levels: Sequence[str], half_dtype: str | None, steps: int, seconds: float | None,
         device: str, threads: int, size: str, log: TextIO, launch: Launch = popen,
         began: float | None = None) -> Plan:
    """Set up the comparison: the budget, counted from ``began`` (time.time(); default: now),
    then the size, given or calibrated (progress on ``log``; runs started by ``launch``)."""
    budget = Budget(seconds, steps, start=began) if seconds is not None else None
    if size != AUTO:
        choice = sizing.given(workload, size)
    else:
        goal = sizing.Goal(tuple(levels), budget.left() if budget else DEFAULT_BUDGET_S, steps, budget is not None)
        choice = sizing.calibrate(workload, device, threads, half_dtype, goal, log, launch)
    if budget is not None:
        budget.weights = choice.weights or step_weights(device, levels, half_dtype)
        budget.scale = 1.0 if choice.weights else None  # measured weights are seconds
        # without a calibration: this process imported torch and ampatch as each run will, so its CPU
        # time so far is the first guess of a run's start-up (the runs then teach the real one)
        budget.start_s = choice.start_s if choice.start_s is not None else time.process_time() + FIRST_STEP_S
    return Plan(workload, device, threads, steps, seconds, choice, budget)
