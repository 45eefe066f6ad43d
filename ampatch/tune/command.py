"""`ampatch tune` as a library call: `tune(...) -> TuneResult`, what the command line runs.

    from ampatch.tune import tune
    result = tune(["python", "train.py"], levels=["O1", "O5"], steps=40, out="policy.json")
    result.render()    # the table and the choice, as the command line prints them
    result.chosen      # the policy, also written to `out`

It runs the search (`search.Search`) on a user script (stopped after `steps` optimizer steps
by ``AMPATCH_MAX_STEPS``, as `compare` runs it, and run longer where the runs cannot tell yet)
or on a built-in workload, writes the chosen policy to `out` (unless interrupted, the runs
could not tell, or `out` is None) and returns everything it measured (`TuneResult.cannot_tell`:
no verdict to stand by). Bad arguments raise `ValueError` before anything runs; a reference O0
run that cannot be the reference raises `NoReference`, one that made no progress its loss or its
weights witness in the longest run allowed raises its subclass `NoProgress` ("run more steps");
either carries `.result`, the `TuneResult` of what was measured (its JSON says why). Progress
goes to `log`.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from ampatch.config import levels as level_table
from ampatch.config.policy_file import DEFAULT_PATH, Policy, save
from ampatch.errors import ConfigError
from ampatch.runs import builtin, runner
from ampatch.runs.deviation import TOLERANCE
from ampatch.tune import candidates, fp8, plot, report, timing
from ampatch.tune.candidates import Candidate
from ampatch.tune.measure import Job
from ampatch.tune.search import NoProgress, NoReference, Result, Search
from ampatch.workloads import DEFAULT_WORKLOAD, SIZES, WORKLOADS

__all__ = ["tune", "TuneResult", "NoReference", "NoProgress", "DEFAULT_STEPS", "DEFAULT_BUDGET_S", "DEFAULT_LEVELS",
           "DEFAULT_SIZE"]

DEFAULT_STEPS = 40
DEFAULT_BUDGET_S = 600.0
DEFAULT_LEVELS = ("O1", "O2", "O3", "O4", "O5")
DEFAULT_SIZE = {"lm": "large", "cnn": "medium", "lstm": "medium"}


@dataclass(frozen=True)
class TuneResult:
    """A finished search: what ran (`what`, `steps`, `device`), everything it measured
    (`search`), the chosen policy with what it was measured on (`policy`), where that was
    written (`out`: None when not written), and how to rerun a script with it (`rerun`)."""

    search: Result
    what: str
    steps: int
    device: str
    policy: Policy
    out: str | None
    rerun: str
    command: str = "python train.py"   # the user's command line, as the "apply it" lines show it

    @property
    def chosen(self) -> Candidate | None:
        """The chosen policy; None when the runs could not tell (`cannot_tell`)."""
        if self.search.cannot_tell:
            return None
        return self.search.chosen or candidates.REFERENCE

    @property
    def cannot_tell(self) -> bool:
        """No verdict to stand by: the runs could not tell, within the budget and the script's length
        (the command exits 1, writes no policy file, and its JSON says why)."""
        return self.search.cannot_tell

    @property
    def interrupted(self) -> int | None:
        """The signal that stopped the search early (None: it finished)."""
        return self.search.interrupted

    def to_dict(self) -> dict[str, Any]:
        """The JSON of ``--json``, for every outcome: `outcome` ("chosen", "cannot tell", "no
        reference", "interrupted"), `reason`, `decide` (what would decide: steps, tolerance), `tolerance`,
        `deviation` (the measure, O0's progress and its significance), `reference`,
        `candidates`, `chosen`, timings and notes."""
        return {**report.to_json(self.search), "what": self.what, "steps": self.steps, "device": self.device,
                "policy_file": self.out}

    def write_json(self, path: str) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    def write_plot(self, path: str) -> None:
        """The PNG of ``--plot`` (`tune.plot`); ImportError without matplotlib."""
        plot.write_plot(path, self.search, report.title(self.what, self.search))

    def render(self) -> str:
        """The table, the choice with its reason, and how to apply it."""
        return report.render(self.search, report.title(self.what, self.search), self.out, self.rerun,
                             self.command)


def _check(command: Sequence[str] | None, workload: str | None, size: str | None, levels: Sequence[str],
           tolerance: float, steps: int, budget: float | None, rounds: int, out: str | None) -> list[str]:
    """The arguments checked (ValueError naming the fix); returns the levels, normalised."""
    if command is not None and (workload is not None or size is not None):
        raise ConfigError("workload/size apply to the built-in workloads; give your script its own options after its "
                          "command")
    if workload is not None and workload not in WORKLOADS:
        raise ConfigError(f"workload must be one of {', '.join(WORKLOADS)}, got {workload!r}")
    if size is not None and size not in SIZES:
        raise ConfigError(f"size must be one of {', '.join(SIZES)}, got {size!r}")
    if not tolerance > 0:
        raise ConfigError(f"tolerance must be above 0 (a relative deviation such as 0.02), got {tolerance!r}")
    if steps < 1:
        raise ConfigError(f"steps must be at least 1, got {steps}")
    if budget is not None and not budget > 0:
        raise ConfigError(f"budget must be a number of seconds above 0, or None for no limit, got {budget!r}")
    if rounds < 0:
        raise ConfigError(f"rounds must be 0 or more (0: no re-timing), got {rounds}")
    if out is not None and not Path(out).resolve().parent.is_dir():
        raise ConfigError(f"cannot write the policy to {out}: its directory does not exist")
    return list(dict.fromkeys(level_table.variant(x, "opt_level").label for x in levels))


def tune(command: Sequence[str] | None = None, *, workload: str | None = None, size: str | None = None,
         device: str | None = None, levels: Sequence[str] = DEFAULT_LEVELS, half_dtype: str | None = None,
         tolerance: float = TOLERANCE, steps: int = DEFAULT_STEPS, budget: float | None = DEFAULT_BUDGET_S,
         out: str | None = DEFAULT_PATH, repair: bool = True, rounds: int = timing.ROUNDS, apex_alias: bool = False,
         log: TextIO | None = None, objective: str = "speed") -> TuneResult:
    """The fastest precision policy that trains like FP32 for `command` (a script's command
    line, e.g. ``["python", "train.py"]``; None: the built-in `workload`), written to `out`.

    `levels`: the levels to try (O0 is the reference; "O5+fp8" adds O5 with each FP8 recipe,
    "O5+fp8:rowwise" that one, see `tune.fp8`); `half_dtype`: "bfloat16"/"float16"
    (None: those worth trying on `device`); `tolerance`: the largest deviation from O0's loss
    curve, relative to what O0 learns over the run, beyond the noise of the candidate's paired
    differences from O0 (`ampatch.runs.deviation`); `steps`: optimizer steps per run; `budget`: seconds for the
    whole search (None: no limit); `repair`: repair failed candidates with diagnose's
    recommendation; `rounds`: interleaved re-timing rounds (0: none); `objective`: "speed"
    (the fastest) or "memory" (the fewest bytes per trained parameter, the low-memory master
    modes among the candidates). See the module docstring."""
    log = log if log is not None else sys.stderr
    chosen_levels = _check(command, workload, size, levels, tolerance, steps, budget, rounds, out)
    if objective not in candidates.OBJECTIVES:
        raise ConfigError(f"objective must be one of {', '.join(candidates.OBJECTIVES)}, got {objective!r}")
    half = None if half_dtype in (None, "auto") else half_dtype
    if command is not None:
        cmd = runner.resolve_command(list(command))
        # the device the script trains on, as far as this machine tells (what candidates are worth trying)
        dev, what = builtin.workload_device(device), " ".join(command)
        job_cmd = lambda n: list(cmd)  # noqa: E731 - AMPATCH_MAX_STEPS stops it
        rerun, shown = f"ampatch run --policy {{policy}} -- {what}", what
    else:
        name = workload or DEFAULT_WORKLOAD
        dev = builtin.workload_device(device)
        size = size or DEFAULT_SIZE[name]
        what = f"built-in workload {name} ({size}, {dev}, 1 torch thread)"
        base = [sys.executable, "-m", f"ampatch.workloads.{name}", "--device", dev, "--threads", "1",
                "--size", size, "--seed", "0"]
        job_cmd = lambda n: base + ["--steps", str(n)]  # noqa: E731
        shown = f"python -m ampatch.workloads.{name} --size {size} --threads 1"
        rerun = f"ampatch run --policy {{policy}} -- {shown}"
    plain, variants = fp8.split(chosen_levels)
    cands = candidates.initial(plain, dev, half, objective) + fp8.candidates(variants, dev, half)
    if not any(v.fp8 for v in variants):  # FP8 asked for by name, or by default where it runs on tensor cores
        cands += fp8.by_default(plain, dev)
    cands = list(dict.fromkeys(cands))
    log.write(builtin.machine_notice(dev, ["O0", *plain, *(v.level for v in variants)], half) + "\n")
    budget_text = "no budget" if budget is None else f"a {budget:g}s budget"
    log.write(f"ampatch tune: {what}: O0 (the reference), then {len(cands)} candidate(s), "
              f"{steps} steps each, repairs{' and re-timing' if objective == 'speed' else ''}, within {budget_text}; "
              f"tolerance {tolerance:.2%}; objective: {objective}\n")
    log.flush()
    script = command is not None
    started = nullcontext(runner.popen) if script else builtin.launcher(dev, log)
    with started as launch:
        job = Job(job_cmd, steps, launch, apex_alias, script)
        search = Search(job, cands, tolerance, budget, log, repair=repair, rounds=rounds, objective=objective)
        try:
            result = search.run()
        except NoReference as exc:  # the JSON of --json is written for this outcome too
            exc.result = TuneResult(search.result, what, search.job.steps, dev,
                                    report.policy_of(search.result, search.job.steps, what, dev), None, rerun, shown)
            raise
    ran = search.job.steps
    policy = report.policy_of(result, ran, what, dev)
    written = None if result.interrupted is not None or result.cannot_tell or out is None else out
    if written is not None:
        save(policy, written)
    return TuneResult(result, what, ran, dev, policy, written, rerun, shown)
