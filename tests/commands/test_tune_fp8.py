"""`ampatch tune`'s FP8 candidates: `--levels O5+fp8` tries each torchao recipe (and
`O5+fp8:rowwise` one), judged by the same learning test as every level; a failing one is
repaired without the layers diagnose finds FP8 hurts; where FP8 is only emulated a candidate is
listed with its fidelity but never chosen (nor re-timed) for speed, and the table says why;
where it runs on tensor cores it is timed and chosen like the rest, and O5's recipes are tried
by default."""
from __future__ import annotations

import importlib.util
import io
import json
from pathlib import Path

import pytest
from _cli import ampatch_main
from _reports import report

from ampatch.config import levels
from ampatch.runs.runner import LevelRun
from ampatch.runs.stats import RunStats
from ampatch.runs.verdict import Rule, judge
from ampatch.tune import fp8, repair
from ampatch.tune.candidates import REFERENCE, Candidate
from ampatch.tune.measure import Job, Measured
from ampatch.tune.report import render, to_json
from ampatch.tune.search import Search

ROOT = Path(__file__).resolve().parents[2]
O0_LOSSES = [3.0 - 0.1 * i for i in range(10)]


@pytest.fixture
def in_process(capfd: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch):
    """``ampatch ARGS`` through `cli.main` in this process, what ``python -m ampatch`` runs, with its
    runs as child processes and no AMPATCH_* inherited (tests/_cli.py)."""
    return lambda *args, cwd=None: ampatch_main(capfd, monkeypatch, *args, cwd=cwd)


def test_the_fp8_candidates_of_each_level_string():
    plain, variants = fp8.split(["O1", "o5+fp8", "O4+fp8:rowwise", "O2+fp8:tensorwise", "O5+kahan"])
    assert plain == ["O1"]
    assert [v.label for v in variants] == ["O5+fp8", "O4+fp8:rowwise", "O2+fp8:tensorwise", "O5+kahan"]
    got = fp8.candidates(variants, "cpu", None)
    assert [(c.opt_level, c.half_dtype, c.fp8, c.master_weights) for c in got] == [
        ("O5", "bfloat16", "tensorwise", None), ("O5", "bfloat16", "rowwise", None),
        ("O5", "bfloat16", "rowwise_with_gw_hp", None), ("O4", "bfloat16", "rowwise", None),
        ("O2", "bfloat16", "tensorwise", None), ("O5", "bfloat16", None, "kahan")]
    with pytest.raises(ValueError, match=r"O2\+fp8: fp8='tensorwise' runs where the layers compute in bfloat16 or "
                                         r"FP32 .* O2 here computes in float16"):
        fp8.candidates(fp8.split(["O2+fp8"])[1], "cpu", "float16")


def test_o5s_recipes_are_tried_by_default_only_where_fp8_runs_on_tensor_cores(monkeypatch):
    assert fp8.by_default(["O1", "O5"], "cpu") == []                 # every CPU only emulates
    monkeypatch.setattr(fp8, "has_fp8_kernels", lambda device: True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    assert [c.fp8 for c in fp8.by_default(["O1", "O5"], "cuda")] == ["tensorwise", "rowwise", "rowwise_with_gw_hp"]
    assert fp8.by_default(["O1", "O4"], "cuda") == []                 # O5 not tried: none


def test_a_candidate_without_the_layers_fp8_hurts():
    c = Candidate("O5", "bfloat16", fp8="tensorwise")
    fixed = c.repaired([], None, None, ["embed"], ["hidden.0", "hidden.1"])
    assert fixed.label == "O5 bfloat16, fp8='tensorwise' without ['embed']" and fixed.repairs == c.label
    pol = fixed.policy()
    assert pol.fp8 == "tensorwise" and pol.fp8_modules == ("hidden.0", "hidden.1")
    assert Candidate("O5", "bfloat16").simplicity() < c.simplicity() < fixed.simplicity()


def _measured(c: Candidate, base: RunStats, emulated: bool) -> Measured:
    fields = {"opt_level": c.opt_level, "losses": O0_LOSSES, "step_times_s": [0.1] * 5}
    if c.fp8:
        fields.update(fp8=c.fp8, fp8_emulated=emulated)
    row = RunStats.of(LevelRun(c.opt_level, True, None, 0, 1.0, report(fields)), base)
    v = judge(row, Rule(0.02), base.reference())
    return Measured(c, row, v.qualifies, v.reason, v.finite, v.deviation, learned=v.learned, noise=v.noise)


def _search(emulated: bool) -> tuple[Search, Candidate, Candidate]:
    s = Search(Job(lambda n: [], 1), [], 0.02, None, io.StringIO())
    base = RunStats.of(LevelRun("O0", True, None, 0, 1.0, report({"opt_level": "O0", "losses": O0_LOSSES,
                                                                      "step_times_s": [0.1] * 5})))
    s.result.reference = Measured(REFERENCE, base, True, "reference", True, 0.0)
    o5, o5fp8 = Candidate("O5", "bfloat16"), Candidate("O5", "bfloat16", fp8="tensorwise")
    s.result.candidates += [_measured(o5, base, emulated), _measured(o5fp8, base, emulated)]
    s.result.timings = {REFERENCE.label: [100.0, 101.0], o5.label: [80.0, 81.0], o5fp8.label: [50.0, 51.0]}
    s.retimed = [o5, o5fp8]
    return s, o5, o5fp8


def test_an_emulated_fp8_candidate_is_never_chosen_for_speed_and_the_table_says_why():
    s, o5, o5fp8 = _search(emulated=True)
    assert s.result.candidates[1].emulated and s.result.candidates[1].qualifies
    s.choose()
    assert s.result.chosen == o5                                    # the emulated one "ran faster": not chosen
    text = render(s.result, "title", None, "")
    assert "note: O5 bfloat16, fp8='tensorwise': trained like FP32, but on FP8 emulated by torchao here" in text
    assert "never chosen for speed" in text
    data = to_json(s.result)
    assert data["candidates"][1]["fp8"] == "tensorwise" and data["candidates"][1]["fp8_emulated"] is True


def test_on_fp8_tensor_cores_an_fp8_candidate_is_timed_and_chosen_like_the_rest():
    s, o5, o5fp8 = _search(emulated=False)
    s.choose()
    assert s.result.chosen == o5fp8 and s.result.why.startswith("the fastest policy that trains like FP32 (1.99x")
    assert to_json(s.result)["chosen"]["fp8"] == "tensorwise"


def test_the_memory_objective_is_not_decided_by_an_emulated_fp8_candidate():
    s, o5, o5fp8 = _search(emulated=True)
    s.objective = s.result.objective = "memory"
    s.choose()
    assert s.result.chosen != o5fp8


def test_a_failing_fp8_candidate_is_repaired_without_the_layers_fp8_hurts(monkeypatch):
    from test_diagnose_fp8 import record  # the synthetic FP8 records of diagnose's tests

    from ampatch.diagnose.analysis import diagnosis
    from ampatch.record.records import Recording, StepRecord
    rec = Recording("O5", "bfloat16", 1.0, "fp32", [], [], True, 2, [StepRecord(i, 2.0, True, 1.0, False)
                                                                      for i in range(2)], [], [],
                    [record("embed", 0.04, 1.0, flushed=0.58), *(record(f"h{i}", 0.035, 0.05) for i in range(3))])
    monkeypatch.setattr(repair, "_record", lambda c, job, log: diagnosis(rec))
    c = Candidate("O5", "bfloat16", fp8="tensorwise")
    s = repair.suggest(c, Job(lambda n: [], 1), None)
    assert s.candidate == c.repaired([], None, None, ["embed"], ["h0", "h1", "h2"])
    assert s.why.startswith("fp8: embed (Linear, tensorwise): 58% of the non-zero values")
    plain = repair.suggest(Candidate("O5", "bfloat16"), Job(lambda n: [], 1), None)
    assert plain.candidate is None                                  # not an FP8 candidate: nothing to leave out
    every = Recording("O5", "bfloat16", 1.0, "fp32", [], [], True, 2, rec.steps, [], [],
                      [record(f"h{i}", 0.04, 0.05, flushed=0.5) for i in range(2)])
    monkeypatch.setattr(repair, "_record", lambda c, job, log: diagnosis(every))
    assert "FP8 hurts every layer it ran" in repair.suggest(c, Job(lambda n: [], 1), None).why


def test_tune_tries_fp8_repairs_the_planted_case_and_chooses_no_emulated_run(tmp_path, in_process):
    pytest.importorskip("torchao")
    out, js = tmp_path / "p.json", tmp_path / "t.json"
    done = in_process("tune", "--levels", "O5+fp8:tensorwise", "--steps", "30", "--rounds", "1", "--out", str(out),
                      "--json", str(js), "--", "python", str(ROOT / "examples" / "fp8_outliers.py"), "--steps", "30",
                      cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    data = json.loads(js.read_text())
    cands = {(c["fp8"], tuple(c["fp8_exclude"])): c for c in data["candidates"]}
    assert set(cands) == {("tensorwise", ()), ("tensorwise", ("embed",))}
    assert not cands["tensorwise", ()]["qualifies"] and cands["tensorwise", ("embed",)]["qualifies"]
    assert cands["tensorwise", ("embed",)]["fp8_modules"] == ["hidden.0", "hidden.1", "hidden.2"]
    assert all(c["fp8_emulated"] for c in data["candidates"]) and data["chosen"]["fp8"] is None
    assert not any("fp8" in label for label in data["repeats_ms"])     # never re-timed for speed
    assert "O5 bfloat16, fp8='tensorwise' without ['embed']" in done.stdout and "never chosen for speed" in done.stdout


def test_fp8_in_float16_is_a_usage_error(tmp_path, in_process):
    done = in_process("tune", "--levels", "O2+fp8", "--half-dtype", "float16", cwd=tmp_path)
    assert done.returncode == 2 and "O2 here computes in float16" in done.stderr


def test_tune_levels_parse_as_compare_does():
    assert levels.variant("O5+fp8:rowwise_with_gw_hp").label == "O5+fp8:rowwise_with_gw_hp"
