"""`ampatch diagnose` from the command line: it finds a planted problem in an unmodified
script, verifies the fix by running again with it, and refuses bad input with a clear
message and a non-zero exit. Each test runs real child processes (slow): the command itself
through `cli.main` in this process (`in_process`, tests/_cli.py; one interpreter start less per
test), its runs as children."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _cli import ampatch_main

from ampatch.cli import main
from ampatch.config import env

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture
def in_process(capfd: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch):
    """``ampatch ARGS`` from the checkout's root (or ``cwd``) through `cli.main` in this process, what
    ``python -m ampatch`` runs, with no AMPATCH_* inherited (tests/_cli.py)."""
    return lambda *args, cwd=None: ampatch_main(capfd, monkeypatch, *args, cwd=cwd or ROOT)


def _script(tmp_path: Path, body: str, name: str = "train.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def test_the_example_goes_nan_in_float16_and_the_fix_is_verified_finite(tmp_path, in_process):
    out = tmp_path / "d.json"
    done = in_process("diagnose", "--half-dtype", "float16", "--json", str(out), "--",
                      "python", "examples/diagnose.py")
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["first_nonfinite"]["module"] == "encoder.attn.scores"
    assert result["first_nonfinite"]["phase"] == "forward"
    assert result["recommendation"]["keep_fp32"] == ["encoder.attn.scores"]
    v = result["verification"]
    assert v["finite"] and not v["gave_up"] and not v["without"]["finite"]
    # judged, not assumed: the fixed run is finite, and whether it follows O0 is decided by tune's
    # rule on longer runs (in this example its float16 loss scale backs off again after step 16)
    assert v["max_dev_vs_O0"] is not None and v["learned_vs_O0"] is not None
    # in 8 steps O0's loss does not fall beyond its noise: tune's rule cannot tell whether the fix
    # learns like O0, so O0 and the fix run again with twice the steps, as tune's runs do, until it can
    first, last = v["tries"][0], v["tries"][-1]
    assert first["steps"] == 8 and first["follows_O0"] is None and first["verdict"].startswith("O0 made no detectable")
    assert last == {k: x for k, x in v.items() if k in last} and v["steps"] > 8 and v["follows_O0"] is not None
    assert v["O0"]["follows_O0"] is None and v["O0"]["steps"] == v["steps"]
    assert "can't tell" in done.stdout
    # the verification shows the deviation as compare and tune do: relative, in percent
    assert f"{v['max_dev_vs_O0']:.2%}" in done.stdout
    assert "encoder.attn.scores" in done.stdout
    assert ("ampatch run --half-dtype float16 --keep-fp32 encoder.attn.scores -- python examples/diagnose.py"
            in done.stdout)


UNDERFLOW = """
    import torch
    from torch import nn
    import ampatch as amp

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=5e4)   # float16 holds lr up to 65504
    model, opt = amp.initialize(model, opt, opt_level="O3", half_dtype=torch.float16)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 16, generator=gen), torch.randint(0, 4, (64,), generator=gen)
    for step in range(100):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x).float(), y) * 1e-5   # a loss normalised far too small
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
"""


def test_gradient_underflow_at_o3_float16_is_fixed_by_a_dynamic_loss_scale(tmp_path, in_process):
    script = _script(tmp_path, UNDERFLOW)
    out = tmp_path / "d.json"
    done = in_process("diagnose", "--steps", "30", "--json", str(out), "--", "python", str(script))
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    rec = result["recommendation"]
    assert rec["settings"] == {"loss_scale": "dynamic"} and rec["keep_fp32"] == []
    v = result["verification"]
    assert v["finite"] and v["settings"] == {"loss_scale": "dynamic"}
    assert v["max_dev_vs_O0"] < 0.5 * v["without"]["max_dev_vs_O0"]


def test_a_built_in_workload_that_trains_fine_gets_no_recommendation(tmp_path, in_process):
    out = tmp_path / "d.json"
    done = in_process("diagnose", "--workload", "lm", "--size", "tiny", "--steps", "3", "--json", str(out))
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["recommendation"]["keep_fp32"] == [] and result["verification"] is None
    assert "recommendation: none" in done.stdout


@pytest.mark.parametrize("body,message", [
    ("raise SystemExit('data not found')\n", "data not found"),
    ("""
     import torch, ampatch as amp
     model = torch.nn.Linear(4, 4)
     opt = torch.optim.SGD(model.parameters(), lr=0.1)
     model, opt = amp.initialize(model, opt, opt_level="O1")
     model(torch.randn(2, 4)).sum().backward()
     opt.step()
     """, "never completed an optimizer step after amp.scale_loss: the loss's backward must run inside"),
    ("""
     import torch, ampatch as amp
     model = torch.nn.Sequential(torch.nn.Linear(4, 4))
     opt = torch.optim.SGD(model.parameters(), lr=0.1)
     model, opt = amp.initialize(model, opt, opt_level="O1", keep_fp32=["1"])
     """, "no module is named '1'"),
])
def test_nothing_to_diagnose_is_a_clear_message_and_exit_1(tmp_path, body, message, in_process):
    script = _script(tmp_path, body)
    done = in_process("diagnose", "--", "python", str(script))
    assert done.returncode == 1
    assert message in done.stderr and "nothing to diagnose" in done.stderr


def test_bad_options_are_usage_errors(tmp_path, capfd):
    """Through `cli.main` in this process (what ``python -m ampatch`` runs; the real process's exit
    status and line: test_cli.py's test_a_bad_argument_from_the_real_command)."""
    for args, words in ((["--steps", "0"], "positive integer"),
                        (["--workload", "lm", "--", "python", "x.py"], "exclude each other"),
                        (["--json", str(tmp_path / "no" / "d.json")], "does not exist"),
                        (["--opt-level", "O5", "--half-dtype", "float16"], "O5 is the bfloat16 variant of O2")):
        assert main(["diagnose", *args]) == 2, args
        assert words in capfd.readouterr().err


def test_max_steps_ends_the_run_after_that_many_steps_with_its_report(tmp_path):
    script = _script(tmp_path, UNDERFLOW.replace('opt_level="O3", half_dtype=torch.float16', 'opt_level="O1"'))
    report = tmp_path / "r.json"
    variables = env.without_ampatch()
    variables.update({env.MAX_STEPS: "7", env.REPORT: str(report), "PYTHONPATH": str(ROOT)})
    done = subprocess.run([sys.executable, str(script)], env=variables, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(report.read_text())["steps"] == 7


def test_a_step_fault_recommends_and_verifies_fp32_masters(tmp_path, in_process):
    """A small CNN with AdamW (eps 1e-8) and OneCycleLR at O3 in float16: float16 rounds eps to 0
    and the optimizer's own step makes weights NaN. The notes say so; the recommendation follows
    them (FP32 master weights, not a loss scale or a module) and its verification follows O0; no
    note blames the data for the loss that goes NaN after that step."""
    plants = str(Path(__file__).resolve().parent / "_tune_plants.py")
    out = tmp_path / "d.json"
    done = in_process("diagnose", "--half-dtype", "float16", "--opt-level", "O3", "--json", str(out), "--",
                      "python", plants, "cnn")
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    rec = result["recommendation"]
    assert result["step_fault"] is not None and rec["settings"]["master_weights"] is True and rec["keep_fp32"] == []
    notes = " ".join(rec["notes"])
    assert "eps=1e-08" in notes and "step fault" in notes and "bad labels" not in notes
    v = result["verification"]
    assert v["finite"] and v["follows_O0"] is True and v["settings"]["master_weights"] is True
    assert "recommendation: " in done.stdout and "master_weights=True" in done.stdout
    assert "--master-weights True" in done.stdout
