"""`ampatch run --fp8 [RECIPE]`: the script's Linear layers in FP8 from outside (AMPATCH_FP8),
tensorwise without a recipe, `off` turning the script's own fp8 off; a bad recipe is a usage
error naming the valid ones."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from _cli import ampatch_main

pytest.importorskip("torchao")
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = textwrap.dedent("""\
    import sys, torch, ampatch as amp
    m = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 16))
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    m, o = amp.initialize(m, o, opt_level="O5", fp8=sys.argv[1] if len(sys.argv) > 1 else None, verbosity=0)
    print(amp.report().fp8 or "off", type(m[0]).__name__)
""")


@pytest.fixture
def in_process(capfd: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch):
    """``ampatch ARGS`` through `cli.main` in this process, what ``python -m ampatch`` runs, with its
    runs as child processes and no AMPATCH_* inherited (tests/_cli.py)."""
    return lambda *args, cwd=None: ampatch_main(capfd, monkeypatch, *args, cwd=cwd)


@pytest.mark.parametrize("option, script_args, want", [
    (["--fp8"], [], "tensorwise Float8Linear"),
    (["--fp8", "rowwise"], [], "rowwise Float8Linear"),
    (["--fp8", "off"], ["rowwise"], "off Linear"),
    ([], ["rowwise_with_gw_hp"], "rowwise_with_gw_hp Float8Linear"),
])
def test_run_fp8_reaches_every_initialize(tmp_path, option, script_args, want, in_process):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = in_process("run", *option, "--", "python", str(script), *script_args, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == want, done.stderr


def test_a_bad_recipe_is_a_usage_error(tmp_path, in_process):
    bad = in_process("run", "--fp8", "columnwise", "--", "python", "x.py", cwd=tmp_path)
    assert bad.returncode == 2
    assert ("--fp8='columnwise' is not an fp8 recipe; use one of 'tensorwise', 'rowwise', 'rowwise_with_gw_hp'"
            in bad.stderr)
