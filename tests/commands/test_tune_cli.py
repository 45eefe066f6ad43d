"""`ampatch tune` end to end on `examples/tune.py` (a model one module ruins in bfloat16),
and its bad input: each gets one clear message and a non-zero exit."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ampatch.cli import main
from ampatch.config.policy_file import load

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "tune.py")


def test_tune_repairs_the_ruined_module_and_writes_a_policy_that_applies(tmp_path, capsys):
    out, js = tmp_path / "policy.json", tmp_path / "tune.json"
    # 16 steps: in 6, O0's loss (2.313 to 2.302) does not fall beyond its batch-to-batch noise, and tune stops;
    # in 12, the repaired run's per-step differences from O0 are too noisy to resolve the 2% tolerance
    code = main(["tune", "--levels", "O5", "--steps", "16", "--rounds", "1", "--budget", "none", "--out", str(out),
                 "--json", str(js), "--", "python", EXAMPLE])
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
    assert policy.measured["steps"] == 16 and policy.measured["machine"]["type"] == "cpu"
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
    (["--rounds", "-1"], "--rounds: must be 0 or more"),
    (["--rounds", "two"], "--rounds"),
])
def test_bad_input_is_a_usage_error(args, words, capsys):
    assert main(["tune", *args]) == 2
    assert words in capsys.readouterr().err


ADAM_EPS_SCRIPT = """
import torch, ampatch as amp
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
o = torch.optim.Adam(m.parameters(), lr=1e-2, eps=1e-8)
m, o = amp.initialize(m, o, opt_level="O1", verbosity=0)
gen = torch.Generator().manual_seed(1)
for _ in range(20):
    x = torch.randn(16, 8, generator=gen)
    x[:, :3] = 0                      # these inputs are always 0: their weights' gradients are 0
    loss = torch.nn.functional.cross_entropy(m(x).float(), {labels})
    o.zero_grad()
    with amp.scale_loss(loss, o) as s:
        s.backward()
    o.step()
"""


def test_a_step_fault_is_repaired_with_fp32_masters_not_modules(tmp_path, capsys):
    """O3 float16 with Adam's eps=1e-8 (0 in float16): the weights go NaN at the optimizer
    step. No module to keep helps; the repair is diagnose's recommendation, FP32 master weights
    (the optimizer then steps FP32 copies), and it trains like O0."""
    script = tmp_path / "adam.py"
    script.write_text(ADAM_EPS_SCRIPT.format(labels="(x[:, 3] > 0).long()"))   # labels O0 learns in 6 steps
    js = tmp_path / "t.json"
    code = main(["tune", "--levels", "O3", "--half-dtype", "float16", "--steps", "6", "--rounds", "0",
                 "--out", str(tmp_path / "p.json"), "--json", str(js), "--", "python", str(script)])
    assert code == 0, capsys.readouterr().err[-2000:]
    data = json.loads(js.read_text())
    o3, repaired = data["candidates"]
    assert o3["opt_level"] == "O3" and not o3["qualifies"] and o3["step_fault"]
    assert "step fault" in o3["reason"] and "not a module's precision" in o3["reason"]
    assert repaired["master_weights"] is True and repaired["keep_fp32"] == [] and repaired["repairs"] == "O3 float16"
    assert repaired["qualifies"], repaired["reason"]


UNSOUND = """
import torch, ampatch as amp
torch.manual_seed(0)
m = torch.nn.Linear(4, 1)
o = torch.optim.SGD(m.parameters(), lr=0.01)
m, o = amp.initialize(m, o, verbosity=0)
x = torch.randn(16, 4)
for step in range(20):
    loss = (m(x) ** 2).mean() + {rise}
    o.zero_grad()
    with amp.scale_loss(loss, o) as s:
        s.backward()
    o.step()
"""


@pytest.mark.parametrize("rise,words", [("0.5 * step", "its loss rises from"),
                                        ("(float('nan') if step >= 4 else 0.0)", "its loss is not finite from step 4")])
def test_a_reference_that_diverges_or_goes_non_finite_stops_tune(tmp_path, capsys, rise, words):
    """O0 is what every candidate is judged against: one whose loss is not finite or climbs
    stops the search with exit 1 and no policy file (every candidate used to get an infinite
    deviation, and O0 was written with exit 0)."""
    script = tmp_path / "bad.py"
    script.write_text(UNSOUND.format(rise=rise))
    out = tmp_path / "p.json"
    assert main(["tune", "--steps", "10", "--out", str(out), "--", "python", str(script)]) == 1
    err = capsys.readouterr().err
    assert "the O0 reference is unsound: " + words in err and "No candidate can be judged against it" in err
    assert not out.exists()


def test_a_reference_that_makes_no_detectable_progress_stops_tune(tmp_path, capsys):
    """Random labels: O0's loss moves only by its batch-to-batch noise. Tune runs O0 longer, as
    far as the script goes (20 steps), asks the weights where the loss cannot tell, and when
    neither decides says so: exit 1, "cannot tell", no policy file, and a JSON that says why
    and what would decide (the O0 rerun of the same seed and data that used to be the noise
    floor measured 0.00% on a CPU, and every candidate qualified against it)."""
    script = tmp_path / "coin_flips.py"
    script.write_text(ADAM_EPS_SCRIPT.format(labels="torch.randint(0, 2, (16,), generator=gen)"))
    out, js = tmp_path / "p.json", tmp_path / "t.json"
    assert main(["tune", "--levels", "O3", "--steps", "12", "--out", str(out), "--json", str(js), "--", "python",
                 str(script)]) == 1
    captured = capsys.readouterr()
    assert "the script ends after 20 optimizer steps" in captured.out and "cannot tell" in captured.out
    assert "O0 made no detectable progress" in captured.out and not out.exists()
    data = json.loads(js.read_text())
    assert data["outcome"] == "cannot tell" and data["chosen"] is None and data["steps_tried"] == [12, 20]
    assert data["decide"]["steps"] > 20 and "O0 made no detectable progress" in data["candidates"][0]["reason"]
