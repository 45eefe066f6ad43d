"""The command line's optimizer_states (issue 46): level strings ("O5+int8", "O5+stochastic+int8"),
`ampatch run --optimizer-states`, `ampatch compare --optimizer-states`.

- a level string names at most one state precision, at any level, and reads back as written;
- a run forced to "O5+int8" gets AMPATCH_OPTIMIZER_STATES, which beats the script's own
  keyword; a policy run does not inherit the caller's variable;
- compare's option reaches every level but the O0 reference, and a level's own precision wins;
- `ampatch run --optimizer-states int8` runs a script with its state kept in int8;
- a bad value is a usage error naming the choices.
"""
from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
from _cli import ampatch_main

from ampatch.cli.common import with_states
from ampatch.config import env as envvars
from ampatch.config.levels import Variant, variant
from ampatch.runs import runner

ROOT = Path(__file__).resolve().parents[2]


def test_level_strings_name_the_state_precision():
    assert variant("O5+int8") == Variant("O5", optimizer_states="int8")
    assert variant(" o5+Stochastic+INT8+fp8 ") == Variant("O5", "stochastic", True, "int8")
    assert variant("O1+bfloat16").label == "O1+bfloat16" and variant("O0+int8").label == "O0+int8"
    assert variant(Variant("O5", "kahan", "rowwise", "int8").label) == Variant("O5", "kahan", "rowwise", "int8")
    with pytest.raises(ValueError, match="one optimizer_states precision at most"):
        variant("O5+int8+bfloat16")
    with pytest.raises(ValueError, match="an optimizer_states precision, one of float32, bfloat16, int8"):
        variant("O5+fp16")


def test_a_forced_level_forces_the_state_precision(tmp_path: Path):
    env = runner.child_env("O5+stochastic+int8", None, base={"PATH": "/bin"})
    assert (env[envvars.OPT_LEVEL], env[envvars.MASTER_WEIGHTS], env[envvars.OPTIMIZER_STATES]) == \
        ("O5", "stochastic", "int8")
    assert envvars.OPTIMIZER_STATES not in runner.child_env("O5", None, base={"PATH": "/bin"})
    policy = runner.child_env(None, None, base={"PATH": "/bin", envvars.OPTIMIZER_STATES: "int8"}, policy="p.json")
    assert envvars.OPTIMIZER_STATES not in policy
    script = tmp_path / "plain.py"
    script.write_text(textwrap.dedent("""\
        import torch, ampatch as amp
        m = torch.nn.Linear(4, 4)
        amp.initialize(m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), opt_level="O5",
                       optimizer_states="bfloat16")
    """))
    run = runner.run_level([sys.executable, str(script)], "O5+int8", None)  # beats the script's own bfloat16
    assert run.ok and run.report.optimizer_states == "int8"


def test_compare_gives_every_level_but_the_reference_the_precision():
    assert with_states(["O0", "O1", "O5+kahan", "O5+bfloat16"], "int8") == ["O0", "O1+int8", "O5+kahan+int8",
                                                                           "O5+bfloat16"]
    assert with_states(["O0", "O5"], None) == ["O0", "O5"]
    assert with_states(["O5", "O5+int8"], "int8") == ["O5+int8"]


def test_run_keeps_a_scripts_state_in_the_precision_asked(tmp_path: Path, capfd: pytest.CaptureFixture,
                                                        monkeypatch: pytest.MonkeyPatch):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""\
        import torch, ampatch as amp
        m = torch.nn.Linear(64, 128)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        m, opt = amp.initialize(m, opt, opt_level="O2")
        for _ in range(2):
            opt.zero_grad()
            with amp.scale_loss(m(torch.randn(8, 64)).float().square().mean(), opt) as s:
                s.backward()
            opt.step()
    """))
    report = tmp_path / "report.json"
    # the command through cli.main in this process (tests/_cli.py: what python -m ampatch runs; the script a child)
    done = ampatch_main(capfd, monkeypatch, "run", "--optimizer-states", "int8", "--report", str(report), "--",
                        sys.executable, str(script), cwd=ROOT)
    assert done.returncode == 0, done.stderr
    data = json.loads(report.read_text())
    assert data["optimizer_states"] == "int8" and data["optimizer_state_bytes"] < 4 * 64 * 128
    bad = ampatch_main(capfd, monkeypatch, "run", "--optimizer-states", "fp16", "--", "true", cwd=ROOT)
    assert bad.returncode == 2 and "'float32'" in bad.stderr and "'int8'" in bad.stderr
