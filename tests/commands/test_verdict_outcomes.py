"""The one verdict of compare, tune and diagnose (`ampatch.runs.verdict`): qualifies, fails, or
cannot tell with what would decide it; the trend test that grows with the run; the resolution
floor of a loss; the weights as a second witness (`ampatch.runs.weights`). Hand-made curves and
witnesses, several seeds each, so that no verdict rests on one example."""
from __future__ import annotations

import math
import random
import statistics

import pytest
import torch
from _reports import report

from ampatch.runs import resolution
from ampatch.runs.deviation import MIN_SHARE, Basis, Reference, against
from ampatch.runs.runner import LevelRun
from ampatch.runs.stats import RunStats
from ampatch.runs.verdict import Decider, Evidence, Outcome, Rule, judge
from ampatch.runs.weights import MOVED, compare
from ampatch.session.witness import DIMS, Witness, WitnessPoint


def _row(level: str, losses: list[float], base: RunStats | None = None, witness: Witness | None = None) -> RunStats:
    rep = report({"opt_level": level, "losses": losses, "steps": len(losses), "step_times_s": [0.01] * 5})
    return RunStats.of(LevelRun(level, True, None, 0, 1.0, rep, witness=witness), base)


def _witness(displacements: list[list[float]], moved: float = 1.0, start: list[float] | None = None) -> Witness:
    """A witness whose sketch moves by `displacements[i]` from `start` at 2**i updates (0: the start)."""
    start = start or [0.0] * DIMS
    points = [WitnessPoint(0, tuple(start), 0.0)]
    for i, d in enumerate(displacements):
        points.append(WitnessPoint(2 ** i, tuple(s + x for s, x in zip(start, d)), moved))
    return Witness(DIMS, 4096, 100_000, "float32", tuple(points))


def _direction(rng: random.Random) -> list[float]:
    return [rng.gauss(0, 1) for _ in range(DIMS)]


# ------------------------------------------------------------------ the trend grows with the run
@pytest.mark.parametrize("seed", range(3))
def test_the_progress_test_grows_with_the_run(seed):
    """A steady fall in batch noise: the trend's t statistic grows with the run's length (about
    as its 1.5th power), so a run that is not yet detectable becomes so when it runs longer. A
    mean of the first and last five losses does not: its standard error stays that of five."""
    rng = random.Random(seed)
    zs = {n: [] for n in (20, 40, 80, 160)}
    for _ in range(40):
        curve = [10.0 - 0.002 * i + rng.gauss(0, 0.05) for i in range(160)]
        for n in zs:
            zs[n].append(Reference.of(dict(enumerate(curve[:n]))).significance)
    medians = [statistics.median(zs[n]) for n in sorted(zs)]
    assert all(b > 1.8 * a for a, b in zip(medians, medians[1:])), medians
    first_40 = sum(z40 > z20 for z20, z40 in zip(zs[20], zs[40]))
    assert first_40 >= 0.8 * len(zs[20])


# ------------------------------------------------------------------ what a loss resolves
def test_a_deterministic_fall_of_a_few_ulps_is_not_progress():
    """Full-batch at a tiny learning rate: the loss falls by 3 float32 ulps over 20 steps, as a
    staircase with nothing else in it. Its 'noise' is the rounding itself, so without a floor it
    reads as dozens of standard errors; a loss cannot witness what its arithmetic does not resolve."""
    ulp = resolution.ulp(1.014, torch.float32)
    values = [float(torch.tensor(1.014 - ulp * (3 * i // 19), dtype=torch.float32)) for i in range(20)]
    ref = Reference.of(dict(enumerate(values)))
    assert ref.dtype == "float32" and ref.significance > 5           # what the noise alone would say
    assert ref.basis is Basis.LEVEL and "ulps of float32" in ref.why_not()
    grown = [float(torch.tensor(1.014 - ulp * (30 * i // 19), dtype=torch.float32)) for i in range(20)]
    assert Reference.of(dict(enumerate(grown))).basis is Basis.PROGRESS   # ten times the fall: resolved


def test_a_loss_computed_in_bfloat16_cannot_witness_a_fall_finer_than_its_spacing():
    """O0's loss falls 0.01 at 1.0; a run whose loss is a bfloat16 number (0.0078 apart at 1.0)
    cannot say whether it made that fall: its loss cannot tell, whatever share it shows."""
    rng = random.Random(3)
    o0 = {i: 1.0 + 0.01 * (1 - i / 59) + rng.gauss(0, 1e-4) for i in range(60)}
    ref = Reference.of(o0)
    assert ref.basis is Basis.PROGRESS
    half = {i: float(torch.tensor(x).bfloat16()) for i, x in o0.items()}
    assert resolution.dtype_of(half.values()) == torch.bfloat16
    c = against(half, ref)
    assert c.unresolved is not None and "bfloat16" in c.unresolved
    v = judge(_row("O5", list(half.values()), _row("O0", list(o0.values()))), Rule(0.02), ref)
    assert v.outcome is Outcome.CANNOT_TELL and v.decide is not None and v.decide.steps


# ------------------------------------------------------------------ cannot tell, with what would decide
def test_too_noisy_differences_cannot_tell_and_name_the_tolerance_that_could():
    rng = random.Random(5)
    o0 = [3.0 - 0.005 * i + rng.gauss(0, 0.01) for i in range(200)]
    base = _row("O0", o0)
    loud = [x + rng.gauss(0, 0.05) for x in o0]
    v = judge(_row("O5", loud, base), Rule(0.02), base.reference())
    assert v.outcome is Outcome.CANNOT_TELL and not v.qualifies and not v.judged
    assert v.reason.startswith("too noisy to judge at this tolerance (2.00%)")
    assert v.decide.tolerance == pytest.approx(v.noise) and v.decide.tolerance > 0.02
    assert f"a tolerance of {v.noise:.2%}" in v.reason
    wide = judge(_row("O5", loud, base), Rule(2 * v.noise), base.reference())   # at that tolerance it decides
    assert wide.judged


def test_a_share_that_straddles_the_band_cannot_tell_and_one_outside_it_fails():
    """Learning 'between half and twice' at 99%: an interval wholly outside fails, one across a
    bound cannot tell yet (more steps narrow it), one inside passes the test."""
    rng = random.Random(7)
    batch = [rng.gauss(0, 0.05) for _ in range(40)]
    o0 = [10.0 - 0.004 * i + batch[i] for i in range(40)]
    base = _row("O0", o0)
    ref = base.reference()
    assert ref.basis is Basis.PROGRESS
    stalled = judge(_row("O3", [10.0 + b for b in batch], base), Rule(0.02), ref)
    middle = judge(_row("O3", [10.0 - 0.002 * i + batch[i] for i in range(40)], base), Rule(0.02), ref)
    assert stalled.outcome in (Outcome.FAILS, Outcome.CANNOT_TELL)
    assert middle.learned == pytest.approx(0.5, abs=0.15)
    lo, hi = middle.learned - middle.learned_margin, middle.learned + middle.learned_margin
    if lo < MIN_SHARE < hi:
        assert middle.outcome is Outcome.CANNOT_TELL and "too uncertain" in middle.reason
    far = judge(_row("O3", [10.0 + 0.0 * i for i in range(40)], _row("O0", [10 - 0.004 * i for i in range(40)])),
                Rule(0.02), _row("O0", [10 - 0.004 * i for i in range(40)]).reference())
    assert far.outcome is Outcome.FAILS and far.reason.startswith("learns 0%")


# ------------------------------------------------------------------ the weights as a second witness
@pytest.mark.parametrize("seed", range(4))
def test_a_stalled_run_fails_on_its_weights_where_the_loss_is_flat(seed):
    """O0's loss shows nothing (a fall far inside its noise), but its weights moved; a run whose
    weights stay where they started (a stalled O3) fails on them, labelled; one that follows
    O0's weights qualifies on them, labelled; one that moves elsewhere cannot tell."""
    rng = random.Random(seed)
    flat = [5.0 + rng.gauss(0, 0.3) for _ in range(40)]
    o0_dirs = [_direction(rng) for _ in range(6)]
    steps = [[x * (k + 1) for x in o0_dirs[0]] for k in range(6)]   # O0 moves steadily one way
    o0w = _witness(steps)
    base = _row("O0", flat, witness=o0w)
    ref = base.reference()
    assert ref.basis is Basis.LEVEL
    rule = Rule(0.02)
    stall = _witness([[0.03 * x for x in s] + [] for s in steps], moved=0.05)
    v = judge(_row("O3", flat, base, stall), rule, ref, o0_witness=o0w)
    assert v.outcome is Outcome.FAILS and v.evidence is Evidence.WEIGHTS and v.label == "FAIL (weights)"
    assert "its weights move 3%" in v.reason and "the loss cannot tell" in v.reason
    follow = _witness([[x + 0.001 * rng.gauss(0, 1) for x in s] for s in steps])
    f = judge(_row("O5", flat, base, follow), rule, ref, o0_witness=o0w)
    assert f.qualifies and f.evidence is Evidence.WEIGHTS and f.label == "ok (weights)"
    assert f.weights.share == pytest.approx(1, abs=0.01) and f.weights.bound < 0.02
    elsewhere = _witness([[x * (k + 1) for x in _direction(rng)] for k in range(6)])
    e = judge(_row("O1", flat, base, elsewhere), rule, ref, o0_witness=o0w)
    assert e.outcome is Outcome.FAILS                  # its weights do not go O0's way at all
    scatter = [_direction(rng) for _ in range(6)]
    partly = _witness([[x + 0.3 * (k + 1) * y for x, y in zip(s, scatter[k])] for k, s in enumerate(steps)])
    p = judge(_row("O1", flat, base, partly), rule, ref, o0_witness=o0w)
    assert p.outcome is Outcome.CANNOT_TELL and "the weights cannot tell either" in p.reason
    assert MIN_SHARE < p.weights.share - p.weights.margin and p.weights.bound > 0.02


def test_the_weights_thresholds_come_from_the_buckets_own_spread():
    """The share's margin is Student's t over the projection's buckets: a follower with more
    scatter between the buckets gets a wider margin, and no fixed fraction decides."""
    rng = random.Random(11)
    way = _direction(rng)
    o0 = _witness([[x * (k + 1) for x in way] for k in range(3)])
    tight = _witness([[x * (k + 1) + 0.01 * rng.gauss(0, 1) for x in way] for k in range(3)])
    loose = _witness([[x * (k + 1) + 1.0 * rng.gauss(0, 1) for x in way] for k in range(3)])
    t, lo = compare(tight, o0, 0.99), compare(loose, o0, 0.99)
    assert t.witnesses and lo.witnesses and 0 < t.margin < lo.margin
    assert lo.bound > t.bound


def test_weights_that_barely_moved_witness_nothing():
    """At a learning rate below FP32's resolution most of O0's weights never change: its weights
    cannot witness learning, whatever the projection shows."""
    rng = random.Random(2)
    o0 = _witness([_direction(rng)], moved=MOVED / 2)
    w = compare(o0, o0, 0.99)
    assert not w.witnesses and "barely moved" in w.why_not
    assert compare(None, o0, 0.99) is None


def test_the_decider_says_what_would_decide():
    assert Decider(320, None).describe() == "about 320 steps"
    assert Decider(None, 0.25).describe() == "a tolerance of 25.00% or more"
    assert Decider(80, 0.05).describe() == "about 80 steps or a tolerance of 5.00% or more"
    assert math.isfinite(Decider().describe().count(" "))


def test_the_scalers_first_back_offs_are_not_late_skips_wherever_they_start():
    """A dynamic scale that fits for 9 steps and then overflows backs off once: the scaler finding
    what fits, as at step 0; a second streak later is a late skip and fails the run."""
    from ampatch.runs.verdict import first_backoffs
    assert first_backoffs([9]) == [9] and first_backoffs([0, 1, 2, 7]) == [0, 1, 2] and first_backoffs([]) == []
    o0 = [3.0 - 0.05 * i for i in range(20)]
    base = _row("O0", o0)
    rep = report({"opt_level": "O1", "losses": o0, "steps": 20, "skipped_steps": [9]})
    once = judge(RunStats.of(LevelRun("O1", True, None, 0, 1.0, rep), base), Rule(0.02), base.reference())
    assert once.qualifies, once.reason
    rep = report({"opt_level": "O1", "losses": o0, "steps": 20, "skipped_steps": [9, 14]})
    twice = judge(RunStats.of(LevelRun("O1", True, None, 0, 1.0, rep), base), Rule(0.02), base.reference())
    assert twice.outcome is Outcome.FAILS and "(first: 14)" in twice.reason


@pytest.mark.parametrize("seed", range(3))
def test_a_loss_curve_that_strays_where_the_weights_do_not_is_the_loss_arithmetic(seed):
    """O0's progress is small; a half-precision forward computes the same weights' loss a little
    off (a steady offset of 4% of O0's progress): its curve strays beyond the 2% tolerance, but
    its weights follow O0's, so the stray is the loss's arithmetic and it qualifies on them,
    labelled. With weights that went elsewhere, the loss's verdict stands."""
    rng = random.Random(seed)
    o0 = [2.0 - 0.00005 * i + rng.gauss(0, 0.0005) for i in range(200)]
    way = _direction(rng)
    o0w = _witness([[x * (k + 1) for x in way] for k in range(8)])
    base = _row("O0", o0, witness=o0w)
    ref = base.reference()
    assert ref.basis is Basis.PROGRESS
    offset = [x + 0.04 * ref.progress + rng.gauss(0, 1e-6) for x in o0]
    follow = _witness([[x * (k + 1) + 1e-4 * rng.gauss(0, 1) for x in way] for k in range(8)])
    v = judge(_row("O4", offset, base, follow), Rule(0.02), ref, o0_witness=o0w)
    assert v.qualifies and v.evidence is Evidence.WEIGHTS and "the loss's own arithmetic" in v.reason
    apart = _witness([[x * (k + 1) + 0.3 * (k + 1) * rng.gauss(0, 1) for x in way] for k in range(8)])
    w = judge(_row("O4", offset, base, apart), Rule(0.02), ref, o0_witness=o0w)
    assert w.outcome is Outcome.FAILS and w.evidence is Evidence.LOSS and "> tolerance 2.00%" in w.reason


def test_a_deviation_beyond_its_noise_by_more_than_the_tolerance_fails_however_noisy():
    """Differences too noisy to qualify a run at the tolerance, but a curve that strays from O0's
    by more than the tolerance past that noise: the loss decides, it fails (before, every level
    of a planted bfloat16 cancellation read "can't tell" and tune wrote no policy)."""
    rng = random.Random(5)
    o0 = [3.0 - 0.005 * i + rng.gauss(0, 0.01) for i in range(200)]
    base = _row("O0", o0)
    strays = [x + rng.gauss(0, 0.05) + (0.2 if i >= 100 else 0.0) for i, x in enumerate(o0)]
    v = judge(_row("O1", strays, base), Rule(0.02), base.reference())
    assert v.noise > 0.02 and v.beyond > 0.02
    assert v.outcome is Outcome.FAILS and v.judged and not v.qualifies
    assert "beyond its noise of" in v.reason and "> tolerance 2.00%" in v.reason
