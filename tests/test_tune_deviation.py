"""The one deviation of a loss curve from O0's (`ampatch.runs.deviation`), and `compare` using it."""
from __future__ import annotations

import math

import pytest
from _reports import report

from ampatch.compare.rows import summarize
from ampatch.runs.runner import LevelRun
from ampatch.runs.deviation import deviation, initial_backoffs


def _curve(n: int, start: float = 10.0) -> list[float]:
    """A steeply falling loss curve, as at the start of training."""
    return [start * 0.8 ** i + 1.0 for i in range(n)]


def test_initial_backoffs_are_the_leading_streak_of_skipped_steps():
    assert initial_backoffs([]) == 0 and initial_backoffs([0, 1, 2, 7]) == 3 and initial_backoffs([1, 2]) == 0


def test_a_skipped_first_step_does_not_inflate_the_deviation():
    """A float16 run whose first step the loss scaler skipped: it is the O0 curve, one update late."""
    o0 = _curve(40)
    half = [o0[0]] + o0[:39]           # step 0 skipped: step s has made s - 1 updates
    unshifted = max(abs(a - b) / b for a, b in zip(half, o0))
    assert unshifted > 0.1                                               # what compare used to show
    assert deviation(dict(enumerate(half)), dict(enumerate(o0)), skipped=[0]) == pytest.approx(0, abs=1e-12)


def test_a_later_skipped_step_is_not_shifted_and_a_nan_is_infinite():
    o0 = _curve(20)
    assert deviation(dict(enumerate(o0)), dict(enumerate(o0)), skipped=[5]) == 0
    assert deviation({0: 1.0, 1: math.nan}, {0: 1.0, 1: 1.0}) == math.inf
    assert deviation({0: 1.0}, {}) is None


def test_the_deviation_is_relative_and_smoothed():
    ref = {i: 2.0 for i in range(10)}
    assert deviation({i: 2.02 for i in range(10)}, ref) == pytest.approx(0.01)
    noisy = {i: 2.0 + (0.1 if i == 5 else 0.0) for i in range(10)}      # one noisy batch, 5-step means
    assert deviation(noisy, ref) == pytest.approx(0.01)


def test_compare_rows_use_it():
    o0 = _curve(30)
    runs = [LevelRun("O0", True, None, 0, 1.0, report({"opt_level": "O0", "losses": o0})),
            LevelRun("O1", True, None, 0, 1.0, report({"opt_level": "O1", "losses": [o0[0]] + o0[:29],
                                                       "skipped_steps": [0]}))]
    _, o1 = summarize(runs)
    assert o1.max_loss_dev_vs_O0 == pytest.approx(0, abs=1e-12)


def test_thinned_curves_compare_after_an_odd_number_of_backoffs():
    """A long run keeps every 2nd loss; one skipped first step shifts the run by one update,
    which no recorded step of the reference matches exactly: each step is compared with the
    reference shifted by whole strides, not dropped (the deviation was None)."""
    o0 = [2.0 - 1e-4 * i for i in range(4000)]      # a long run, late in training
    half = [o0[0]] + o0[:3999]
    thin = lambda c: {s: c[s] for s in range(0, len(c), 2)}  # noqa: E731
    dev = deviation(thin(half), thin(o0), skipped=[0])
    assert dev is not None and dev < 1e-3
