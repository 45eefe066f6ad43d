"""`ampatch.runs.runner` and `progress`: child processes, what they leave, the live line.

The children here are tiny Python scripts that import neither torch nor ampatch.
"""

from __future__ import annotations

import io
import os
import signal
import sys
import textwrap
from pathlib import Path

import pytest
from _reports import REQUIRED

from ampatch.config import env as envvars
from ampatch.runs import UsageError, runner
from ampatch.runs.progress import Progress

# what every report has (a child here writes it without ampatch); a script adds its figures


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text).replace("REQUIRED", repr(REQUIRED)))
    return path


def test_progress_line() -> None:
    stream = io.StringIO()
    p = Progress("O2", total=20, stream=stream, log_every_s=0)
    p.render(force=True)
    assert "O2" in stream.getvalue() and "0/20" in stream.getvalue() and "elapsed" in stream.getvalue()
    for step in range(1, 11):
        p.update(step, 3.0 / step)
    p.seen[0] = (p.seen[-1][0] - 9 * 0.5, 1)  # ten steps, 0.5 s apart
    line = p.line()
    assert "[==========>" in line and "10/20" in line and "loss 0.3000" in line
    assert "0.50 s/step" in line and "ETA 0:05" in line
    unknown = Progress("O1", stream=stream)
    unknown.update(7, 1.25)
    assert "step 7" in unknown.line() and "loss 1.2500" in unknown.line()
    tty = io.StringIO()
    tty.isatty = lambda: True  # type: ignore[method-assign]
    live = Progress("O3", total=5, stream=tty)
    live.render(force=True)
    live.close()
    assert tty.getvalue().startswith("\r  O3") and tty.getvalue().endswith("\r\x1b[K")


PROGRESS_SCRIPT = """\
    import json, os, time
    for i in range(1, 6):
        with open(os.environ["AMPATCH_PROGRESS"], "a") as f:
            f.write(f"{i} {2.0 / i}\\n")
        time.sleep(0.15)
    with open(os.environ["AMPATCH_REPORT"], "w") as f:
        json.dump({**REQUIRED, "opt_level": os.environ["AMPATCH_OPT_LEVEL"], "steps": 5, "losses": [1.0] * 5}, f)
"""


def test_run_level_shows_the_steps_of_the_run(tmp_path: Path) -> None:
    script = write(tmp_path / "steps.py", PROGRESS_SCRIPT)
    stream = io.StringIO()
    progress = Progress("O1", total=5, stream=stream, log_every_s=0)
    run = runner.run_level([sys.executable, str(script)], "O1", None, progress)
    assert run.ok, run.error
    assert (run.report.opt_level, run.report.steps, run.report.losses) == ("O1", 5, [1.0] * 5)
    shown = stream.getvalue()
    assert "/5" in shown and "loss" in shown and progress.step == 5 and progress.loss == 0.4
    assert progress.start_s() is not None and progress.exit_s() is not None


def test_run_child_collects_the_json_each_variable_names(tmp_path: Path) -> None:
    """What `ampatch diagnose` needs: extra variables, and the JSONs a script writes at exit."""
    script = write(tmp_path / "two.py", """\
        import json, os, sys
        json.dump({"seen": os.environ["EXTRA"]}, open(os.environ["AMPATCH_REPORT"], "w"))
        open(os.environ["AMPATCH_DIAGNOSE"], "w").write("{not json")
        print("to stderr", file=sys.stderr)
    """)
    env = dict(os.environ, EXTRA="yes", AMPATCH_PROGRESS=str(tmp_path / "inherited.txt"))
    done = runner.run_child([sys.executable, str(script)], env, collect=(envvars.REPORT, envvars.DIAGNOSE))
    assert done.returncode == 0 and done.stderr.strip() == "to stderr" and done.wall_s > 0
    assert done.outputs == {envvars.REPORT: {"seen": "yes"}}
    assert envvars.DIAGNOSE in done.unreadable
    assert not (tmp_path / "inherited.txt").exists()     # no progress asked for: none inherited either
    nothing = runner.run_child([sys.executable, "-c", "pass"], env, collect=(envvars.REPORT,))
    assert nothing.outputs == {} and nothing.unreadable == {}


@pytest.mark.parametrize("code, expected", [
    ("raise SystemExit(3)", "exit code 3"),
    ("import sys; print('line one', file=sys.stderr); raise ValueError('bad value')", "ValueError: bad value"),
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "killed by SIGKILL"),
])
def test_a_failed_run_says_why_in_one_line(code: str, expected: str) -> None:
    run = runner.run_level([sys.executable, "-c", code], "O1", None)
    assert not run.ok and run.error == expected and run.report is None


def test_a_run_that_writes_no_report_or_another_level(tmp_path: Path) -> None:
    assert runner.run_level([sys.executable, "-c", "pass"], "O2", None).error == "script never called amp.initialize"
    other = write(tmp_path / "other.py", """\
        import json, os
        json.dump({**REQUIRED, "opt_level": "O1"}, open(os.environ["AMPATCH_REPORT"], "w"))
    """)
    run = runner.run_level([sys.executable, str(other)], "O2", None)
    assert run.error == "ran at O1 although O2 was forced"
    torn = write(tmp_path / "torn.py", """\
        import json, os
        json.dump({"opt_level": "O2", "steps": 3}, open(os.environ["AMPATCH_REPORT"], "w"))
    """)
    run = runner.run_level([sys.executable, str(torn)], "O2", None)
    assert not run.ok and run.report is None
    assert run.error.startswith("unreadable report: the report lacks 'half_dtype'")
    assert runner.failure_line(-signal.SIGTERM, "") == "killed by SIGTERM"
    assert runner.last_error_line("Traceback\n  x\nKeyError: 'a'\nlater noise\n") == "KeyError: 'a'"


def test_child_env_forces_level_and_half_dtype() -> None:
    base = {"PATH": "/bin", envvars.HALF_DTYPE: "float16"}
    env = runner.child_env("O2", "bfloat16", "/tmp/r.json", base=base)
    assert env[envvars.OPT_LEVEL] == "O2" and env[envvars.HALF_DTYPE] == "bfloat16"
    assert env[envvars.REPORT] == "/tmp/r.json"
    assert envvars.HALF_DTYPE not in runner.child_env("O4", "float16", base=base)   # O4 is bfloat16 by definition
    assert runner.child_env(None, None, base=base)[envvars.HALF_DTYPE] == "float16"  # not asked: left alone
    aliased = runner.with_apex_alias(runner.child_env(None, None, base=base))
    first = aliased["PYTHONPATH"].split(os.pathsep)[0]
    assert (Path(first) / "sitecustomize.py").is_file()


def test_resolve_command() -> None:
    assert runner.resolve_command(["python", "-c", "pass"])[0] == sys.executable
    with pytest.raises(UsageError, match="script not found: nope.py"):
        runner.resolve_command(["python", "-W", "ignore", "nope.py"])
    with pytest.raises(UsageError, match="command not found"):
        runner.resolve_command(["no-such-program-here"])
    with pytest.raises(UsageError, match="missing command after '--'"):
        runner.resolve_command([])
    assert runner.python_script(["-m", "pkg"]) is None


def test_a_policy_run_does_not_inherit_what_the_policy_decides() -> None:
    """run --policy, compare --policy and tune's candidates share one environment rule: the
    caller's AMPATCH_OPT_LEVEL/HALF_DTYPE/LOSS_SCALE/KEEP_FP32 do not override the policy."""
    shell = {envvars.OPT_LEVEL: "O3", envvars.HALF_DTYPE: "float16", envvars.LOSS_SCALE: "128",
             envvars.KEEP_FP32: "head", "HOME": "/home/x"}
    env = runner.child_env(None, None, base=shell, policy="p.json")
    assert env[envvars.POLICY] == "p.json" and env["HOME"] == "/home/x"
    assert not set(runner.POLICY_DECIDES) & set(env)
    forced = runner.child_env("O2", None, base=shell, keep_fp32="norm", policy="p.json")
    assert forced[envvars.OPT_LEVEL] == "O2" and forced[envvars.KEEP_FP32] == "norm"  # the command's own, kept


def test_a_level_with_a_low_memory_master_mode(tmp_path: Path) -> None:
    """`compare --levels O5+kahan`: the run is forced to O5 with master_weights="kahan", and a
    run that reports another mode fails its row instead of passing for what was asked."""
    env = runner.child_env("O5+kahan", None, base={"PATH": "/bin"})
    assert env[envvars.OPT_LEVEL] == "O5" and env[envvars.MASTER_WEIGHTS] == "kahan"
    assert envvars.MASTER_WEIGHTS not in runner.child_env("O5", None, base={"PATH": "/bin"})
    plain = write(tmp_path / "plain.py", """\
        import json, os
        json.dump({**REQUIRED, "opt_level": "O5", "master_weights": "fp32"}, open(os.environ["AMPATCH_REPORT"], "w"))
    """)
    run = runner.run_level([sys.executable, str(plain)], "O5+kahan", None)
    assert run.error == "ran with master_weights='fp32' although O5+kahan was forced"
    assert runner.run_level([sys.executable, str(plain)], "O5", None).ok
