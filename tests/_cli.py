"""`ampatch ARGS` run in the test's own process: `cli.main`, what ``python -m ampatch`` runs
(`ampatch/__main__.py` exits with its return value), without an interpreter start of its own
(about 2 s: it imports torch). The runs it starts are real child processes, as from the
command; they inherit this process's file descriptors, so `capfd` reads what they print.

The tests of the real process (its exit status, its signals) keep ``python -m ampatch``:
test_cli.py's test_a_bad_argument_from_the_real_command and Ctrl-C tests, test_runs_signals.py."""
from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping
from pathlib import Path

import pytest

from ampatch import cli

ROOT = Path(__file__).resolve().parents[1]


def ampatch_main(capfd: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, *args: str,
                 cwd: Path | None = None, env: Mapping[str, str | None] | None = None) -> subprocess.CompletedProcess:
    """``ampatch ARGS`` through `cli.main` in this process, as the command would run it from
    ``cwd`` with no inherited AMPATCH_* (plus ``env``; None unsets a variable) and this checkout
    importable by its runs: its exit code and what it (and its runs) printed, as a
    `CompletedProcess`. The environment and working directory are restored afterwards
    (monkeypatch)."""
    for name in [k for k in os.environ if k.startswith("AMPATCH_")]:
        monkeypatch.delenv(name)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(ROOT) not in paths:
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), *paths]))
    for name, value in (env or {}).items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    if cwd is not None:
        monkeypatch.chdir(cwd)
    capfd.readouterr()  # what came before is not this command's
    code = cli.main(list(args))
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(["ampatch", *args], code, out, err)


def as_from_a_terminal() -> None:
    """A `preexec_fn` for a real ``python -m ampatch`` whose signals a test sends: SIGINT,
    SIGHUP and SIGTERM at their defaults, as in a command typed at a terminal. A suite started
    in the background (``cmd &``, ``nohup``) hands its children SIGINT and SIGHUP ignored, and
    the command rightly leaves an ignored signal ignored."""
    for s in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(s, signal.SIG_DFL)
