"""`ampatch tune` end to end on `examples/tune.py` (a model one module ruins in bfloat16),
and its bad input: each gets one clear message and a non-zero exit."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ampatch.cli import main
from ampatch.policyfile import load

EXAMPLE = str(Path(__file__).resolve().parents[1] / "examples" / "tune.py")


def test_tune_repairs_the_ruined_module_and_writes_a_policy_that_applies(tmp_path, capsys):
    out, js = tmp_path / "policy.json", tmp_path / "tune.json"
    code = main(["tune", "--levels", "O5", "--steps", "6", "--rounds", "1", "--budget", "none", "--out", str(out), "--json", str(js),
                 "--", "python", EXAMPLE])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-2000:]
    data = json.loads(js.read_text())
    first, repaired = data["candidates"]
    assert first["opt_level"] == "O5" and not first["qualifies"] and "deviation" in first["reason"]
    assert repaired["keep_fp32"] == ["norm"] and repaired["qualifies"] and repaired["finite"]
    assert data["chosen"]["keep_fp32"] == ["norm"] and data["chosen"]["opt_level"] == "O5"
    assert data["reference"]["step_ms"] > 0 and data["tolerance"] == 0.02
    policy = load(out)
    assert (policy.opt_level, policy.keep_fp32) == ("O5", ("norm",))
    assert policy.measured["steps"] == 6 and policy.measured["machine"]["type"] == "cpu"
    assert "chosen: O5 bfloat16, keep_fp32=['norm']" in captured.out
    assert "ampatch tune: [1] O0: the FP32 reference" in captured.err          # progress as it goes
    assert "re-timing" in captured.err


def test_a_script_that_crashes_or_never_scales_its_loss_is_one_message(tmp_path, capsys):
    crash = tmp_path / "crash.py"
    crash.write_text("raise RuntimeError('no data here')\n")
    assert main(["tune", "--out", str(tmp_path / "p.json"), "--", "python", str(crash)]) == 1
    err = capsys.readouterr().err
    assert "the O0 reference run failed: RuntimeError: no data here" in err
    quiet = tmp_path / "quiet.py"
    quiet.write_text("import torch, ampatch as amp\n"
                     "m = torch.nn.Linear(2, 2); o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
                     "m, o = amp.initialize(m, o, verbosity=0)\n"
                     "m(torch.ones(1, 2)).sum().backward(); o.step()\n")
    assert main(["tune", "--out", str(tmp_path / "p.json"), "--", "python", str(quiet)]) == 1
    assert "never completed an optimizer step after amp.scale_loss" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("args,words", [
    (["--tolerance", "-2%"], "--tolerance: must be above 0"),
    (["--tolerance", "lots"], "--tolerance"),
    (["--budget", "soon"], "--budget"),
    (["--workload", "lm", "--", "python", "x.py"], "apply to the built-in workloads"),
    (["--out", "/no/such/dir/p.json"], "--out"),
])
def test_bad_input_is_a_usage_error(args, words, capsys):
    assert main(["tune", *args]) == 2
    assert words in capsys.readouterr().err
