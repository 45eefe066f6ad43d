#!/usr/bin/env python3
"""tune's verdicts on a generated family of fine-tuning cases (issues 35 and 45): the table of
docs/tune.md, "The grid", and the cells tests/commands/test_tune_grid.py checks.

Each case is a wide MLP near a teacher: a network with pretrained-scale weights (std 0.1) is
fine-tuned toward the same network with its head shifted, on targets with Gaussian noise no
model can learn. Its axes:

- ``noise``: the irreducible loss over the learnable one at the start (1, 10, 100): the loss
  level is that many times, plus one, what there is to learn;
- ``lr`` (1e-6 to 1e-3) and the optimizer (AdamW, or SGD with momentum 0.9);
- ``steps`` (20 to 200), which with the lr sets the progress: 0.1% to 20% of the level and
  more, down to none that a run's noise lets one see.

Each cell runs O0, O3, O4 and O5 (bfloat16) in this process, on the same batches, and searches
as ``tune`` does (`cell`): the grid's steps are where it starts; O0 runs longer (doubling) while
its loss shows no progress, and the levels the loss cannot tell yet run again with O0 at twice
the steps, within tune's default budget per cell (`ampatch.runs.longer`); each run is judged by
`ampatch.runs.verdict.judge`, its weights witness included. What each run really did is
measured beside the verdict, from outside the loss curve:

- ``stall``: the share of the weights (as the run holds them) that never changed over the run;
  "stalled" when most did (more than half);
- the learnable loss (the error against the noiseless teacher, on 4096 held-out inputs, in
  FP32 from the weights the optimizer steps) at the start and at 5 evenly spaced steps: the
  share of O0's true progress a run makes, and the largest gap from O0's at those points
  (over O0's true progress).

A right verdict (`expected`): O3 fails wherever it stalls; a level whose learnable loss stays
within half the tolerance of O0's qualifies; one that learns under half of what O0 learns, or
strays more than twice the tolerance, fails; in between either verdict is right. "Cannot tell"
is no verdict, counted apart: the cells that end in it (as tune would, exit 1) are few.
`old_rule` is the verdict before issue 35.

    python scripts/tune_grid.py                      # the whole grid: 72 cells (the time: docs/tune.md)
    python scripts/tune_grid.py --steps 20 --noise 10 --json cells.json
    python scripts/tune_grid.py train --lr 2e-5 --noise 9 --steps 40 --opt-level O3   # one run, as a script
    ampatch tune --levels O3,O5 --steps 40 --no-repair -- python scripts/tune_grid.py train --lr 2e-5 --noise 9 --seed 7
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace

import torch
from torch import nn

import ampatch as amp
from ampatch.config import env
from ampatch.runs.deviation import TOLERANCE, Basis
from ampatch.runs.longer import DEFAULT_BUDGET_S, Longer
from ampatch.runs.runner import LevelRun
from ampatch.runs.stats import RunStats
from ampatch.runs.verdict import Evidence, Outcome, Rule, Verdict, judge
from ampatch.runs.weights import compare as compare_weights
from ampatch.session import witness as weights_witness
from ampatch.tune.search import NoReference, sound_reference

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tune_grid_report import summary, table, verdict_word  # noqa: E402  (this directory's)

LEVELS = ("O3", "O4", "O5")
NOISES = (1.0, 10.0, 100.0)
LRS = (1e-6, 1e-5, 1e-4, 1e-3)
OPTIMIZERS = ("adamw", "sgd")
STEPS = (20, 60, 200)
STALLED = 0.5          # "most of its weights never change"
FAR = 0.5              # learning less than half of O0's progress: a level that must fail
D_IN, WIDTH, D_OUT, BATCH, EVAL = 32, 256, 256, 512, 4096
CHECKPOINTS = 5       # the learnable loss is measured at the start and at 5 evenly spaced steps


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.norm1 = nn.Linear(D_IN, WIDTH), nn.LayerNorm(WIDTH)
        self.fc2, self.norm2 = nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, D_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.gelu(self.norm1(self.fc1(x)))
        h = nn.functional.gelu(self.norm2(self.fc2(h)))
        return self.head(h)


def pretrained(seed: int) -> Net:
    """Weights at a trained model's scale (std 0.1; norm gains around 1)."""
    gen = torch.Generator().manual_seed(seed)
    net = Net()
    with torch.no_grad():
        for name, p in net.named_parameters():
            mean = 1.0 if name.startswith("norm") and name.endswith("weight") else 0.0
            p.copy_(mean + 0.1 * torch.randn(p.shape, generator=gen))
    return net


@dataclass(frozen=True)
class Case:
    noise: float = 9.0      # irreducible loss / learnable loss at the start
    lr: float = 2e-5
    optimizer: str = "adamw"
    steps: int = 40
    seed: int = 0

    @property
    def label(self) -> str:
        return f"{self.optimizer} lr {self.lr:g}, {self.steps} steps, noise {self.noise:g}x"


def _teacher(case: Case) -> tuple[Net, torch.Tensor, float]:
    """The teacher (the student's start with its head shifted), the eval inputs, and the
    target noise's standard deviation for `case.noise`."""
    teacher = pretrained(case.seed)
    gen = torch.Generator().manual_seed(case.seed + 1)
    with torch.no_grad():
        teacher.head.weight.add_(0.1 * torch.randn(teacher.head.weight.shape, generator=gen))
        x_eval = torch.randn(EVAL, D_IN, generator=gen)
        learnable = float(((pretrained(case.seed)(x_eval) - teacher(x_eval)) ** 2).mean())
    return teacher, x_eval, math.sqrt(case.noise * learnable)


@dataclass
class Run:
    level: str
    report: amp.Report | None
    error: str | None
    wall_s: float
    stall: float = math.nan            # share of the weights, as the run holds them, never changed
    excess: list[float] = field(default_factory=list)   # error against the teacher at the checkpoints
    witness: weights_witness.Witness | None = None      # its weights witness (`ampatch.session.witness`)


def train(case: Case, level: str, log_every: int = 0) -> Run:
    """One run of `case` at `level` (bfloat16), in this process; the data is drawn from the
    case's own generator, the same batches at every level."""
    torch.manual_seed(case.seed)
    teacher, x_eval, sigma = _teacher(case)
    model = pretrained(case.seed)
    fp32 = pretrained(case.seed)
    opt_cls = torch.optim.AdamW if case.optimizer == "adamw" else torch.optim.SGD
    kw = {} if case.optimizer == "adamw" else {"momentum": 0.9}
    optimizer = opt_cls(model.parameters(), lr=case.lr, **kw)
    start = time.perf_counter()
    model, optimizer = amp.initialize(model, optimizer, opt_level=level, half_dtype=torch.bfloat16, verbosity=0)
    try:
        held = [p.detach().clone() for p in model.parameters()]

        def excess() -> float:
            with torch.no_grad(), amp.disable_casts():
                for dst, src in zip(fp32.parameters(), amp.master_params(optimizer)):
                    dst.copy_(src.float())
                return float(((fp32(x_eval) - teacher(x_eval)) ** 2).mean())
        at = {round(case.steps * i / CHECKPOINTS) for i in range(1, CHECKPOINTS + 1)}
        curve = [excess()]
        gen = torch.Generator().manual_seed(case.seed + 2)
        for step in range(case.steps):
            x = torch.randn(BATCH, D_IN, generator=gen)
            with torch.no_grad(), amp.disable_casts():
                y = teacher(x) + sigma * torch.randn(BATCH, D_OUT, generator=gen)
            loss = nn.functional.mse_loss(model(x).float(), y)
            optimizer.zero_grad()
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            optimizer.step()
            if log_every and step % log_every == 0:
                print(f"step {step} loss {loss.item():.5f}", flush=True)
            if step + 1 in at:
                curve.append(excess())
        wall = time.perf_counter() - start
        same = sum(int((a == b).sum()) for a, b in zip(held, model.parameters()))
        stall = same / sum(p.numel() for p in held)
        report = amp.report()
    except Exception as exc:  # a failing level is a row, as in tune
        amp.deinitialize()
        return Run(level, None, f"{type(exc).__name__}: {exc}", time.perf_counter() - start)
    amp.deinitialize()   # the witness takes its last point as the session closes
    return Run(level, report, None, wall, stall, curve, weights_witness.latest())


@dataclass
class Judged:
    level: str
    qualifies: bool
    reason: str
    stall: float
    learned: float | None          # what the verdict measured: the share of O0's progress on the batches' losses
    true_share: float              # ... on the learnable loss, against the noiseless teacher
    true_gap: float                # largest |its learnable loss - O0's| at the checkpoints / O0's true progress
    expected: str                  # "qualify", "fail" or "either"
    deviation: float | None = None
    noise: float | None = None
    old: bool | None = None        # the verdict of the rule before issue 35
    outcome: str = "fails"         # `Outcome` value: "qualifies", "fails" or "cannot tell"
    evidence: str = "loss"         # what the verdict rests on: "loss" or "weights" (or "run")
    steps: int = 0                 # the steps it rests on (the grid's, or more where the runs could not tell)

    @property
    def right(self) -> bool:
        """A verdict given is right by the cell's truth; "cannot tell" is not wrong, it is counted apart."""
        if self.outcome == Outcome.CANNOT_TELL.value:
            return True
        return self.expected == "either" or (self.expected == "qualify") == self.qualifies


@dataclass
class Cell:
    case: Case
    o0_progress: float | None       # O0's progress over its level (the batches' losses)
    o0_significance: float | None   # ... in standard errors of its own noise
    o0_needed: float | None
    stopped: str | None             # tune's "run more steps" message, when O0 made no detectable progress
    o0_true: float                  # O0's true progress over its learnable loss at the start
    levels: list[Judged] = field(default_factory=list)
    o3_stall: float | None = None   # measured even where tune stops
    steps: list[int] = field(default_factory=list)   # the lengths O0 ran at (doubling where the runs could not tell)
    wall_s: float = 0.0

    @property
    def right(self) -> bool:
        return all(j.right for j in self.levels)

    @property
    def cannot_tell(self) -> bool:
        """The cell ends in "cannot tell", as tune would (exit 1): O0 stopped it, or no level
        qualifies and some level the runs could not tell."""
        left = any(j.outcome == Outcome.CANNOT_TELL.value for j in self.levels)
        return self.stopped is not None or (left and not any(j.qualifies for j in self.levels))


def row_of(run: Run, base: RunStats | None) -> RunStats:
    return RunStats.of(LevelRun(run.level, run.report is not None, run.error, 0, run.wall_s, run.report,
                                witness=run.witness), base)


def expected(level: str, stall: float, true_share: float, true_gap: float, tolerance: float) -> str:
    """What a right verdict is, from what the run really did: O3 whose weights mostly never
    changed fails; a level whose learnable loss stays within half the tolerance of O0's at every
    checkpoint qualifies; one that learns less than half of what O0 learns, or strays more than
    twice the tolerance, fails; in between (near the tolerance) either verdict is right."""
    if level == "O3" and stall > STALLED:
        return "fail"
    if true_share < FAR or true_gap > 2 * tolerance:
        return "fail"
    if true_gap <= tolerance / 2:
        return "qualify"
    return "either"


def old_rule(o0: list[float], run: list[float], tolerance: float) -> bool:
    """The verdict before issue 35, for the comparison column: O0's progress (5-loss means at
    each end) was the basis only when it fell by at least 0.5% of its level and by more than 2
    standard errors of its step-to-step changes, else the loss level at each step was, and the
    learning test (at least half of O0's progress) was off; the noise floor of a same-seed O0
    rerun was 0 on a CPU."""
    w = max(1, min(5, len(o0) // 2))
    first, last = sum(o0[:w]) / w, sum(o0[-w:]) / w
    changes = [b - a for a, b in zip(o0, o0[1:])]
    noise = statistics.pstdev(changes) / math.sqrt(2) * math.sqrt(2 / w)
    progress = first - last >= 0.005 * abs(first) and first - last > 2 * noise
    if progress and (sum(run[:w]) - sum(run[-w:])) / w / (first - last) < 0.5:
        return False

    def smooth(c: list[float]) -> list[float]:
        return [sum(c[max(0, i - 4):i + 1]) / len(c[max(0, i - 4):i + 1]) for i in range(len(c))]
    dev = max(abs(a - b) / ((first - last) if progress else abs(b)) for a, b in zip(smooth(run), smooth(o0)))
    return dev <= tolerance


def recording() -> None:
    """Sessions in this process record their losses and weights witness, as under the ``ampatch``
    command (what is written at exit goes to scratch files)."""
    if not os.environ.get(env.REPORT):
        scratch = tempfile.mkdtemp(prefix="tune-grid-")
        os.environ[env.REPORT] = os.path.join(scratch, "report.json")
        os.environ[env.WITNESS] = os.path.join(scratch, "witness.json")


def _judged(level: str, run: Run, o0: Run, base: RunStats, rule: Rule, n: int) -> Judged:
    """`run` judged against O0's run of the same length as tune judges it, beside what it really did."""
    row = row_of(run, base)
    v: Verdict = judge(row, rule, base.reference(), o0_witness=base.witness)
    true_fall = o0.excess[0] - o0.excess[-1]
    share = (run.excess[0] - run.excess[-1]) / true_fall if run.excess else math.nan
    gap = max(abs(a - b) for a, b in zip(run.excess, o0.excess)) / true_fall if run.excess else math.nan
    old = old_rule(base.losses, row.losses, rule.tolerance) if row.ok and len(row.losses) == len(base.losses) else None
    return Judged(level, v.qualifies, v.reason, run.stall, v.learned, share, gap,
                  expected(level, run.stall, share, gap, rule.tolerance), v.deviation, v.noise, old, v.outcome.value,
                  v.evidence.value, n)


def cell(case: Case, levels: tuple[str, ...] = LEVELS, tolerance: float = TOLERANCE,
         budget: float | None = DEFAULT_BUDGET_S) -> Cell:
    """One cell, as `ampatch tune` searches it (`ampatch.tune.search`, in this process): O0 at the
    cell's steps, run longer (doubling, within `budget` seconds) while its loss shows no progress
    and its weights could still witness; then each level, judged as tune judges it, and the
    levels the loss cannot tell yet (or that qualify on their weights alone) run again with O0 at
    twice the steps while the budget fits them; beside each verdict, what the run really did."""
    recording()
    start = time.perf_counter()
    rule = Rule(tolerance)
    longer = Longer(case.steps, case.steps, None if budget is None else time.time() + budget)

    def reference(n: int) -> tuple[Run, RunStats]:
        o0 = train(replace(case, steps=n), "O0")
        base = row_of(o0, None)
        try:
            sound_reference(base)
        except NoReference as exc:
            raise RuntimeError(f"{case.label}: {exc}") from None
        return o0, base
    o0, base = reference(case.steps)
    out = Cell(case, None, None, None, None, math.nan, steps=[case.steps])
    while base.reference().basis is not Basis.PROGRESS:
        w = compare_weights(base.witness, base.witness, rule.confidence)
        if w is None or not w.witnesses or longer.why_not(1 + len(levels), o0.wall_s) is not None:
            break
        o0, base = reference(longer.double())
        out.steps.append(longer.steps)
    ref = base.reference()
    w = compare_weights(base.witness, base.witness, rule.confidence)
    out.o0_progress = ref.progress / ref.first if ref.progress is not None and ref.first else None
    out.o0_significance, out.o0_needed = ref.significance, ref.needed
    out.o0_true = (o0.excess[0] - o0.excess[-1]) / o0.excess[0]
    if ref.basis is not Basis.PROGRESS and (w is None or not w.witnesses):
        out.stopped = ref.no_progress(longer.steps) + ("" if w is None else f" ({w.why_not})")
        if "O3" in levels:
            out.o3_stall = train(replace(case, steps=longer.steps), "O3").stall
        out.wall_s = time.perf_counter() - start
        return out
    runs = {level: train(replace(case, steps=longer.steps), level) for level in levels}
    judged = {level: _judged(level, run, o0, base, rule, longer.steps) for level, run in runs.items()}
    while True:
        left = [k for k, j in judged.items()
                if j.outcome == Outcome.CANNOT_TELL.value or (j.qualifies and j.evidence == Evidence.WEIGHTS.value)]
        slowest = max([o0.wall_s, *(r.wall_s for r in runs.values())])
        if not left or longer.why_not(1 + len(left), slowest) is not None:
            break
        o0, base = reference(longer.double())
        out.steps.append(longer.steps)
        for level in left:
            runs[level] = train(replace(case, steps=longer.steps), level)
            judged[level] = _judged(level, runs[level], o0, base, rule, longer.steps)
    out.levels = [judged[level] for level in levels]
    out.o3_stall = runs["O3"].stall if "O3" in runs else None
    out.wall_s = time.perf_counter() - start
    return out


def _grid(a: argparse.Namespace) -> list[Case]:
    return [Case(noise, lr, opt, steps) for opt, lr, steps, noise in
            itertools.product(a.optimizer or OPTIMIZERS, a.lr or LRS, a.steps or STEPS, a.noise or NOISES)]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train"]:
        p = argparse.ArgumentParser(prog="tune_grid.py train", description="one run of a grid case, as a script "
                                    "(ampatch run/compare/tune force the level from outside)")
        p.add_argument("--noise", type=float, default=Case.noise)
        p.add_argument("--lr", type=float, default=Case.lr)
        p.add_argument("--optimizer", choices=OPTIMIZERS, default=Case.optimizer)
        p.add_argument("--steps", type=int, default=Case.steps)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--opt-level", default="O0")
        a = p.parse_args(argv[1:])
        torch.set_num_threads(1)
        run = train(Case(a.noise, a.lr, a.optimizer, a.steps, a.seed), a.opt_level, log_every=10)
        if run.error:
            print(run.error, file=sys.stderr)
            return 1
        print(f"{a.opt_level}: weights never changed {run.stall:.1%}; learnable loss {run.excess[0]:.5f} -> "
              f"{run.excess[-1]:.5f}")
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--optimizer", nargs="*", choices=OPTIMIZERS)
    p.add_argument("--lr", nargs="*", type=float)
    p.add_argument("--steps", nargs="*", type=int)
    p.add_argument("--noise", nargs="*", type=float)
    p.add_argument("--tolerance", type=float, default=TOLERANCE)
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                   help=f"seconds per cell for runs made longer, as tune's --budget (default {DEFAULT_BUDGET_S:g})")
    p.add_argument("--json", metavar="PATH", help="every cell, every verdict")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    cells = []
    start = time.perf_counter()
    for case in _grid(a):
        c = cell(case, tolerance=a.tolerance, budget=a.budget)
        cells.append(c)
        print(f"[{len(cells)}] {case.label}, steps {'/'.join(map(str, c.steps))}: " + (
            c.stopped[:80] if c.stopped else ", ".join(f"{j.level} {verdict_word(j)}" for j in c.levels))
            + f" ({time.perf_counter() - start:.0f}s)", file=sys.stderr, flush=True)
    print(table(cells))
    print()
    print(summary(cells, STALLED))
    if a.json:
        with open(a.json, "w") as f:
            json.dump([asdict(c) for c in cells], f, indent=1, default=str)
    return 0 if all(c.right for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
