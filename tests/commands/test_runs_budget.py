"""`ampatch.runs.budget`: each level's share of the time, and its step cap."""

from __future__ import annotations

import dataclasses

import pytest

from ampatch.machine import hardware
from ampatch.runs import budget as budget_module
from ampatch.runs.budget import MARGIN, SLOW_HALF_WEIGHT, TARGET_STEPS, Budget, step_weights

LEVELS = ["O0", "O1", "O2", "O3", "O4", "O5"]


def test_budget_shares_the_time_left_and_caps_steps() -> None:
    now = [1000.0]
    budget = Budget(120, 150, clock=lambda: now[0])                # start-up 4 s and exit 1 s assumed
    assert budget.next_run(LEVELS, []) == (150, 1000 + 5 + 90 / 6 - 1)   # equal weights: equal shares
    now[0] = 1010.0                                                # the first level ended early
    budget.ran(3.0, 2.5)                                           # it started faster, exited slower
    assert budget.next_run(LEVELS[1:], [88]) == (88, 1010 + 5.5 + (110 - 5 * 5.5) / 5 - 2.5)
    budget.ran(None, 0.5)                                          # the slowest exit seen counts
    now[0] = 1200.0                                                # over budget: start-up and exit only
    assert budget.next_run(LEVELS[5:], [88, 40]) == (40, 1200 + 3.0)

    weighted = Budget(120, 150, weights={lv: 3.0 for lv in LEVELS[1:]}, clock=lambda: 1000.0)
    cap, deadline = weighted.next_run(LEVELS, [])                  # O0's steps are 3x cheaper
    assert deadline == 1000 + 5 + 90 * 1 / 16 - 1
    assert weighted.next_run(LEVELS[1:], [])[1] == 1000 + 5 + (120 - 25) * 3 / 15 - 1


def test_weights_in_seconds_cap_every_level_at_the_steps_all_can_run() -> None:
    """Measured weights (seconds): the first level already stops where the last one must,
    instead of spending time the later, slower levels need."""
    now = [1000.0]
    seconds = {"O0": 0.02, "O1": 0.2, "O2": 0.2}
    budget = Budget(60, 150, weights=seconds, scale=1.0, clock=lambda: now[0])
    spare = 60 - 3 * 5
    cap, _ = budget.next_run(["O0", "O1", "O2"], [])
    assert cap == int(spare / 0.42) == 107
    now[0] = 1005.0 + 107 * 0.02
    budget.ran(4.0, 1.0, "O0", 0.04)                               # the machine got twice as slow
    assert budget.scale == pytest.approx(2.0)
    cap, _ = budget.next_run(["O1", "O2"], [107])
    assert cap == int((60 - (now[0] - 1000) - 2 * 5) / (2.0 * 0.4))
    budget.ran(None, None, "O1", None)                             # a run without steps teaches nothing
    assert budget.scale == pytest.approx(2.0)
    now[0] = 1100.0                                                # out of time: the deadline will stop it
    assert budget.next_run(["O2"], [50]) == (TARGET_STEPS, 1100.0 + 4.0)
    short = Budget(60, 10, weights=seconds, scale=1.0, clock=lambda: 2000.0)
    assert short.next_run(["O2"], [])[0] == 10                     # never more than asked for


def test_a_level_may_use_what_the_later_ones_do_not_need_for_the_target() -> None:
    """Plenty of time: each level is capped at the equal plan, and its deadline only keeps
    the target's steps, with the margin, (and start-up and exit) for every later level."""
    budget = Budget(40, 150, weights={"O0": 0.01, "O1": 0.1, "O2": 0.1}, scale=1.0, clock=lambda: 1000.0)
    cap, deadline = budget.next_run(["O0", "O1", "O2"], [])
    assert cap == int((40 - 15) / 0.21) == 119                       # the equal plan
    assert deadline == 1000 + 40 - 2 * (5 + TARGET_STEPS * MARGIN * 0.1) - 1  # far more than O0's 1.2 s


def test_progress_keeps_the_time_of_the_first_step() -> None:
    """A run's start-up is launch to first step, also after the speed window slid past it."""
    import io

    from ampatch.runs.progress import SPEED_WINDOW, Progress
    p = Progress("O1", stream=io.StringIO())
    p.update(1, 1.0)
    first = p.start_s()
    for step in range(2, SPEED_WINDOW + 10):
        p.update(step, 1.0)
    assert p.start_s() == first and p.seen[0][1] > 1


def test_levels_aim_for_the_target_when_the_plan_affords_fewer() -> None:
    """A plan of 20 steps each still lets a level run the target's 30 if it is faster than
    expected (its deadline, the share of 20 steps, stops it otherwise)."""
    budget = Budget(60, 150, weights={"O0": 0.5, "O1": 0.5}, scale=1.0, clock=lambda: 1000.0)
    cap, deadline = budget.next_run(["O0", "O1"], [])
    assert int((60 - 2 * 5) / 1.0) == 50 and cap == 50
    slow = Budget(30, 150, weights={"O0": 0.5, "O1": 0.5}, scale=1.0, clock=lambda: 1000.0)
    cap, deadline = slow.next_run(["O0", "O1"], [])
    assert cap == TARGET_STEPS and deadline == 1000 + 5 + (30 - 10) / 2 - 1    # 20 steps' share


def test_an_unknown_scale_is_learnt_from_the_first_run() -> None:
    budget = Budget(30, 150, weights={"O1": 3.0}, clock=lambda: 1000.0)
    assert budget.next_run(["O0", "O1"], [])[0] == 150             # nothing known yet: the step cap
    budget.ran(4.0, 1.0, "O0", 0.1)
    assert budget.scale == pytest.approx(0.1)
    assert budget.next_run(["O1"], [150])[0] == int((30 - 5) / 0.3) == 83


def test_step_weights_follow_the_hardware(monkeypatch: pytest.MonkeyPatch) -> None:
    info = hardware.describe("cpu")
    slow = dataclasses.replace(info, native={"bfloat16": False, "float16": False})
    monkeypatch.setattr(hardware, "describe", lambda device: slow)
    assert step_weights("cpu", ["O0", "O1", "O5"], None) == {"O1": SLOW_HALF_WEIGHT, "O5": SLOW_HALF_WEIGHT}
    fast = dataclasses.replace(info, native={"bfloat16": True, "float16": False})
    monkeypatch.setattr(hardware, "describe", lambda device: fast)
    assert step_weights("cpu", ["O0", "O2", "O4"], None) == {"O2": 1.0, "O4": 1.0}
    assert step_weights("cpu", ["O2", "O4"], "float16") == {"O2": SLOW_HALF_WEIGHT, "O4": 1.0}
    assert budget_module.half_dtypes("cpu", ["O0", "O2", "O4"], "float16") == {"O2": "float16", "O4": "bfloat16"}
