"""`ampatch compare --levels O5,O5+fp8[:RECIPE]`: the level strings with FP8 (parsed once, in
`config.levels.variant`), the runs forced through AMPATCH_FP8, and the table's mark on a row
whose FP8 was emulated ("fp8 emulated: numerics only, not speed"); a bad recipe and FP8 that
would compute in float16 are usage errors with the reasons initialize gives."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from _cli import ampatch_main
from _reports import REQUIRED

from ampatch.config import env as envvars
from ampatch.config import levels
from ampatch.model.fp8 import EMULATED
from ampatch.runs import runner, sizing
from ampatch.workloads.calibrate import step_kinds


@pytest.fixture
def in_process(capfd: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch):
    """``ampatch ARGS`` through `cli.main` in this process, what ``python -m ampatch`` runs, with its
    runs as child processes and no AMPATCH_* inherited (tests/_cli.py)."""
    return lambda *args, cwd=None: ampatch_main(capfd, monkeypatch, *args, cwd=cwd)


@pytest.mark.parametrize("text, want, label", [
    ("O5+fp8", levels.Variant("O5", None, True), "O5+fp8"),
    (" o5+FP8:Rowwise ", levels.Variant("O5", None, "rowwise"), "O5+fp8:rowwise"),
    ("O4+fp8:rowwise_with_gw_hp", levels.Variant("O4", None, "rowwise_with_gw_hp"), "O4+fp8:rowwise_with_gw_hp"),
    ("O5+fp8:tensorwise+kahan", levels.Variant("O5", "kahan", "tensorwise"), "O5+kahan+fp8:tensorwise"),
    ("O5+kahan", levels.Variant("O5", "kahan", None), "O5+kahan"),
    ("o0", levels.Variant("O0"), "O0"),
])
def test_level_strings_with_fp8(text, want, label):
    got = levels.variant(text)
    assert got == want and got.label == label and levels.variant(label) == want


@pytest.mark.parametrize("text, message", [
    ("O5+fp8:columnwise",
     "'columnwise' is not an fp8 recipe; use one of 'tensorwise', 'rowwise', 'rowwise_with_gw_hp'"),
    ("O5+fp8:", "'' is not an fp8 recipe"),
    ("O5+fp8:off", "'off' is not an fp8 recipe"),
    ("O5+fp8+fp8:rowwise", "fp8 is given twice"),
    ("O5+fp16", "after '+' comes a master_weights mode, one of stochastic, kahan (e.g. O5+kahan), an "
                "optimizer_states precision"),
])
def test_bad_level_strings_name_what_is_accepted(text, message):
    with pytest.raises(ValueError) as err:
        levels.variant(text)
    assert message in str(err.value)


def test_the_runs_get_fp8_through_the_environment(tmp_path):
    """"O5+fp8" forces fp8=True (tensorwise), "O5+fp8:rowwise" that recipe; a run that did not
    run the recipe it was forced to fails its row instead of passing for it."""
    base = {"PATH": "/bin"}
    assert runner.child_env("O5+fp8", None, base=base)[envvars.FP8] == "1"
    env = runner.child_env("O5+kahan+fp8:rowwise", None, base=base)
    assert (env[envvars.OPT_LEVEL], env[envvars.MASTER_WEIGHTS], env[envvars.FP8]) == ("O5", "kahan", "rowwise")
    assert envvars.FP8 not in runner.child_env("O5", None, base=base)
    script = tmp_path / "fake.py"
    script.write_text(textwrap.dedent("""\
        import json, os
        json.dump({**REQUIRED, "opt_level": "O5", "fp8": "tensorwise"}, open(os.environ["AMPATCH_REPORT"], "w"))
    """).replace("REQUIRED", repr(REQUIRED)))
    assert runner.run_level([sys.executable, str(script)], "O5+fp8", None).ok
    assert runner.run_level([sys.executable, str(script)], "O5+fp8:rowwise", None).error == \
        "ran with fp8='tensorwise' although O5+fp8:rowwise was forced"


def test_emulated_fp8_is_a_step_kind_of_its_own():
    """The calibration times FP8 apart (emulated, it costs a few bfloat16 steps), and a level
    with a master mode as its level: every label of --levels has its kind."""
    kinds = step_kinds(["O0", "O5", "O5+kahan", "O5+fp8", "O5+fp8:rowwise"], "cpu", None)
    assert kinds == {"O0": "float32", "O5": "bfloat16", "O5+kahan": "bfloat16", "O5+fp8": "bfloat16+fp8:tensorwise",
                     "O5+fp8:rowwise": "bfloat16+fp8:rowwise"}


def test_compare_o5_against_o5_fp8_marks_the_emulated_row(tmp_path, in_process):
    pytest.importorskip("torchao")
    out = tmp_path / "c.json"
    proc = in_process("compare", "--levels", "O0,O5,O5+fp8", "--steps", "6", "--size", "tiny", "--json", str(out),
                      cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = {r["level"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["O0", "O5", "O5+fp8"]
    fp8 = rows["O5+fp8"]["report"]
    assert fp8["fp8"] == "tensorwise" and fp8["fp8_emulated"] and rows["O5"]["report"]["fp8"] == ""
    assert sum(layer["converted"] for layer in fp8["fp8_layers"]) == 4   # linear1/linear2 of the 2 layers
    lines = proc.stdout.splitlines()
    assert any(line.startswith("O5+fp8 *") for line in lines)          # the row is marked ...
    assert not any(line.startswith("O5 ") and "*" in line for line in lines)
    text = " ".join(proc.stdout.split())
    assert f"* {EMULATED}: no FP8 tensor cores here" in text          # ... and the mark explained
    assert "fp8 (torchao): O5+fp8 tensorwise on 4 of 7 Linear layers." in text
    assert "the losses of O5+fp8 show FP8's numerics; its step time and speed-up say nothing of FP8's speed" in text


def test_fp8_levels_are_refused_before_any_run(tmp_path, in_process):
    bad = in_process("compare", "--levels", "O5,O5+fp8:columnwise", cwd=tmp_path)
    assert bad.returncode == 2
    assert "'columnwise' is not an fp8 recipe; use one of 'tensorwise', 'rowwise', 'rowwise_with_gw_hp'" in bad.stderr
    half = in_process("compare", "--levels", "O0,O2+fp8", "--half-dtype", "float16", "--steps", "2", cwd=tmp_path)
    assert half.returncode == 2 and "running" not in half.stderr
    assert ("O2+fp8: fp8='tensorwise' runs where the layers compute in bfloat16 or FP32 (torchao's float8 training), "
            "but O2 here computes in float16. Use opt_level='O4' or 'O5' (bfloat16), or pass "
            "half_dtype=torch.bfloat16 with O2") in half.stderr


def test_the_calibration_times_fp8_steps(tmp_path):
    """The calibration child, given the labels of --levels as they are (before, "O5+kahan" was
    stripped to "O5" there and the size choice then missed its kind), times the FP8 kind."""
    pytest.importorskip("torchao")
    out = tmp_path / "cal.json"
    proc = subprocess.run([sys.executable, "-m", "ampatch.workloads.calibrate", "lm", "--levels", "O0,O5+kahan,O5+fp8",
                           "--device", "cpu", "--threads", "1", "--stop-above", "0", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["kinds"] == {"O0": "float32", "O5+kahan": "bfloat16", "O5+fp8": "bfloat16+fp8:tensorwise"}
    assert set(data["sizes"][0]["step"]) == {"float32", "bfloat16", "bfloat16+fp8:tensorwise"}
    labels = ("O0", "O5+kahan", "O5+fp8")
    choice = sizing.choose(data, sizing.Goal(labels, 120.0, 40, True), overhead_s=1.0)  # a KeyError before
    assert set(choice.weights) == set(labels)
