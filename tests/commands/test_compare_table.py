"""`ampatch.compare.table`: the text table, the machine line and the JSON."""

from __future__ import annotations

import json
from pathlib import Path

from _reports import report

from ampatch.compare.table import format_table, machine_of, write_json
from ampatch.runs.runner import LevelRun
from ampatch.runs.stats import summarize

DEVICE = {"type": "cpu", "name": "Old CPU", "cores": 2, "features": ["avx2"], "lacks": ["avx512_bf16"],
          "native": {"bfloat16": False, "float16": False}, "basis": {"bfloat16": "no AVX512-BF16 or AMX"},
          "torch": "2.13.0+cpu"}





def rows_of(device: dict) -> list:
    rep = {"opt_level": "O4", "half_dtype": "bfloat16", "losses": [1.0, 0.5], "device": device,
           "step_times_s": [0.01], "skipped_steps": [3, 4], "loss_scale": {"loss_scaler0": 32768.0}, "steps": 2}
    return summarize([LevelRun("O0", True, None, 0, 1.0, report(dict(rep, opt_level="O0"))),
                      LevelRun("O4", True, None, 0, 1.0, report(rep)),
                      LevelRun("O2", False, "RuntimeError: boom", 1, 1.0, None)])


def test_table_lines_cells_and_footnotes() -> None:
    table = format_table(rows_of(DEVICE), "title\nsecond line", "the machine", ["a note", ""]).splitlines()
    assert table[:3] == ["title", "second line", "machine: the machine"]
    assert table[3].split("  ")[0] == "level" and table[3].endswith("steps")
    o4 = table[5].split()
    assert o4[:2] == ["O4", "bfloat16"] and o4[3] == "1.00x" and o4[-3:] == ["2", "32768", "2"]
    assert table[6] == "O2     FAILED: RuntimeError: boom"
    assert "first loss" in table[3] and o4[6:8] == ["1.0000", "0.7500"]  # first step's loss, then the last ones' mean
    assert "B/param" in table[3] and o4[5] == "-"  # a hand-made report trained no parameter
    assert any(line.startswith("first loss: the first step's; final loss: mean of the last 5") for line in table)
    assert table[-1] == "a note"                        # empty notes are left out


def test_table_says_which_machine_and_when_half_is_emulated() -> None:
    rows = rows_of(DEVICE)
    machine, note = machine_of(rows)
    assert machine.startswith("cpu: Old CPU, 2 cores") and "torch 2.13.0+cpu" in machine
    assert "bfloat16 not native" in machine and note.startswith("note: bfloat16 is emulated")
    table = format_table(rows, "title", machine, [note])
    assert "note: bfloat16 is emulated" in table
    assert machine_of(rows_of(dict(DEVICE, native={"bfloat16": True, "float16": True})))[1] is None


def test_machine_line_without_reports_describes_this_machine() -> None:
    machine, _ = machine_of(summarize([LevelRun("O1", False, "x", 1, 0.1, None)]), "cpu")
    assert machine.startswith("cpu: ")


def test_json_has_the_header_and_every_row(tmp_path: Path) -> None:
    path = tmp_path / "out.json"
    write_json(str(path), {"workload": "lm"}, rows_of(DEVICE))
    data = json.loads(path.read_text())
    assert data["workload"] == "lm" and [r["level"] for r in data["rows"]] == ["O0", "O4", "O2"]
    assert data["rows"][1]["skipped_steps"] == [3, 4] and data["rows"][2]["error"] == "RuntimeError: boom"


def test_the_deviation_footnote_says_what_the_column_is_relative_to() -> None:
    """The "max dev vs O0" column is the measure tune judges by: relative to what O0 learns over
    the run, or to its level when its loss does not fall; the footnote says which, with O0's figures."""
    falling = [3.0 - 0.1 * i for i in range(10)]
    flat = [2.0] * 10

    def table(o0: list[float]) -> str:
        rep = {"opt_level": "O0", "losses": o0, "step_times_s": [0.01], "steps": 10}
        return format_table(summarize([LevelRun("O0", True, None, 0, 1.0, report(rep)),
                                       LevelRun("O1", True, None, 0, 1.0, report(dict(rep, opt_level="O1")))]), "t")
    assert "relative to O0's progress (its loss falls 0.5 over the run, from 2.8 to 2.3" in table(falling)
    assert "relative to O0's loss level at each step (no detectable progress: its loss does not fall" in table(flat)
