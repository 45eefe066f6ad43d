"""`ampatch.runs.process`: signals reach the runs, and no run outlives the command.

``ampatch run`` passes SIGTERM/SIGHUP/SIGINT on to its script (a scheduler's preemption, a
container stop, ``timeout``: the script saves a checkpoint) and exits with the script's status;
``compare``, ``diagnose`` and ``tune`` stop their running child as Ctrl-C does. The scripts here
are tiny Python programs (no torch) run by a real ``python -m ampatch``, signalled by pid.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from _cli import as_from_a_terminal

from ampatch.runs import process, runner

ROOT = Path(__file__).resolve().parents[2]

# Starts a grandchild that sleeps, then waits; on SIGTERM it writes "saved" (a checkpoint) and exits 3.
CHECKPOINTING = textwrap.dedent("""\
    import os, signal, subprocess, sys, time
    out = sys.argv[1]
    def save(signum, frame):
        with open(os.path.join(out, "saved"), "w") as f:
            f.write(signal.Signals(signum).name)
        sys.exit(3)
    signal.signal(signal.SIGTERM, save)
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(os.path.join(out, "pids.tmp"), "w") as f:
        f.write(f"{os.getpid()} {helper.pid}")
    os.replace(os.path.join(out, "pids.tmp"), os.path.join(out, "pids"))
    time.sleep(600)
""")


def gone(pid: int) -> bool:
    """Whether ``pid`` no longer runs (ended, or a zombie waiting for init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False


def all_gone(pids: list[int], within_s: float = 10.0) -> bool:
    end = time.monotonic() + within_s
    while not all(gone(p) for p in pids):
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def start_ampatch(*args: str, cwd: Path, output: int = subprocess.PIPE) -> subprocess.Popen:
    """``python -m ampatch ARGS`` with this checkout importable and no inherited AMPATCH_*."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AMPATCH_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.Popen([sys.executable, "-m", "ampatch", *args], cwd=cwd, env=env, text=True,
                            stdout=output, stderr=output, preexec_fn=as_from_a_terminal)


def wait_for(path: Path, proc: subprocess.Popen, within_s: float = 120.0) -> list[int]:
    """The pids the script wrote to ``path``, once it has (the script is then ready)."""
    end = time.monotonic() + within_s
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < end, "the script never started"
        time.sleep(0.05)
    return [int(p) for p in path.read_text().split()]


@pytest.mark.parametrize("sig, saved, status", [(signal.SIGTERM, True, 3), (signal.SIGHUP, False, 128 + signal.SIGHUP)])
def test_run_passes_a_signal_on_to_the_script_and_exits_with_its_status(
        tmp_path: Path, sig: int, saved: bool, status: int) -> None:
    """SIGTERM to ``ampatch run``: the script's handler saves and exits 3, the command exits 3,
    and neither the script nor what it started is left. A signal the script does not handle
    kills it, and the command says so the shell's way (128+N)."""
    script = tmp_path / "train.py"
    script.write_text(CHECKPOINTING)
    proc = start_ampatch("run", "--", "python", str(script), str(tmp_path), cwd=tmp_path)
    try:
        pids = wait_for(tmp_path / "pids", proc)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == status, err
    assert (tmp_path / "saved").exists() == saved
    assert all_gone(pids), f"left running: {[p for p in pids if not gone(p)]}"


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death guard is Linux's prctl")
def test_a_script_does_not_outlive_a_killed_run_command(tmp_path: Path) -> None:
    """SIGKILL to ``ampatch run`` (nothing to pass on): the script goes with it. (What the
    script started is its own to guard: Linux clears the guard in a fork's child.)"""
    script = tmp_path / "train.py"
    script.write_text(CHECKPOINTING)
    proc = start_ampatch("run", "--", "python", str(script), str(tmp_path), cwd=tmp_path, output=subprocess.DEVNULL)
    script_pid = helper_pid = None
    try:
        script_pid, helper_pid = wait_for(tmp_path / "pids", proc)
        proc.kill()
        proc.wait(timeout=60)
        assert all_gone([script_pid]), "the script outlived the command"
    finally:
        proc.kill()
        for pid in (script_pid, helper_pid):
            if pid is not None and not gone(pid):
                os.kill(pid, signal.SIGKILL)


SLOW_LEVELS = textwrap.dedent("""\
    import json, os, sys, time
    level = os.environ["AMPATCH_OPT_LEVEL"]
    if level != "O0":
        with open(sys.argv[1], "w") as f:
            f.write(str(os.getpid()))
        time.sleep(600)  # a long run, stopped
    report = {"opt_level": level, "half_dtype": None, "enabled": True, "casts": {}, "cache": {}, "steps": 3,
              "skipped_steps": [], "loss_scale": {}, "loss_scale_history": {}, "time_s": {},
              "losses": [1.0, 0.5, 0.25]}
    with open(os.environ["AMPATCH_REPORT"], "w") as f:
        json.dump(report, f)
""")


def test_sigterm_stops_compare_as_ctrl_c_does(tmp_path: Path) -> None:
    """SIGTERM to ``ampatch compare``: the running level is stopped with SIGTERM, the table
    of the finished levels is printed, and the command exits 128+15."""
    script = tmp_path / "slow.py"
    script.write_text(SLOW_LEVELS)
    proc = start_ampatch("compare", "--levels", "O0,O1,O2", "--", "python", str(script), str(tmp_path / "pid"),
                         cwd=tmp_path)
    try:
        (o1_pid,) = wait_for(tmp_path / "pid", proc)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "interrupted: 1 of 3 levels finished (O0)" in out
    assert "[2/3] O1 interrupted by SIGTERM; stopping" in err and "O2 running" not in err
    assert all_gone([o1_pid])


def test_a_signal_to_the_command_stops_the_child_with_that_signal(tmp_path: Path) -> None:
    """The layer under diagnose and tune: a SIGTERM to this process while `run_child` waits
    reaches the child first (it may save), then raises `process.Stopped` to the caller."""
    script = tmp_path / "train.py"
    script.write_text(CHECKPOINTING)
    pids = tmp_path / "pids"

    def signal_when_ready() -> None:
        end = time.monotonic() + 60
        while not pids.exists() and time.monotonic() < end:
            time.sleep(0.05)
        if pids.exists():  # else the test fails on its own: the child would sleep on, stopped by pytest's timeout
            os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    threading.Thread(target=signal_when_ready, daemon=True).start()
    with pytest.raises(process.Stopped) as stopped:
        runner.run_child([sys.executable, str(script), str(tmp_path)], dict(os.environ))
    assert stopped.value.signum == signal.SIGTERM and process.signal_of(stopped.value) == signal.SIGTERM
    assert (tmp_path / "saved").read_text() == "SIGTERM"
    assert all_gone([int(p) for p in pids.read_text().split()])
    assert signal.getsignal(signal.SIGTERM) is before    # the command's own handler is back


def test_exit_status_and_an_ignored_signal_stays_ignored() -> None:
    assert process.exit_status(-signal.SIGTERM) == 143 and process.exit_status(3) == 3
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)    # as under nohup
    try:
        with process.stopping() as handled:
            assert handled == [signal.SIGTERM] and signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_ctrl_z_stops_the_script_with_the_command_and_fg_resumes_both(tmp_path: Path) -> None:
    """The script has a session of its own, so the terminal's Ctrl-Z reaches the command only:
    the command stops the script too, and a SIGCONT (fg, bg) resumes both."""
    script = tmp_path / "ticks.py"
    script.write_text(textwrap.dedent("""\
        import os, sys, time
        out = sys.argv[1]
        with open(os.path.join(out, "pids"), "w") as f:
            f.write(str(os.getpid()))
        for i in range(6000):
            with open(os.path.join(out, "ticks"), "w") as f:
                f.write(str(i))
            time.sleep(0.01)
    """))
    proc = start_ampatch("run", "--", "python", str(script), str(tmp_path), cwd=tmp_path, output=subprocess.DEVNULL)
    try:
        (script_pid,) = wait_for(tmp_path / "pids", proc)
        proc.send_signal(signal.SIGTSTP)
        assert wait_state(proc.pid, "T") and wait_state(script_pid, "T")
        proc.send_signal(signal.SIGCONT)
        assert wait_state(proc.pid, "S", "R") and wait_state(script_pid, "S", "R")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        proc.kill()
    assert all_gone([script_pid])


def wait_state(pid: int, *states: str, within_s: float = 30.0) -> bool:
    """Whether ``pid`` reaches one of ``states`` (``/proc/PID/stat``: T stopped, S sleeping, R running)."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rpartition(")")[2].split()[0] in states:
                return True
        time.sleep(0.02)
    return False
