"""`ampatch.runs.forkserver`: runs forked from a warm process behave like fresh ones."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ampatch.config import env as envvars
from ampatch.runs import runner
from ampatch.runs.forkserver import ForkServer, WarmLauncher
from ampatch.runs.progress import Progress

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the fork server is for Linux")

MODULE = textwrap.dedent("""\
    import atexit, json, os, sys, time
    atexit.register(lambda: open(os.environ["OUT"], "w").write(json.dumps(
        {"argv": sys.argv[1:], "level": os.environ.get("AMPATCH_OPT_LEVEL"), "name": __name__})))
    mode = sys.argv[1]
    print("to stderr", file=sys.stderr)
    print("to stdout")
    if mode == "raise":
        raise ValueError("bad value")
    if mode == "exit":
        raise SystemExit(3)
    if mode == "sleep":
        time.sleep(60)
""")


@pytest.fixture
def server(tmp_path: Path):
    (tmp_path / "fsmod.py").write_text(MODULE)
    env = runner.child_env(None, None, base=envvars.without_ampatch())
    runner.prepend_path(env, str(tmp_path))
    server = ForkServer(["json"], env)
    server.wait_ready()
    yield server
    server.close()


def launch(server: ForkServer, tmp_path: Path, mode: str):
    env = dict(os.environ, OUT=str(tmp_path / f"{mode}.json"), AMPATCH_OPT_LEVEL="O3")
    return server.launch([sys.executable, "-m", "fsmod", mode, "x"], env, tmp_path / f"{mode}.err")


def test_a_forked_run_is_like_python_dash_m(server: ForkServer, tmp_path: Path) -> None:
    ok = launch(server, tmp_path, "ok")
    assert ok.wait(timeout=60) == 0 and ok.poll() == 0
    assert json.loads((tmp_path / "ok.json").read_text()) == {"argv": ["ok", "x"], "level": "O3", "name": "__main__"}
    assert (tmp_path / "ok.err").read_text() == "to stderr\n"          # stdout goes nowhere
    raised = launch(server, tmp_path, "raise")
    assert raised.wait(timeout=60) == 1
    err = (tmp_path / "raise.err").read_text()
    assert "Traceback" in err and err.strip().endswith("ValueError: bad value")
    assert (tmp_path / "raise.json").is_file()                        # its exit handlers ran too
    assert launch(server, tmp_path, "exit").wait(timeout=60) == 3


def test_a_forked_run_can_be_stopped(server: ForkServer, tmp_path: Path) -> None:
    run = launch(server, tmp_path, "sleep")
    with pytest.raises(subprocess.TimeoutExpired):
        run.wait(timeout=0.5)
    assert run.poll() is None
    runner.stop(run)                                                 # SIGINT first: a KeyboardInterrupt
    assert run.returncode == 128 + signal.SIGINT
    killed = launch(server, tmp_path, "sleep")
    killed.kill()
    assert killed.wait(timeout=60) == -signal.SIGKILL
    assert launch(server, tmp_path, "ok").wait(timeout=60) == 0       # the server still serves


def test_run_level_through_the_launcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "steps.py"
    script.write_text(textwrap.dedent("""\
        import json, os
        with open(os.environ["AMPATCH_PROGRESS"], "a") as f:
            f.write("1 0.5\\n")
        json.dump({"opt_level": os.environ["AMPATCH_OPT_LEVEL"], "half_dtype": None, "enabled": True,
                   "casts": {}, "cache": {}, "steps": 1, "skipped_steps": [], "loss_scale": {},
                   "loss_scale_history": {}, "time_s": {}}, open(os.environ["AMPATCH_REPORT"], "w"))
        open(os.environ["PID_FILE"], "w").write(str(os.getpid()))
    """))
    env = runner.child_env(None, None, base=envvars.without_ampatch())
    runner.prepend_path(env, str(tmp_path))
    monkeypatch.setenv("PID_FILE", str(tmp_path / "pid.txt"))  # the run's environment is this one's, forced
    log = io.StringIO()
    with WarmLauncher(["json"], env, log) as warm:
        assert warm.server is not None and "warm process ready in" in log.getvalue()
        progress = Progress("O2", total=1, stream=io.StringIO(), log_every_s=0)
        run = runner.run_level([sys.executable, "-m", "steps"], "O2", None, progress, launch=warm)
        server_pid = warm.server.proc.pid
    assert run.ok, run.error
    assert run.report.opt_level == "O2" and int((tmp_path / "pid.txt").read_text()) not in (os.getpid(), server_pid)
    assert progress.step == 1


def test_a_server_that_fails_to_start_falls_back_to_fresh_processes(tmp_path: Path) -> None:
    log = io.StringIO()
    with WarmLauncher(["no_such_module_anywhere"], dict(os.environ), log) as warm:
        assert warm.server is None
        proc = warm([sys.executable, "-c", "import sys; sys.exit(4)"], dict(os.environ), tmp_path / "e.txt")
        assert proc.wait(timeout=60) == 4
    assert ("note: the fork server ended (ModuleNotFoundError: No module named 'no_such_module_anywhere')"
            in log.getvalue())
    assert "starting each run as a fresh process instead" in log.getvalue()


def test_only_python_dash_m_commands(server: ForkServer, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'python -m MODULE ...' commands"):
        server.launch([sys.executable, "script.py"], dict(os.environ), tmp_path / "e.txt")
    started = time.perf_counter()
    server.close()
    assert server.proc.returncode == 0 and time.perf_counter() - started < 30
