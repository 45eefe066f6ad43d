"""Running scripts in child processes: their environment, launch, wait, stop, and what they left.

`run_child` is the general piece: run a command with extra environment variables, each
naming a file where the child writes a JSON at exit (``AMPATCH_REPORT``, ``AMPATCH_DIAGNOSE``),
feed its live "step loss" lines (``AMPATCH_PROGRESS``) to a `Progress`, and collect the JSONs.
`run_level` is one level of a comparison on top of it: forced to the level, its `Report`, and
why it failed in one line. Each child runs in a session of its own and goes with the command
(`process`): a SIGTERM or SIGHUP to the command stops it as Ctrl-C does.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from ampatch.base.dtypes import HALF_NAMES
from ampatch.config import env as envvars
from ampatch.config import levels
from ampatch.config.values import DEFAULT_FP8_RECIPE
from ampatch.errors import reason
from ampatch.runs import UsageError, process
from ampatch.runs.budget import Budget
from ampatch.runs.progress import Progress
from ampatch.session.report import Report
from ampatch.session.witness import Witness

PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])   # the directory that holds ampatch/
APEX_SITE = str(Path(__file__).resolve().parent / "apex_site")  # its sitecustomize aliases apex to ampatch
POLL_S = 0.25            # how often a waiting run's progress file is read
STOP_WAIT_S = 3.0        # each signal that stops a run (SIGINT, SIGTERM, SIGKILL) gets this long to end it
ERROR_LINE_CHARS = 300   # a failure's line is cut to this length
ERROR_LINE = re.compile(r"^[\w.]*(Error|Exception|Interrupt|Exit)\b")
COLLECT = (envvars.REPORT, envvars.WITNESS)   # what a level's run writes at exit: its report, its weights witness


def resolve_command(command: Sequence[str] | None) -> list[str]:
    """The user's command line (after ``--``), checked: ``python``/``python3`` mean this
    interpreter, and a bare ``script.py`` runs with it. Raises `UsageError` when the command,
    its program or its script is missing."""
    if not command:
        raise UsageError("missing command after '--' (e.g. -- python train.py)")
    cmd = list(command)
    if cmd[0] in ("python", "python3"):
        cmd[0] = sys.executable
    elif cmd[0].endswith(".py"):  # a bare script: run it with this interpreter
        cmd.insert(0, sys.executable)
    if shutil.which(cmd[0]) is None:
        raise UsageError(f"command not found: {cmd[0]}")
    if Path(cmd[0]).name.startswith("python"):
        script = python_script(cmd[1:])
        if script is not None and not Path(script).is_file():
            raise UsageError(f"script not found: {script}")
    return cmd


def python_script(args: Sequence[str]) -> str | None:
    """The script a python command line runs, or None (``-m``, ``-c``, stdin)."""
    it = iter(args)
    for arg in it:
        if arg in ("-m", "-c", "-"):
            return None
        if arg in ("-W", "-X", "--check-hash-based-pycs"):
            next(it, None)
        elif not arg.startswith("-"):
            return arg
    return None


def prepend_path(env: dict[str, str], directory: str) -> None:
    """Put ``directory`` first on the child's ``PYTHONPATH``."""
    env["PYTHONPATH"] = os.pathsep.join(p for p in (directory, env.get("PYTHONPATH")) if p)


# what a policy file decides: a run given one does not inherit these from the caller's shell
POLICY_DECIDES = (envvars.OPT_LEVEL, envvars.HALF_DTYPE, envvars.LOSS_SCALE, envvars.KEEP_FP32, envvars.MASTER_WEIGHTS,
                  envvars.OPTIMIZER_STATES)


def child_env(level: str | None, half_dtype: str | None, report: str | None = None,
              base: Mapping[str, str] | None = None, keep_fp32: str | None = None,
              policy: str | None = None, max_steps: int | None = None) -> dict[str, str]:
    """The environment of a run: ``base`` (default: this process's) with the forced level
    (None: the script's own; "O5+kahan": O5 with that master_weights, "O5+fp8:rowwise": O5
    with the script's Linear layers in FP8, ``AMPATCH_FP8``; see `levels.variant`), the half
    type, the report path, the modules to keep in FP32
    (comma-separated names, added to the script's ``keep_fp32``), a policy file
    (``AMPATCH_POLICY``: what it decides is not inherited; `run --policy`, `compare
    --policy` and every `tune` candidate run alike), and ampatch importable."""
    env = dict(os.environ if base is None else base)
    if policy is not None:
        for name in POLICY_DECIDES:
            env.pop(name, None)
        env[envvars.POLICY] = policy
    if level is not None:
        forced = levels.variant(level)
        level = forced.level
        env[envvars.OPT_LEVEL] = level
        if forced.master_weights is not None:
            env[envvars.MASTER_WEIGHTS] = forced.master_weights
        if forced.optimizer_states is not None:
            env[envvars.OPTIMIZER_STATES] = forced.optimizer_states
        if isinstance(forced.fp8, str):  # a recipe
            env[envvars.FP8] = forced.fp8
        elif forced.fp8:  # True: initialize's fp8=True (tensorwise)
            env[envvars.FP8] = "1"
    if keep_fp32:
        env[envvars.KEEP_FP32] = keep_fp32
    if max_steps is not None:
        env[envvars.MAX_STEPS] = str(max_steps)
    if report:
        env[envvars.REPORT] = report
    # O0 has no half type and O4/O5 are bfloat16 by definition
    if half_dtype in HALF_NAMES and (level is None
                                     or (levels.uses_half(level) and levels.fixed_half_dtype(level) is None)):
        env[envvars.HALF_DTYPE] = half_dtype
    elif half_dtype is not None:
        env.pop(envvars.HALF_DTYPE, None)
    site_dirs = {*site.getsitepackages(), site.getusersitepackages()}
    if PACKAGE_ROOT not in site_dirs:  # a source checkout: let the child import this ampatch
        prepend_path(env, PACKAGE_ROOT)
    return env


def with_apex_alias(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the ``sitecustomize`` that makes ``from apex import amp`` load ampatch on
    the child's path (``apex_site/sitecustomize.py``; it then runs the one it shadows)."""
    prepend_path(env, APEX_SITE)
    return env


@dataclass(frozen=True)
class Finished:
    """What a child process left: its exit status, wall time, stderr, and the JSON files it wrote."""

    returncode: int
    wall_s: float
    stderr: str
    outputs: dict[str, Any] = field(default_factory=dict)      # variable -> the JSON written there
    unreadable: dict[str, str] = field(default_factory=dict)   # variable -> why its JSON did not parse


def read_json(path: Path) -> tuple[Any, str | None]:
    """(the JSON in ``path``, None); (None, None) when there is no file; (None, why) when it
    does not parse."""
    if not path.is_file():
        return None, None
    try:
        return json.loads(path.read_text()), None
    except ValueError as exc:
        return None, reason(exc)


Launch = Callable[[Sequence[str], dict[str, str], Path], Any]  # (cmd, env, stderr path) -> a Popen-like handle


def popen(cmd: Sequence[str], env: dict[str, str], stderr: Path) -> subprocess.Popen:
    """Start ``cmd`` as a fresh process in a session of its own (`process.start`), stdin and
    stdout closed, stderr to the file ``stderr``."""
    with open(stderr, "wb") as err:
        return process.start(cmd, env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)


def run_child(cmd: Sequence[str], env: dict[str, str], collect: Sequence[str] = (),
              progress: Progress | None = None, launch: Launch = popen) -> Finished:
    """Run ``cmd`` with ``env`` until it ends (started by ``launch``: a fresh process by
    default, see `forkserver`). For each variable in ``collect`` the child finds a path in it
    where it may write a JSON, which comes back in `Finished.outputs`. With a ``progress``,
    the child's ``AMPATCH_PROGRESS`` lines feed it while it runs. Ctrl-C (KeyboardInterrupt),
    or a SIGTERM or SIGHUP to this process (`process.Stopped`), stops the child with that
    signal first (`stop`), then re-raises; whatever the child started and left running ends
    with it."""
    with tempfile.TemporaryDirectory(prefix="ampatch-") as tmp:
        env = dict(env)
        paths = {name: Path(tmp, f"{name.lower()}.json") for name in collect}
        env.update({name: str(path) for name, path in paths.items()})
        progress_path = Path(tmp, "progress.txt")
        if progress is not None:
            env[envvars.PROGRESS] = str(progress_path)
        else:
            env.pop(envvars.PROGRESS, None)
        err_path = Path(tmp, "stderr.txt")
        with process.stopping():
            start = time.perf_counter()
            proc = launch(cmd, env, err_path)
            try:
                with process.following(proc):
                    wait(proc, progress, progress_path)
            except BaseException as exc:  # Ctrl-C, SIGTERM: the run goes too, then the caller decides
                stop(proc, process.signal_of(exc))
                raise
            finally:
                process.kill_group(proc.pid)
                if progress is not None:
                    progress.close()
        wall_s = time.perf_counter() - start
        outputs, unreadable = {}, {}
        for name, path in paths.items():
            value, error = read_json(path)
            if error is not None:
                unreadable[name] = error
            elif value is not None:
                outputs[name] = value
        return Finished(proc.returncode, wall_s, err_path.read_text(errors="replace"), outputs, unreadable)


def wait(proc: Any, progress: Progress | None, path: Path) -> None:
    """Wait for ``proc``, feeding each new "step loss" line of ``path`` to ``progress``."""
    offset = 0
    while True:
        try:
            proc.wait(timeout=POLL_S)
            done = True
        except subprocess.TimeoutExpired:
            done = False
        if progress is not None:
            if path.is_file():
                with open(path, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
                end = chunk.rfind(b"\n") + 1          # whole lines only
                offset += end
                last = chunk[:end].split()[-2:] if end else []
                if len(last) == 2:
                    try:
                        progress.update(int(last[0]), float(last[1]))
                    except ValueError:
                        pass
            if not done:
                progress.render()
        if done:
            return


def stop(proc: Any, first: int = signal.SIGINT) -> None:
    """End a run that is still going: ``first`` (the signal the command got; SIGINT is what
    Ctrl-C sends), then SIGTERM, then SIGKILL, each to its process group."""
    for sig in dict.fromkeys((first, signal.SIGTERM, signal.SIGKILL)):
        if proc.poll() is not None:
            return
        try:
            proc.send_signal(sig)
            proc.wait(timeout=STOP_WAIT_S)
        except (subprocess.TimeoutExpired, OSError, KeyboardInterrupt):  # a second Ctrl-C escalates
            continue


def failure_line(returncode: int, stderr: str) -> str | None:
    """Why a process failed, in one line; None when it exited 0."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    if returncode != 0:
        return last_error_line(stderr) or f"exit code {returncode}"
    return None


def last_error_line(stderr: str) -> str | None:
    """The exception line of a traceback if there is one, else the last non-empty line."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for line in reversed(lines):
        if ERROR_LINE.match(line):
            return line[:ERROR_LINE_CHARS]
    return lines[-1][:ERROR_LINE_CHARS] if lines else None


@dataclass(frozen=True)
class LevelRun:
    """One level's run: whether it worked (else why not), its report (None: the run wrote
    none, or an unreadable one) and its weights witness (None: it recorded none)."""

    level: str
    ok: bool
    error: str | None
    returncode: int | None
    wall_s: float
    report: Report | None
    witness: Witness | None = field(default=None, kw_only=True)


def run_level(cmd: Sequence[str], level: str, half_dtype: str | None, progress: Progress | None = None,
              launch: Launch = popen, keep_fp32: str | None = None, max_steps: int | None = None) -> LevelRun:
    """Run ``cmd`` forced to ``level`` (and ``keep_fp32``, stopped after ``max_steps``: see
    `child_env`); its report, or why the run failed (see `run_child`)."""
    done = run_child(cmd, child_env(level, half_dtype, keep_fp32=keep_fp32, max_steps=max_steps), collect=COLLECT,
                     progress=progress, launch=launch)
    return level_run(done, level)


def level_run(done: Finished, level: str | None) -> LevelRun:
    """What a finished run forced to ``level`` (None: the script's own, read from its report)
    gave: its report, or why it failed (it crashed, its report is unreadable or missing, it
    ran at another level)."""
    report, error = None, done.unreadable.get(envvars.REPORT)
    if error is None and envvars.REPORT in done.outputs:
        try:
            report = Report.from_dict(done.outputs[envvars.REPORT])
        except ValueError as exc:
            error = reason(exc)
    error = f"unreadable report: {error}" if error is not None else failure_line(done.returncode, done.stderr)
    if error is None:
        if report is None:
            error = "script never called amp.initialize"
        elif level is not None:
            error = _not_as_forced(report, level)
    ran_at = level or (report.opt_level if report is not None else "?")
    witness = None
    if envvars.WITNESS in done.outputs:
        try:
            witness = Witness.from_dict(done.outputs[envvars.WITNESS])
        except ValueError:  # a witness it cannot read is none: the loss still judges
            witness = None
    return LevelRun(ran_at, error is None, error, done.returncode, round(done.wall_s, 3), report, witness=witness)


def _not_as_forced(report: Report, label: str) -> str | None:
    """Why a run forced to ``label`` ("O5+kahan+fp8:rowwise") did not run as it (None: it did)."""
    forced = levels.variant(label)
    if report.opt_level != forced.level:
        return f"ran at {report.opt_level} although {label} was forced"
    if forced.master_weights not in (None, report.master_weights):
        return f"ran with master_weights={report.master_weights!r} although {label} was forced"
    if forced.optimizer_states not in (None, report.optimizer_states):
        return f"ran with optimizer_states={report.optimizer_states!r} although {label} was forced"
    recipe = DEFAULT_FP8_RECIPE if forced.fp8 is True else forced.fp8
    if recipe is not None and report.fp8 != recipe:
        return f"ran with fp8={report.fp8 or None!r} although {label} was forced"
    return None


CommandFor = Callable[[int | None, float | None], list[str]]  # (step cap, deadline) -> a level's command


def run_all(cmd_for: Mapping[str, CommandFor], half_dtype: str | None, log: TextIO,
            budget: Budget | None = None, steps: int | None = None,
            launch: Launch = popen, keep_fp32: str | None = None,
            max_steps: int | None = None) -> tuple[list[LevelRun], int | None]:
    """Run every level in turn: a line on ``log`` when each starts and ends, live progress in
    between. ``cmd_for`` maps a level to the function of (step cap, deadline) that gives its
    command (a user script's ignores both); ``budget`` sets them for the built-in workloads;
    ``keep_fp32`` and ``max_steps`` (a script's ``AMPATCH_MAX_STEPS``) go to every run (see
    `child_env`). Returns the finished runs and the signal
    that stopped the comparison (SIGINT: Ctrl-C; SIGTERM, SIGHUP), None when all ran."""
    runs: list[LevelRun] = []
    start, n = time.perf_counter(), len(cmd_for)
    i, level = 0, ""

    def say(text: str, inside: str = "", after: str = "") -> None:
        log.write(f"[{i}/{n}] {level} {text} (t+{time.perf_counter() - start:.1f}s{inside}){after}\n")
        log.flush()

    try:
        with process.stopping():  # a SIGTERM between two runs stops the comparison too
            for i, (level, make) in enumerate(cmd_for.items(), 1):
                steps_done = [r.report.steps for r in runs if r.ok and r.report is not None]
                cap, deadline = steps if steps is not None else max_steps, None
                if budget is not None:
                    cap, deadline = budget.next_run(list(cmd_for)[i - 1:], [s for s in steps_done if s])
                total, expected = cap, False
                if total is None:  # a user script: expect as many steps as the last finished level
                    total = next((s for s in reversed(steps_done) if s is not None), None)
                    expected = total is not None
                say("running", f", up to {cap} steps in {deadline - time.time():.0f}s" if deadline else "")
                progress = Progress(level, total, deadline, stream=log, expected=expected)
                run = run_level(make(cap, deadline), level, half_dtype, progress, launch, keep_fp32, max_steps)
                if budget is not None:
                    budget.ran(progress.start_s(), progress.exit_s(), level, progress.seconds_per_step())
                runs.append(run)
                steps_run = run.report.steps if run.report is not None else None
                say(f"{'ok' if run.ok else 'FAILED'} in {run.wall_s:.1f}s"
                    + (f", {steps_run} steps" if run.ok and steps_run is not None else ""),
                    after="" if run.ok else f": {run.error}")
    except KeyboardInterrupt as exc:  # Ctrl-C, or process.Stopped
        signum = process.signal_of(exc)
        say("interrupted; stopping" if signum == signal.SIGINT else
            f"interrupted by {signal.Signals(signum).name}; stopping")
        return runs, signum
    return runs, None
