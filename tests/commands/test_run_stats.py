"""`ampatch.runs.stats`: the statistics of each level, from hand-made reports."""

from __future__ import annotations

import dataclasses
import math

import pytest
from _reports import REQUIRED, report

from ampatch.runs.runner import LevelRun
from ampatch.runs.stats import RunStats, common_steps, summarize
from ampatch.session.report import Report


def run(level: str, fields: dict | None, ok: bool = True, error: str | None = None) -> LevelRun:
    return LevelRun(level, ok, error, 0 if ok else 1, 1.0, None if fields is None else report(fields))


BASE = {"opt_level": "O0", "losses": [3.0, 2.0, 1.0], "step_times_s": [0.5, 0.2, 0.2, 0.2, 0.2],
        "peak_memory_bytes": 2**30, "loss_scale": {"loss_scaler0": 1.0}}


def test_statistics_of_hand_made_reports() -> None:
    half = dict(BASE, opt_level="O1", half_dtype="bfloat16", losses=[3.0, 2.5, float("nan")],
                step_times_s=[0.5, 0.1, 0.1, 0.1, 0.1], skipped_steps=[1], loss_scale={"loss_scaler0": 32768.0})
    o0, o1, o2 = summarize([run("O0", dict(BASE, half_dtype="bfloat16")), run("O1", half),
                            run("O2", None, ok=False, error="boom")])
    assert o0.median_step_ms == pytest.approx(200) and o1.speedup_vs_O0 == pytest.approx(2)
    assert o0.speedup_vs_O0 == 1.0 and o0.max_loss_dev_vs_O0 == 0.0
    assert o0.peak_memory_mib == 1024 and o0.final_loss == pytest.approx(2.0)
    assert o0.half_dtype is None and o1.half_dtype == "bfloat16"    # O0 has none, whatever its report says
    assert o1.max_loss_dev_vs_O0 == math.inf           # a NaN loss is an infinite deviation
    assert o1.skipped_steps == [1] and o1.final_loss_scale == 32768.0
    assert not o2.ok and o2.error == "boom" and o2.median_step_ms is None and o2.losses == []


def test_rows_are_values_and_the_runs_stay_as_they_were() -> None:
    runs = [run("O0", dict(BASE)), run("O1", dict(BASE, opt_level="O1"))]
    before = [dataclasses.asdict(r) for r in runs]
    rows = summarize(runs)
    assert [dataclasses.asdict(r) for r in runs] == before
    with pytest.raises(dataclasses.FrozenInstanceError):
        rows[0].final_loss = 0.0  # type: ignore[misc]
    data = rows[1].to_dict()
    assert list(data)[:6] == ["level", "ok", "error", "returncode", "wall_s", "report"]
    assert data["speedup_vs_O0"] == 1.0 and data["losses"] == [3.0, 2.0, 1.0]


def test_without_an_O0_run_nothing_is_compared() -> None:
    (o1,) = summarize([run("O1", dict(BASE, opt_level="O1"))])
    assert o1.speedup_vs_O0 is None and o1.max_loss_dev_vs_O0 is None and o1.final_loss == pytest.approx(2.0)


def test_levels_compare_at_the_steps_all_of_them_ran() -> None:
    base = {"opt_level": "O0", "steps": 6, "losses": [6.0, 5.0, 4.0, 3.0, 2.0, 1.0], "step_times_s": [0.1] * 5}
    half = dict(base, opt_level="O5", steps=3, losses=[6.0, 5.5, 4.5])
    runs = [run("O0", base), run("O5", half)]
    assert common_steps(runs) == 3
    o0, o5 = summarize(runs, upto=3)
    assert o0.final_loss == pytest.approx(5.0) and o5.final_loss == pytest.approx(16 / 3)
    # of the running means, relative to what O0 learns over the 3 steps compared (6 -> 4), not over its 6
    assert o5.max_loss_dev_vs_O0 == pytest.approx((16 / 3 - 5.0) / (6.0 - 4.0))
    assert (o0.steps, o5.steps) == (6, 3) and len(o0.losses) == 6   # the curves stay whole


def test_losses_compare_at_the_same_step_when_one_curve_was_thinned() -> None:
    """A long run's report keeps every other loss once its curve is full (losses_every=2):
    its losses[i] is step 2i, compared with the other run's loss at step 2i, not at step i."""
    base = {"opt_level": "O0", "steps": 7, "losses": [10.0, 8.0, 6.0, 4.0], "losses_every": 2}
    half = {"opt_level": "O1", "steps": 7, "losses": [10.0, 9.0, 8.0, 7.0, 6.0, 5.0, 4.0]}
    runs = [run("O0", base), run("O1", half)]
    assert common_steps(runs) == 7
    o0, o1 = summarize(runs, upto=common_steps(runs))
    assert o1.max_loss_dev_vs_O0 == 0            # same curve, compared at steps 0, 2, 4, 6
    assert o0.final_loss == pytest.approx(7.0) and o1.final_loss == pytest.approx(6.0)
    o0, o1 = summarize(runs, upto=5)              # steps 0-4 only
    assert o1.final_loss == pytest.approx(8.0) and o0.final_loss == pytest.approx(8.0)


def test_common_steps_ignores_failed_runs() -> None:
    assert common_steps([run("O1", None, ok=False, error="x")]) is None
    assert common_steps([run("O0", {"losses": [1.0] * 4}), run("O1", {"losses": [1.0]}, ok=False)]) == 4


def test_a_row_from_a_run_alone() -> None:
    row = RunStats.of(run("O0", BASE))
    assert row.speedup_vs_O0 is None and row.steps == 0 and row.losses_every == 1
    assert RunStats.of(run("O1", None, ok=False, error="x")).steps is None    # no report, no figures


def test_a_report_reads_back_from_its_dict_and_refuses_what_it_cannot_read() -> None:
    """`Report.from_dict` is the one reading of a child's report: fields with a default may be
    missing (an older report), anything else it cannot vouch for is refused with its name."""
    full = report({"losses": [1.0], "device": {"type": "cpu", "name": "a CPU", "native": {"bfloat16": True},
                                                "half_dtype": "bfloat16"}})
    assert full.device.half_native is True and full.device.info.name == "a CPU"   # typed, not a dict
    assert Report.from_dict(full.to_dict()) == full
    assert report({}).losses == [] and report({}).losses_every == 1
    for bad, match in [({**REQUIRED, "steps": "3"}, "'steps' is a str, not int"),
                       ({**REQUIRED, "losses": {}}, "'losses' is a dict"),
                       ({**REQUIRED, "surprise": 1}, "unknown report field.*'surprise'"),
                       ({k: v for k, v in REQUIRED.items() if k != "time_s"}, "lacks 'time_s'"),
                       ({**REQUIRED, "device": {"type": "cpu"}}, "'device': .*needs type and name"),
                       ({**REQUIRED, "device": {"type": "cpu", "name": "x", "half_dtype": "int8"}}, "'device': .*int8"),
                       ({**REQUIRED, "device": [1]}, "'device' is a list")]:
        with pytest.raises(ValueError, match=match):
            Report.from_dict(bad)
    with pytest.raises(ValueError, match="JSON object, not list"):
        Report.from_dict([])  # type: ignore[arg-type]
