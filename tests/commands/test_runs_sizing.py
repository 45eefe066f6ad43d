"""`ampatch.runs.sizing` and `builtin`: the built-in workload's size, from a calibration."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from ampatch.runs import builtin, sizing
from ampatch.runs.budget import EXIT_S
from ampatch.runs.runner import Finished

LEVELS = ["O0", "O1", "O2"]


def measured(size: str, fp32: float, half: float, build: float = 0.5, first: float = 0.1) -> dict:
    return {"size": size, "dims": f"dims of {size}", "round_s": fp32 + 2 * half,
            "step": {"float32": fp32, "bfloat16": half}, "first": {"float32": first, "bfloat16": first},
            "build": {"float32": build, "bfloat16": 0.01}}


CALIBRATION = {"workload": "lm", "kinds": {"O0": "float32", "O1": "bfloat16", "O2": "bfloat16"},
               "sizes": [measured("tiny", 0.01, 0.1), measured("small", 0.02, 0.4), measured("medium", 0.05, 1.6)],
               "busy_s": 3.0}


def goal(seconds: float, steps: int, budgeted: bool) -> sizing.Goal:
    return sizing.Goal(tuple(LEVELS), seconds, steps, budgeted)


def steps_at(m: dict, seconds: float, overhead: float) -> float:
    start = overhead + 0.5 + 0.1
    return (seconds - 3 * (start + EXIT_S)) / (m["step"]["float32"] + 2 * m["step"]["bfloat16"])


def test_the_largest_size_where_every_level_runs_its_steps() -> None:
    # small: (100 - 3 * 3.6) / 0.82 = 108 steps >= 30 * MARGIN; medium: 27 steps, too few
    choice = sizing.choose(CALIBRATION, goal(100.0, 150, True), overhead_s=2.0)
    assert choice.size == "small" and choice.dims == "dims of small"
    assert choice.reason == "chosen so that every level runs >= 30 steps in the budget"
    assert choice.describe() == "size small (dims of small), chosen so that every level runs >= 30 steps in the budget"
    assert choice.weights == {"O0": 0.02, "O1": 0.4, "O2": 0.4}     # seconds per step, for the budget
    assert choice.start_s == pytest.approx(2.0 + 0.5 + 0.1)
    assert choice.calibration["chosen"] == "small"
    assert choice.calibration["predicted_steps"] == pytest.approx(steps_at(CALIBRATION["sizes"][1], 100, 2))
    assert sizing.choose(CALIBRATION, goal(1000.0, 150, True), 2.0).size == "medium"


def test_the_smallest_size_when_none_fits() -> None:
    choice = sizing.choose(CALIBRATION, goal(15.0, 150, True), overhead_s=2.0)
    assert choice.size == "tiny" and "the smallest size (the calibration expected fewer than 30 steps" in choice.reason


def test_without_a_budget_every_level_runs_all_its_steps_in_about_the_default_time() -> None:
    choice = sizing.choose(CALIBRATION, goal(120.0, 150, False), overhead_s=2.0)
    assert choice.size == "tiny" and choice.reason == "chosen so that every level runs its 150 steps in about 120s"
    assert sizing.choose(CALIBRATION, goal(120.0, 50, False), overhead_s=2.0).size == "small"
    assert sizing.choose(CALIBRATION, goal(120.0, 10, False), overhead_s=2.0).size == "medium"


def test_a_failed_calibration_falls_back_to_the_smallest_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sizing, "run_child",
                        lambda cmd, env, launch: Finished(1, 0.5, "Traceback\nRuntimeError: boom\n"))
    log = io.StringIO()
    choice = sizing.calibrate("lm", "cpu", 1, None, goal(120.0, 150, True), log)
    assert choice.size == "tiny" and choice.reason == "calibration failed: RuntimeError: boom"
    assert choice.weights == {} and choice.start_s is None
    assert "calibrating: timing float32 and bfloat16 steps of lm" in log.getvalue()
    assert "calibration failed after" in log.getvalue()


def test_calibration_measures_from_the_smallest_size_up(tmp_path: Path) -> None:
    """The real child, told that no round can fit: it measures the smallest size only."""
    import subprocess
    out = tmp_path / "cal.json"
    proc = subprocess.run([sys.executable, "-m", "ampatch.workloads.calibrate", "lstm", "--levels", "O0,O2,O4",
                           "--device", "cpu", "--threads", "1", "--stop-above", "0", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["kinds"] == {"O0": "float32", "O2": "bfloat16", "O4": "bfloat16"}
    (tiny,) = data["sizes"]
    assert tiny["size"] == "tiny" and set(tiny["step"]) == {"float32", "bfloat16"}
    assert all(v > 0 for key in ("step", "first", "build") for v in tiny[key].values())
    assert tiny["round_s"] == pytest.approx(tiny["step"]["float32"] + 2 * tiny["step"]["bfloat16"])
    assert data["busy_s"] > 0


def test_a_given_size_and_the_plan_it_makes() -> None:
    log = io.StringIO()
    plan = builtin.plan("cnn", levels=["O0", "O5"], half_dtype=None, steps=40, seconds=60.0, device="cpu", threads=1,
                        size="small", log=log)
    assert log.getvalue() == ""                               # no calibration
    assert plan.size.describe() == "size small (channels 16/32/64, 16x16 images, batch 32), from --size"
    assert plan.budget is not None and plan.budget.scale is None and plan.budget.max_steps == 40
    cmd = plan.commands(["O0", "O5"])["O5"](12, 1234.5)
    assert cmd[1:3] == ["-m", "ampatch.workloads.cnn"] and cmd[cmd.index("--size") + 1] == "small"
    assert cmd[-6:] == ["--opt-level", "O5", "--steps", "12", "--deadline", "1234.500"]
    title = plan.title(12).splitlines()
    assert title == ["ampatch compare: workload cnn (cpu, 1 torch thread), up to 40 steps in a 60s budget "
                     "(losses compared over the first 12 steps)", plan.size.describe()]
    assert plan.header()["size"] == "small" and "few" not in " ".join(plan.notes(25))
    assert "left time for only 12 steps" in plan.notes(12)[0]
    fixed = builtin.plan("lm", levels=["O0"], half_dtype=None, steps=5, seconds=None, device="cpu", threads=0,
                         size="tiny", log=log)
    assert fixed.budget is None and fixed.title(None).startswith("ampatch compare: workload lm (cpu), 5 steps\n")
