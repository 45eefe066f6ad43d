"""The planted fine-tuning case (examples/finetune_stall.py): AdamW at lr 2e-5 from a
pretrained-scale start, where pure-bfloat16 weights (O3) stall. `tune`, called from Python,
rejects O3 with a reason that names the stall and qualifies O2/O5 (and O3 repaired with FP32
masters); `diagnose --opt-level O3` names the stalled modules, recommends masters and shows
the rerun following O0. Real child processes: slow."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ampatch.config.policy_file import load
from ampatch.diagnose.command import Request, diagnose
from ampatch.diagnose.render import render
from ampatch.runs.deviation import MIN_SHARE
from ampatch.tune import TuneResult, tune

pytestmark = pytest.mark.slow
EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "finetune_stall.py")


def test_tune_from_python_rejects_the_stalled_level_and_qualifies_the_ones_with_masters(tmp_path):
    out = tmp_path / "policy.json"
    result = tune(["python", EXAMPLE], levels=["O2", "O3", "O5"], half_dtype="bfloat16", steps=40, rounds=0,
                  budget=None, out=str(out), log=open(tmp_path / "log.txt", "w"))
    assert isinstance(result, TuneResult) and result.out == str(out)
    by_label = {m.candidate.label: m for m in result.search.candidates}
    o3 = by_label["O3 bfloat16"]
    assert not o3.qualifies and o3.finite and o3.learned < MIN_SHARE
    assert "learns" in o3.reason and "stalled updates" in o3.reason, o3.reason
    assert o3.deviation > 0.5                        # relative to what O0 learns: it learned nearly none of it
    assert by_label["O2 bfloat16"].qualifies and by_label["O5 bfloat16"].qualifies
    repaired = by_label["O3 bfloat16, master_weights=True"]
    assert repaired.qualifies and repaired.candidate.repairs == "O3 bfloat16"
    assert result.chosen != o3.candidate
    assert load(out).opt_level == result.chosen.opt_level
    data = result.to_dict()
    assert data["deviation"]["basis"] == "progress" and data["deviation"]["o0_progress"] > 0
    # O0's progress beyond its own noise, measured from its curve (no same-seed rerun: on a CPU it measures nothing)
    assert data["deviation"]["o0_significance"] >= data["deviation"]["o0_needed"] > 0
    assert "same batches" in data["deviation"]["noise_measured_by"] and "noise_floor" not in data["deviation"]
    assert "O0 again" not in (tmp_path / "log.txt").read_text()
    cands = {(c["opt_level"], c["master_weights"]): c for c in data["candidates"]}
    assert cands[("O3", None)]["learned"] < MIN_SHARE and cands[("O3", True)]["qualifies"]
    json.dumps(data)
    assert "learns" in result.render() and "relative to O0's progress" in result.render()


def test_diagnose_names_the_stalled_modules_recommends_masters_and_verifies_them(tmp_path):
    log = open(tmp_path / "log.txt", "w")
    found = diagnose(Request([sys.executable, EXAMPLE], "O3", None, steps=40), log)
    stall = found.stall
    assert stall is not None and stall.finding and stall.unchanged > 0.9 and stall.held_in == "bfloat16"
    assert {m.name for m in stall.modules} >= {"fc1", "fc2", "head"}
    rec = found.recommendation
    assert rec.settings.master_weights is True and rec.keep_fp32 == ()
    note = next(n for n in rec.notes if n.startswith("stalled updates"))
    assert "fc2: 9" in note and "no FP32 master copy (O3)" in note and "O2/O5" in note
    v = found.verification
    assert v is not None and v.o0_progress is not None
    assert v.without.follows_O0 is False and v.without.learned_vs_O0 < MIN_SHARE      # O3: learns (almost) nothing
    assert v.verified.follows_O0 is True and v.verified.learned_vs_O0 > 0.9          # with masters: follows O0
    assert v.verified.settings.master_weights is True
    text = render(found, "python examples/finetune_stall.py", "ampatch run --opt-level O3 {options}-- python x.py")
    assert "stalled updates: " in text and "recommendation: master_weights=True" in text
    assert "ampatch run --opt-level O3 --master-weights True -- python x.py" in text
    data = found.to_dict()
    assert data["recommendation"]["settings"] == {"master_weights": True} and data["verification"]["follows_O0"]
