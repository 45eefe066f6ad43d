"""One candidate's run, as ``ampatch run --policy`` runs it, and its verdict against O0's
(`verdict.judge`: finite, no late skipped step, learning, within the tolerance plus its noise allowance);
a run whose FP8 was emulated says so in its reason: it is never chosen for speed (`tune.fp8`).
"""
from __future__ import annotations

import dataclasses
import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from ampatch.config import env
from ampatch.config.levels import variant_label
from ampatch.config.policy_file import save
from ampatch.runs.progress import Progress
from ampatch.runs.runner import COLLECT, Finished, Launch, child_env, level_run, popen, run_child, with_apex_alias
from ampatch.runs.stats import RunStats
from ampatch.runs.verdict import Decider, Evidence, Outcome, Rule, judge, label
from ampatch.runs.weights import WeightComparison
from ampatch.tune.candidates import Candidate
from ampatch.tune.fp8 import NOT_CHOSEN, emulated

__all__ = ["Job", "Measured", "run_candidate", "measured"]


@dataclass(frozen=True)
class Job:
    """How every candidate runs: `command(steps)` (a built-in workload's, or the user's
    script, which `AMPATCH_MAX_STEPS` stops), started by `launch`, for `steps` optimizer steps."""

    command: Callable[[int], list[str]]
    steps: int
    launch: Launch = popen
    apex_alias: bool = False
    script: bool = False     # a user script: stopped by AMPATCH_MAX_STEPS


@dataclass(frozen=True)
class Measured:
    """A candidate's run and verdict (`reason`: why it does not qualify, or what it is;
    `outcome`: `verdict.Outcome` from `qualifies` and `undecided`, on the evidence `evidence`,
    over `steps` steps)."""

    candidate: Candidate
    row: RunStats
    qualifies: bool
    reason: str
    finite: bool
    deviation: float | None
    step_fault: bool = False
    learned: float | None = None          # the share of O0's progress it makes (None: not measured)
    learned_margin: float | None = None   # ... at least learned - learned_margin, at the rule's confidence
    noise: float | None = None            # the deviation's noise allowance, from its paired differences with O0
    beyond: float | None = None           # how far its deviation goes beyond that allowance
    evidence: Evidence = Evidence.LOSS
    decide: Decider | None = None         # CANNOT_TELL: what would decide it
    steps: int | None = None              # the steps its verdict rests on
    weights: WeightComparison | None = None
    undecided: bool = False               # the runs cannot tell (then `qualifies` is False)

    @property
    def outcome(self) -> Outcome:
        return Outcome.CANNOT_TELL if self.undecided else Outcome.QUALIFIES if self.qualifies else Outcome.FAILS

    @property
    def verdict_label(self) -> str:
        """The table's word for the outcome (`verdict.label`)."""
        return label(self.outcome, self.evidence)

    @property
    def step_ms(self) -> float | None:
        return self.row.median_step_ms

    def to_dict(self, reference_ms: float | None = None) -> dict[str, Any]:
        """The JSON fields of a candidate."""
        c = self.candidate
        ms = self.step_ms
        return {"opt_level": c.opt_level, "half_dtype": c.half_dtype, "keep_fp32": list(c.keep_fp32),
                "loss_scale": c.loss_scale, "master_weights": c.master_weights,
                "optimizer_states": c.optimizer_states, "step_ms": ms,
                "speedup": reference_ms / ms if reference_ms and ms else None,
                "deviation": self.deviation if self.deviation is None or math.isfinite(self.deviation) else None,
                "learned": self.learned, "learned_margin": self.learned_margin, "noise": self.noise,
                "beyond_noise": self.beyond,
                "finite": self.finite, "qualifies": self.qualifies, "outcome": self.outcome.value,
                "evidence": self.evidence.value, "steps": self.steps, "reason": self.reason,
                "decide": None if self.decide is None else {"steps": self.decide.steps,
                                                             "tolerance": self.decide.tolerance},
                "weights": None if self.weights is None else dataclasses.asdict(self.weights),
                "peak_memory_mib": self.row.peak_memory_mib, "train_bytes_per_param": self.row.train_bytes_per_param,
                "final_loss": self.row.final_loss,
                "repairs": c.repairs, "step_fault": self.step_fault, "fp8": c.fp8,
                "fp8_modules": list(c.fp8_modules) if c.fp8_modules is not None else None,
                "fp8_exclude": list(c.fp8_exclude), "fp8_emulated": self.emulated}

    @property
    def emulated(self) -> bool:
        """Its FP8 was emulated: listed for its fidelity, never chosen for speed (`tune.fp8`)."""
        return emulated(self.row.report)


def environment(candidate: Candidate, job: Job, policy_path: str) -> dict[str, str]:
    """The run's environment: the candidate's policy (AMPATCH_POLICY) and nothing forced besides;
    a script stops after the job's steps."""
    variables = child_env(None, None, policy=policy_path, max_steps=job.steps if job.script else None)
    for name in (env.DIAGNOSE, *COLLECT):  # this run's own, set by run_candidate
        variables.pop(name, None)
    return with_apex_alias(variables) if job.apex_alias else variables


def run_candidate(candidate: Candidate, job: Job, log: TextIO | None, record: bool = False) -> Finished:
    """Run `candidate` once for the job's steps (with the diagnose recorder on: `record`)."""
    n = job.steps
    with tempfile.TemporaryDirectory(prefix="ampatch-tune-") as tmp:
        path = str(Path(tmp, "policy.json"))
        save(candidate.policy(), path)
        progress = Progress(candidate.label, n, stream=log) if log is not None else None
        collect = (*COLLECT, env.DIAGNOSE) if record else COLLECT
        return run_child(job.command(n), environment(candidate, job, path), collect=collect,
                         progress=progress, launch=job.launch)


def measured(candidate: Candidate, done: Finished, reference: RunStats | None, rule: Rule,
             upto: int | None = None) -> Measured:
    """The verdict of `candidate`'s finished run against the O0 `reference` row (None: it is
    the reference)."""
    # forced as its label says: a run at another level, master mode or FP8 recipe fails (runner.level_run)
    mode = candidate.master_weights if isinstance(candidate.master_weights, str) else None
    label = variant_label(candidate.opt_level, mode, candidate.fp8, candidate.optimizer_states)
    row = RunStats.of(level_run(done, label), reference, upto)
    if reference is None:  # the reference itself
        return Measured(candidate, row, row.ok, "the reference (FP32)" if row.ok else f"run failed: {row.error}",
                        row.ok and all(math.isfinite(x) for x in row.losses), 0.0 if row.ok else None,
                        steps=row.steps)
    v = judge(row, rule, reference.reference(upto), upto, reference.witness)
    reason = f"{v.reason}; {NOT_CHOSEN}" if emulated(row.report) else v.reason
    under = row.report.optimizer_state_underflow if row.report is not None else 0.0
    if not v.qualifies and candidate.optimizer_states == "int8" and under > 0:
        reason += (f"; its int8 optimizer state held {under:.1%} of its elements at the bottom of their block's range "
                   "(a block of 256 holds about 1e-5 of its largest for a first moment, 1e-10 for a second): "
                   "optimizer_states='bfloat16' keeps each element's own exponent")
    return Measured(candidate, row, v.qualifies, reason, v.finite, v.deviation, learned=v.learned,
                    learned_margin=v.learned_margin, noise=v.noise, beyond=v.beyond, evidence=v.evidence,
                    decide=v.decide, steps=v.steps, weights=v.weights, undecided=not v.judged)


