"""The ``ampatch`` command: compare opt levels on a workload or any script, or force one level.

``ampatch compare`` runs a training script once per opt level, each in a fresh process
forced to that level through ``AMPATCH_OPT_LEVEL``, collects the JSON report each run
writes to ``AMPATCH_REPORT`` at exit, and prints one table under the machine line
(``hardware``). While a level runs, its steps and loss arrive through ``AMPATCH_PROGRESS``
and show as a live line; on the built-in workloads a time budget (``Budget``) sets each
level's deadline and step cap. Ctrl-C prints the levels that finished. ``ampatch run`` runs a
script once, forced to a level with ``--opt-level`` and with ``--apex-alias`` making its
Apex imports load ampatch. This module is the only place in ampatch that prints.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import site
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from ampatch import hardware
from ampatch import levels as _levels_policy
from ampatch import env as envvars
from ampatch.dtypes import short_name
from ampatch.workloads import DEFAULT_STEPS, DEFAULT_WORKLOAD, WORKLOADS

LEVELS = tuple(_levels_policy.LEVELS)
WARMUP_FRACTION = 0.2                  # share of step times skipped before the median
FINAL_LOSS_WINDOW = 5                  # "final loss" is the mean of this many last losses
PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)
DEFAULT_BUDGET_S = 120.0               # built-in workloads: the whole compare, start-ups included
# One torch thread by default: on a shared 2-core machine two threads waiting on each other's
# barrier made the lm workload's O0 step 8x slower (2.6 s against 0.34 s with one).
DEFAULT_THREADS = 1
FEW_STEPS = 20                         # below this many compared steps, the table says it is thin


class CliError(Exception):
    """A usage error: reported as one ``ampatch: error:`` line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise CliError(message)


# ----------------------------------------------------------------------------- arguments

def _level(text: str) -> str:
    level = text.strip().upper()
    if level not in LEVELS:
        raise argparse.ArgumentTypeError(
            f"unknown opt level {text!r} (choose from {', '.join(LEVELS)})")
    return level


def _levels(text: str) -> list[str]:
    levels = [_level(t) for t in re.split(r"[,\s]+", text) if t]
    if not levels:
        raise argparse.ArgumentTypeError("no opt level given")
    return list(dict.fromkeys(levels))


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _threads(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"--threads must be 0 (torch's default) or a positive number, got {text!r}")
    return int(text)


def _budget(text: str) -> float | None:
    """Seconds: ``120``, ``120s``, ``2m``, ``1.5min``; ``none``/``0``/``off`` for no budget."""
    t = text.strip().lower()
    if t in ("none", "off", "0", "0s"):
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(s|sec|m|min)?", t)
    if not m or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"expected a time such as 120, 120s or 2m (or none), got {text!r}")
    return float(m.group(1)) * (60 if m.group(2) in ("m", "min") else 1)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (the command after ``--`` is split off before parsing)."""
    parser = _Parser(prog="ampatch", description="Automatic mixed precision: compare opt "
                     "levels, or run a training script forced to one level.")
    sub = parser.add_subparsers(dest="subcommand", metavar="{compare,run}")
    half = dict(choices=("auto", "bfloat16", "float16"), default=None,
                help="half type for O1-O3 (default and 'auto': float16 on CUDA, bfloat16 "
                     "elsewhere; O4/O5 always use bfloat16)")

    cmp = sub.add_parser("compare", help="train once per opt level and print one table",
                         usage="ampatch compare [options] [-- python train.py ARGS...]")
    cmp.add_argument("--levels", type=_levels, default=list(LEVELS),
                     help="comma-separated opt levels (default: O0,O1,O2,O3,O4,O5)")
    cmp.add_argument("--steps", type=_positive,
                     help="steps per run (built-in workloads only; default "
                          f"{DEFAULT_STEPS[DEFAULT_WORKLOAD]}, within the budget)")
    cmp.add_argument("--budget", type=_budget, metavar="TIME", default=argparse.SUPPRESS,
                     help=f"time for the whole comparison, e.g. 120s or 3m, or none (built-in workloads "
                          f"only; default {DEFAULT_BUDGET_S:g}s, or none when --steps is given): each level "
                          "gets a share of what is left, weighted by its expected step cost, and stops "
                          "early when it runs out; later levels run at most as many steps as the earlier "
                          "ones, so the losses compare step for step")
    cmp.add_argument("--workload", choices=WORKLOADS,
                     help=f"built-in workload (default: {DEFAULT_WORKLOAD})")
    cmp.add_argument("--device", help="device for the built-in workloads: auto (default: CUDA when "
                     "available, else CPU), cpu, cuda, cuda:1, ...")
    cmp.add_argument("--threads", type=_threads, metavar="N",
                     help=f"torch threads of the built-in workloads (default {DEFAULT_THREADS}: stable "
                          "timings on a shared machine; 0: torch's default)")
    cmp.add_argument("--json", metavar="PATH", help="write all rows, loss curves included")
    cmp.add_argument("--plot", metavar="PATH", help="write a PNG of loss curves and loss scale")
    cmp.add_argument("--half-dtype", **half)
    cmp.set_defaults(func=cmd_compare)

    run = sub.add_parser("run", help="run a script once, optionally forced to one opt level",
                         usage="ampatch run [--opt-level LEVEL] [--apex-alias] [options] -- python train.py ARGS")
    run.add_argument("--opt-level", type=_level, default=None,
                     help="force every amp.initialize to this level (default: the script's own level)")
    run.add_argument("--half-dtype", **half)
    run.add_argument("--report", metavar="PATH", help="write the run's report() JSON here")
    run.add_argument("--apex-alias", action="store_true",
                     help="make 'from apex import amp' (and apex.parallel, apex.optimizers, ...) in the "
                          "script load ampatch")
    run.set_defaults(func=cmd_run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ampatch`` command; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # The user's command goes after the first "--", untouched by argparse.
    cut = argv.index("--") if "--" in argv else len(argv)
    options, command = argv[:cut], (argv[cut + 1:] if cut < len(argv) else None)
    try:
        args = build_parser().parse_args(options)
        if args.subcommand is None:
            raise CliError("choose a command: compare or run (see ampatch --help)")
        args.command = command
        return args.func(args)
    except CliError as exc:
        print(f"ampatch: error: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    except KeyboardInterrupt:
        return 130


def resolve_command(command: Sequence[str] | None) -> list[str]:
    """Check the user's command; ``python``/``python3`` mean this interpreter."""
    if not command:
        raise CliError("missing command after '--' (e.g. -- python train.py)")
    cmd = list(command)
    if cmd[0] in ("python", "python3"):
        cmd[0] = sys.executable
    elif cmd[0].endswith(".py"):  # a bare script: run it with this interpreter
        cmd.insert(0, sys.executable)
    if shutil.which(cmd[0]) is None:
        raise CliError(f"command not found: {cmd[0]}")
    if Path(cmd[0]).name.startswith("python"):
        script = _python_script(cmd[1:])
        if script is not None and not Path(script).is_file():
            raise CliError(f"script not found: {script}")
    return cmd


def _python_script(args: Sequence[str]) -> str | None:
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


def _check_output_path(path: str | None, option: str) -> None:
    if path and not Path(path).resolve().parent.is_dir():
        raise CliError(f"{option}: directory of {path!r} does not exist")


# ----------------------------------------------------------------------------- running

def child_env(level: str | None, half_dtype: str | None, report: str | None) -> dict[str, str]:
    """The environment of a run: the forced level (None: the script's own), half type,
    report path, ampatch importable."""
    env = dict(os.environ)
    if level is not None:
        env[envvars.OPT_LEVEL] = level
    if report:
        env[envvars.REPORT] = report
    # O0 has no half type and O4/O5 are bfloat16 by definition
    if half_dtype in ("bfloat16", "float16") and level != "O0" and level not in _levels_policy.BFLOAT16_LEVELS:
        env[envvars.HALF_DTYPE] = half_dtype
    elif half_dtype is not None:
        env.pop(envvars.HALF_DTYPE, None)
    site_dirs = {*site.getsitepackages(), site.getusersitepackages()}
    if PACKAGE_ROOT not in site_dirs:  # a source checkout: let the child import this ampatch
        _prepend_path(env, PACKAGE_ROOT)
    return env


def _prepend_path(env: dict[str, str], directory: str) -> None:
    env["PYTHONPATH"] = os.pathsep.join(p for p in (directory, env.get("PYTHONPATH")) if p)


def run_level(cmd: Sequence[str], level: str, half_dtype: str | None,
              progress: "Progress | None" = None) -> dict[str, Any]:
    """Run ``cmd`` forced to ``level``; the report it wrote, or why the run failed.

    The run appends "step loss" per optimizer step to a file (``AMPATCH_PROGRESS``), which
    `progress` shows while it runs. On KeyboardInterrupt the run is stopped, then it re-raises.
    """
    with tempfile.TemporaryDirectory(prefix="ampatch-") as tmp:
        report_path, err_path = Path(tmp, "report.json"), Path(tmp, "stderr.txt")
        progress_path = Path(tmp, "progress.txt")
        env = child_env(level, half_dtype, str(report_path))
        env[envvars.PROGRESS] = str(progress_path)
        start = time.perf_counter()
        with open(err_path, "wb") as err:
            proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=err)
            try:
                _wait(proc, progress, progress_path)
            except BaseException:  # Ctrl-C: the run goes too, then the caller decides
                _stop(proc)
                raise
            finally:
                if progress is not None:
                    progress.close()
        row: dict[str, Any] = {"level": level, "ok": False, "error": None,
                               "returncode": proc.returncode,
                               "wall_s": round(time.perf_counter() - start, 3), "report": None}
        if report_path.is_file():
            try:
                row["report"] = json.loads(report_path.read_text())
            except ValueError as exc:
                row["error"] = f"unreadable report: {exc}"
        stderr = err_path.read_text(errors="replace")
    row["error"] = row["error"] or _failure(proc.returncode, stderr, row["report"], level)
    row["ok"] = row["error"] is None
    return row


def _wait(proc: subprocess.Popen, progress: "Progress | None", path: Path) -> None:
    """Wait for ``proc``, feeding each new "step loss" line of ``path`` to ``progress``."""
    offset, poll = 0, 0.25
    while True:
        try:
            proc.wait(timeout=poll)
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


def _stop(proc: subprocess.Popen) -> None:
    """End a run that is still going: SIGINT (what Ctrl-C sends), then SIGTERM, then SIGKILL."""
    for send in (lambda: proc.send_signal(signal.SIGINT), proc.terminate, proc.kill):
        if proc.poll() is not None:
            return
        try:
            send()
            proc.wait(timeout=3.0)
        except (subprocess.TimeoutExpired, OSError, KeyboardInterrupt):  # a second Ctrl-C escalates
            continue


class Progress:
    """The live line of the running level on stderr: bar, step, loss, time per step, ETA.

    On a terminal the line is redrawn in place (a few times a second); elsewhere (a log, a
    pipe) one line is printed every ``log_every_s`` seconds. ``total`` is the expected number
    of steps (None: unknown); ``deadline`` a time.time() by which the run stops (its budget).
    """

    def __init__(self, label: str, total: int | None = None, deadline: float | None = None,
                 stream: TextIO | None = None, log_every_s: float = 10.0, expected: bool = False) -> None:
        self.label, self.total, self.deadline, self.expected = label, total, deadline, expected
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = 0.2 if self.tty else log_every_s
        self.start = time.perf_counter()
        self.last_shown = self.start
        self.step, self.loss = 0, math.nan
        self.seen: deque[tuple[float, int]] = deque(maxlen=20)   # (time, step) as steps arrive
        self.drawn = False
        self.closed_at: float | None = None

    def update(self, step: int, loss: float) -> None:
        if step != self.step:
            self.seen.append((time.perf_counter(), step))
        self.step, self.loss = step, loss

    def start_s(self) -> float | None:
        """Seconds from the launch to the first step seen (None: no step seen)."""
        return self.seen[0][0] - self.start if self.seen else None

    def exit_s(self) -> float | None:
        """Seconds from the last step seen to the end of the run (None: no step seen)."""
        return self.closed_at - self.seen[-1][0] if self.seen and self.closed_at else None

    def seconds_per_step(self) -> float | None:
        if len(self.seen) < 2:
            return None
        (t0, s0), (t1, s1) = self.seen[0], self.seen[-1]
        return (t1 - t0) / (s1 - s0) if s1 > s0 else None

    def eta(self) -> float | None:
        rate = self.seconds_per_step()
        left = None
        if rate is not None and self.total is not None:
            left = max(0, self.total - self.step) * rate
        if self.deadline is not None:
            until = max(0.0, self.deadline - time.time())
            left = until if left is None else min(left, until)
        return left

    def line(self) -> str:
        parts = [f"  {self.label}"]
        eta = self.eta()
        if self.total:
            done = min(1.0, self.step / self.total)
            if eta is not None and self.step:  # a deadline may end it before the last step
                spent = time.perf_counter() - self.start
                done = max(done, spent / (spent + eta) if spent + eta > 0 else 1.0)
            filled = int(done * 20)
            bar = "=" * filled + (">" if filled < 20 else "") + " " * (19 - filled)
            parts.append(f"[{bar}] {self.step}/{'~' if self.expected else ''}{self.total}")
        else:
            parts.append(f"step {self.step}")
        if self.step:
            parts.append(f"loss {self.loss:.4f}")
        rate = self.seconds_per_step()
        if rate is not None:
            parts.append(f"{rate:.2f} s/step")
        parts.append(f"ETA {_clock(eta)}" if eta is not None and self.step
                     else f"{_clock(time.perf_counter() - self.start)} elapsed")
        return "  ".join(parts)

    def render(self, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self.last_shown < self.every:
            return
        self.last_shown = now
        if self.tty:
            self.stream.write("\r" + self.line() + "\x1b[K")
            self.drawn = True
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Remove the live line (terminal), so the level's result line replaces it."""
        self.closed_at = time.perf_counter()
        if self.tty and self.drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


def _failure(returncode: int, stderr: str, report: dict | None, level: str) -> str | None:
    """Why a run failed, in one line; None when it did not."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    if returncode != 0:
        return _last_error_line(stderr) or f"exit code {returncode}"
    if report is None:
        return "script never called amp.initialize"
    if report.get("opt_level") != level:
        return f"ran at {report.get('opt_level')} although {level} was forced"
    return None


def _last_error_line(stderr: str) -> str | None:
    """The exception line of a traceback if there is one, else the last non-empty line."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for line in reversed(lines):
        if re.match(r"^[\w.]*(Error|Exception|Interrupt|Exit)\b", line):
            return line[:300]
    return lines[-1][:300] if lines else None


@dataclass
class Budget:
    """A time budget for the whole comparison of a built-in workload.

    Each level gets a share of the time left: its start-up and exit, plus a part of the rest
    in proportion to its weight (the expected cost of one of its steps: 1 for O0, more for a
    half level where the half dtype is emulated); a level that ends early leaves its rest to
    the later ones. A level runs at most as many steps as the levels before it, so every
    level runs (about) the same number of steps and the losses compare step for step. The
    workload itself stops before its share ends (``--deadline``), timing its own steps.
    """

    seconds: float
    max_steps: int
    weights: dict[str, float] = field(default_factory=dict)  # level -> relative cost of a step
    clock: Callable[[], float] = time.time  # wall clock shared with the runs (their --deadline)
    start_s: float = 4.0  # a run's time from launch to its first step's end (imports, build); learnt
    exit_s: float = 1.0   # a run's time from its last step to its exit (report, teardown); learnt
    start: float = field(init=False)

    def __post_init__(self) -> None:
        self.start = self.clock()

    def next_run(self, levels: Sequence[str], steps_done: Sequence[int]) -> tuple[int, float]:
        """(step cap, time.time() deadline for its last step) for ``levels[0]``, the next of
        the levels still to run."""
        now = self.clock()
        left = max(0.0, self.start + self.seconds - now)
        fixed = self.start_s + self.exit_s
        spare = max(0.0, left - fixed * len(levels))
        weights = [self.weights.get(level, 1.0) for level in levels]
        share = fixed + spare * weights[0] / sum(weights)
        return min([self.max_steps, *steps_done]), now + share - self.exit_s

    def ran(self, start_s: float | None, exit_s: float | None) -> None:
        """Learn from a finished run: its start-up (the latest counts) and exit (the slowest)."""
        if start_s is not None:
            self.start_s = start_s
        if exit_s is not None:
            self.exit_s = max(self.exit_s, exit_s)


CommandFor = Callable[[int | None, float | None], list[str]]  # (step cap, deadline) -> a level's command


def run_all(cmd_for: dict[str, CommandFor], half_dtype: str | None,
            budget: Budget | None = None, steps: int | None = None) -> tuple[list[dict[str, Any]], bool]:
    """Run every level in turn: a line on stderr when each starts and ends, live progress in
    between. ``cmd_for`` maps a level to the function of (step cap, deadline) that gives its
    command (a user script's ignores both). Returns the finished rows and whether Ctrl-C
    stopped it."""
    rows: list[dict[str, Any]] = []
    start, n = time.perf_counter(), len(cmd_for)
    i, level = 0, ""
    try:
        for i, (level, make) in enumerate(cmd_for.items(), 1):
            cap, deadline = steps, None
            if budget is not None:
                done = [r["report"].get("steps") for r in rows if r["ok"] and r["report"]]
                cap, deadline = budget.next_run(list(cmd_for)[i - 1:], [s for s in done if s])
            cmd = make(cap, deadline)
            total, expected = cap, False
            if total is None:  # a user script: expect as many steps as the last finished level
                total = next((r["report"].get("steps") for r in reversed(rows) if r["ok"] and r["report"]),
                             None)
                expected = total is not None
            share = f", up to {cap} steps in {deadline - time.time():.0f}s" if deadline else ""
            print(f"[{i}/{n}] {level} running (t+{time.perf_counter() - start:.1f}s{share})",
                  file=sys.stderr, flush=True)
            progress = Progress(level, total, deadline, expected=expected)
            row = run_level(cmd, level, half_dtype, progress)
            if budget is not None:
                budget.ran(progress.start_s(), progress.exit_s())
            steps_run = (row["report"] or {}).get("steps")
            rows.append(row)
            print(f"[{i}/{n}] {level} {'ok' if row['ok'] else 'FAILED'} in {row['wall_s']:.1f}s"
                  + (f", {steps_run} steps" if row["ok"] and steps_run is not None else "")
                  + f" (t+{time.perf_counter() - start:.1f}s)" + ("" if row["ok"] else f": {row['error']}"),
                  file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print(f"[{i}/{n}] {level} interrupted; stopping (t+{time.perf_counter() - start:.1f}s)",
              file=sys.stderr, flush=True)
        return rows, True
    return rows, False


# ----------------------------------------------------------------------------- summary

def summarize(row: dict[str, Any], baseline: dict[str, Any] | None,
              upto: int | None = None) -> dict[str, Any]:
    """Add the table's numbers (and the curves) to a run's row; ``baseline`` is O0's row.
    ``upto``: final loss and deviation from the losses before that step only (a budget let the
    levels run different numbers of steps: they compare at the step all of them reached).
    Losses compare at the same step, also where a long run's curve was thinned more than the
    baseline's (``losses_every``)."""
    rep = row["report"] or {}
    times = rep.get("step_times_s") or []
    losses = [float(x) if x is not None else math.nan for x in rep.get("losses") or []]
    at = _losses_by_step(losses, rep.get("losses_every") or 1, upto)
    steady = times[int(len(times) * WARMUP_FRACTION):] or times
    row["half_dtype"] = None if row["level"] == "O0" else rep.get("half_dtype")
    row["steps"] = rep.get("steps")
    row["median_step_ms"] = 1000 * statistics.median(steady) if steady else None
    row["peak_memory_mib"] = rep["peak_memory_bytes"] / 2**20 \
        if rep.get("peak_memory_bytes") else None
    tail = list(at.values())[-FINAL_LOSS_WINDOW:]
    row["final_loss"] = sum(tail) / len(tail) if tail else None
    row["losses"] = losses
    row["losses_every"] = rep.get("losses_every") or 1  # a long run's curve is thinned
    row["loss_scale_history"] = rep.get("loss_scale_history") or {}
    row["step_times_s"] = times
    row["skipped_steps"] = rep.get("skipped_steps") or []
    row["final_loss_scale"] = (rep.get("loss_scale") or {}).get("loss_scaler0")
    base_ok = baseline is not None and baseline["ok"]
    base_ms = baseline.get("median_step_ms") if base_ok else None
    row["speedup_vs_O0"] = base_ms / row["median_step_ms"] \
        if base_ms and row["median_step_ms"] else None
    base_at = _losses_by_step(baseline["losses"], baseline["losses_every"], upto) if base_ok else {}
    pairs = [(loss, base_at[step]) for step, loss in at.items() if step in base_at]
    row["max_loss_dev_vs_O0"] = max((abs(a - b) if math.isfinite(a - b) else math.inf
                                     for a, b in pairs), default=None)
    return row


def summarize_all(rows: list[dict[str, Any]], upto: int | None = None) -> list[dict[str, Any]]:
    """Summarize O0 first (the baseline), then every other row (see `summarize` for upto)."""
    base = next((r for r in rows if r["level"] == "O0"), None)
    if base is not None:  # its own numbers first; the loop then compares it with itself
        summarize(base, None, upto)
    for row in rows:
        summarize(row, base, upto)
    return rows


def _losses_by_step(losses: Sequence[float], every: int, upto: int | None) -> dict[int, float]:
    """{step: loss} of a (thinned: ``losses[i]`` is step ``i * every``) loss curve, before ``upto``."""
    return {i * every: loss for i, loss in enumerate(losses) if upto is None or i * every < upto}


def common_steps(rows: list[dict[str, Any]]) -> int | None:
    """The number of steps whose loss every finished run recorded (None without any): the
    steps before the last recorded loss of the shortest run, that one included."""
    counts = [(len(rep.get("losses") or []) - 1) * (rep.get("losses_every") or 1) + 1
              for rep in (r["report"] or {} for r in rows if r["ok"])]
    return min(counts) if counts else None


COLUMNS = [("level", "level", "{}"), ("half dtype", "half_dtype", "{}"),
           ("step ms", "median_step_ms", "{:.1f}"), ("speed-up", "speedup_vs_O0", "{:.2f}x"),
           ("peak MiB", "peak_memory_mib", "{:.0f}"), ("final loss", "final_loss", "{:.4f}"),
           ("max dev vs O0", "max_loss_dev_vs_O0", "{:.3g}"),
           ("skipped", "skipped_steps", "{}"), ("loss scale", "final_loss_scale", "{:g}"),
           ("steps", "steps", "{}")]


def _cell(row: dict[str, Any], key: str, fmt: str) -> str:
    value = row.get(key)
    if key == "skipped_steps":
        value = len(value or [])
    return "-" if value is None else fmt.format(value)


def format_table(rows: list[dict[str, Any]], title: str, machine: str | None = None,
                 notes: Sequence[str] = ()) -> str:
    """The comparison table with its footnotes, as text: title, the machine line (device,
    torch, half dtype native or not), the table, the footnotes, then ``notes``."""
    ok = [[_cell(r, key, fmt) for _, key, fmt in COLUMNS] for r in rows if r["ok"]]
    widths = [max([len(h)] + [len(c[i]) for c in ok]) for i, (h, _, _) in enumerate(COLUMNS)]

    def line(cells: list[str]) -> str:  # two text columns left-aligned, numbers right
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))

    out = [title] + ([f"machine: {machine}"] if machine else []) + [line([h for h, _, _ in COLUMNS])]
    cells = iter(ok)
    for row in rows:
        out.append(line(next(cells)) if row["ok"]
                   else f"{row['level'].ljust(widths[0])}  FAILED: {row['error']}")
    out += ["",
            f"step ms: median wall time per optimizer step, first {WARMUP_FRACTION:.0%} "
            "of steps skipped as warm-up; speed-up is relative to O0.",
            f"final loss: mean of the last {FINAL_LOSS_WINDOW} losses (all, if fewer); "
            "max dev: largest |loss - O0 loss| at the same step.",
            "peak MiB: CUDA max allocated when the run used CUDA, else the process's peak RSS."]
    out += [textwrap.fill(n, width=100, subsequent_indent="  ", break_on_hyphens=False) for n in notes if n]
    return "\n".join(out)


def machine_of(rows: list[dict[str, Any]], fallback: str = "cpu") -> tuple[str, str | None]:
    """The machine line and the slow-half note for the table, from the runs' reports (the
    device each script trained on); from ``fallback`` here when no report says."""
    device = next((r["report"]["device"] for r in rows if r["ok"] and (r["report"] or {}).get("device")), None)
    if device is None:
        device = hardware.describe(fallback).to_dict()
    dtypes = list(dict.fromkeys(r["half_dtype"] for r in rows if r["ok"] and r.get("half_dtype")))
    return hardware.machine_line(device, dtypes), hardware.slow_half_note(device, dtypes)


# ----------------------------------------------------------------------------- outputs

def write_json(path: str, header: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """All rows, with loss curves, loss-scale history and the full reports."""
    Path(path).write_text(json.dumps({**header, "rows": rows}, indent=1) + "\n")


def write_plot(path: str, rows: list[dict[str, Any]], title: str) -> None:
    """Two panels: loss per step, loss scale per step (log y). Needs matplotlib."""
    from matplotlib.figure import Figure  # optional dependency: ampatch[plot]

    fig = Figure(figsize=(12, 4.5), layout="constrained")
    ax_loss, ax_scale = fig.subplots(1, 2)
    for i, row in enumerate(r for r in rows if r["ok"]):
        style = dict(label=row["level"], ls=("-", "--", "-.", ":")[i % 4], lw=1.2)
        every = row.get("losses_every", 1)
        ax_loss.plot(range(0, len(row["losses"]) * every, every), row["losses"], **style)
        points = sorted(map(tuple, row["loss_scale_history"].get("loss_scaler0", [])))
        if points:
            last = max((len(row["losses"]) - 1) * every, points[-1][0])
            xs, ys = zip(*points, (last, points[-1][1]))
            ax_scale.step(xs, ys, where="post", **style)
    ax_loss.set(title="loss", xlabel="step", ylabel="loss")
    ax_scale.set(title="loss scale (loss_scaler0)", xlabel="step", yscale="log")
    for ax in (ax_loss, ax_scale):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)


# ----------------------------------------------------------------------------- commands

def cmd_compare(args: argparse.Namespace) -> int:
    """``ampatch compare``: one run per level, one table; 1 if any run failed, 130 on Ctrl-C."""
    _check_output_path(args.json, "--json")
    _check_output_path(args.plot, "--plot")
    budget, upto, fallback = None, None, "cpu"
    if args.command is not None:
        given = [o for o, v in (("--steps", args.steps), ("--workload", args.workload),
                                ("--device", args.device), ("--threads", args.threads)) if v is not None]
        given += ["--budget"] if hasattr(args, "budget") else []
        if given:
            raise CliError(f"{'/'.join(given)} apply to the built-in workloads; "
                           "give your script its own options after --")
        cmd = resolve_command(args.command)
        cmd_for: dict[str, CommandFor] = {level: lambda cap, deadline: cmd for level in args.levels}
        header: dict[str, Any] = {"command": list(args.command)}
        title = f"ampatch compare: {' '.join(args.command)}"
        rows, interrupted = run_all(cmd_for, args.half_dtype)
    else:
        workload = args.workload or DEFAULT_WORKLOAD
        steps = args.steps or DEFAULT_STEPS[workload]
        # an explicit --budget (none included) wins; --steps alone asks for exactly that many steps
        seconds = args.budget if hasattr(args, "budget") else (None if args.steps else DEFAULT_BUDGET_S)
        device = _workload_device(args.device)
        fallback = device
        _announce_machine(device, args.levels, args.half_dtype)
        if seconds is not None:
            # this process imported torch and ampatch as each run will: its CPU time so far is the
            # first guess of a run's start-up (exec keeps it; the runs then teach the real one)
            budget = Budget(seconds, steps, _step_weights(device, args.levels, args.half_dtype),
                            start_s=time.process_time() + FIRST_STEP_S)
        threads = DEFAULT_THREADS if args.threads is None else args.threads
        cmd_for = {level: _workload_command(workload, level, device, threads) for level in args.levels}
        header = {"workload": workload, "steps": steps, "budget_s": seconds, "device": device,
                  "threads": threads}
        rows, interrupted = run_all(cmd_for, args.half_dtype, budget, steps)
        ran = common_steps(rows)
        upto = ran if budget is not None else None
        where = f"{device}, {threads} torch thread{'s' if threads != 1 else ''}" if threads else device
        scope = f"{steps} steps" if budget is None else (
            f"up to {steps} steps in a {seconds:g}s budget"
            + (f" (losses compared over the first {ran} steps)" if ran is not None else ""))
        title = f"ampatch compare: workload {workload} ({where}), {scope}"
    rows = summarize_all(rows, upto)
    machine, note = machine_of(rows, fallback)
    notes = [note or ""]
    if budget is not None and upto is not None and upto < FEW_STEPS:
        notes.append(f"note: the {budget.seconds:g}s budget left time for only {upto} steps per level on this "
                     "machine (busy, or slow for this workload), so warm-up weighs on the step times and the "
                     "losses have barely moved: give it more time (--budget 5m) or fewer levels (--levels O0,O2).")
    if interrupted:
        notes.append(f"interrupted: {len(rows)} of {len(cmd_for)} levels finished "
                     f"({', '.join(r['level'] for r in rows) or 'none'}).")
    print(format_table(rows, title, machine, notes), flush=True)
    if args.json:
        write_json(args.json, {**header, "levels": args.levels, "machine": machine,
                               "compared_steps": upto, "interrupted": interrupted}, rows)
    code = 0 if rows and all(r["ok"] for r in rows) and len(rows) == len(cmd_for) else 1
    if args.plot and rows:
        try:
            write_plot(args.plot, rows, title)
        except ImportError:
            print("ampatch: error: --plot needs matplotlib: pip install matplotlib "
                  "(or pip install ampatch[plot])", file=sys.stderr)
            return 130 if interrupted else 1
        except (OSError, ValueError) as exc:  # unwritable path, unknown image format
            print(f"ampatch: error: --plot: {exc}", file=sys.stderr)
            return 130 if interrupted else 1
    return 130 if interrupted else code


def _workload_device(name: str | None) -> str:
    """The device the built-in workloads train on: ``auto`` (default) is CUDA when available."""
    if name in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        torch.device(name)
    except (RuntimeError, ValueError) as exc:
        raise CliError(f"--device: {exc}") from None
    return name


def _workload_command(workload: str, level: str, device: str, threads: int) -> CommandFor:
    base = [sys.executable, "-m", f"ampatch.workloads.{workload}", "--opt-level", level, "--device", device,
            "--threads", str(threads)]

    def make(steps: int | None, deadline: float | None) -> list[str]:
        return base + ["--steps", str(steps)] + ([] if deadline is None else ["--deadline", f"{deadline:.3f}"])
    return make


FIRST_STEP_S = 1.5  # a run's model build and first (warm-up) step, beyond its imports


SLOW_HALF_WEIGHT = 3.0  # a half level's step against O0's where the half dtype is emulated (measured
                        # 2-3x on the lm workload on an AVX-512 CPU without BF16)


def _half_dtypes(device: str, levels: Sequence[str], half_dtype: str | None) -> dict[str, str]:
    """The half dtype each level will use on ``device`` (O0: none)."""
    return {lv: short_name(_levels_policy.half_dtype_for(lv, device, half_dtype)) for lv in levels if lv != "O0"}


def _step_weights(device: str, levels: Sequence[str], half_dtype: str | None) -> dict[str, float]:
    """Expected cost of a step per level, relative to O0's, for the budget's shares."""
    native = hardware.describe(device).native
    return {lv: SLOW_HALF_WEIGHT if native.get(d) is False else 1.0
            for lv, d in _half_dtypes(device, levels, half_dtype).items()}


def _announce_machine(device: str, levels: Sequence[str], half_dtype: str | None) -> None:
    """Before the runs: the machine line, and a warning when a half dtype they use is emulated."""
    try:
        info = hardware.describe(device).to_dict()
    except (RuntimeError, AssertionError) as exc:  # e.g. cuda asked for on a machine without it
        raise CliError(f"--device {device}: {exc}") from None
    dtypes = list(dict.fromkeys(_half_dtypes(device, levels, half_dtype).values()))
    print(f"machine: {hardware.machine_line(info, dtypes)}", file=sys.stderr)
    slow = [d for d in dtypes if info["native"].get(d) is False]
    if slow:
        print(f"note: {' and '.join(slow)} {'has' if len(slow) == 1 else 'have'} no fast path here: expect "
              "the half levels to be slower than O0 (see the note under the table)", file=sys.stderr)
    sys.stderr.flush()


@contextmanager
def apex_alias(env: dict[str, str]) -> Iterator[None]:
    """Put a ``sitecustomize`` on the child's path that aliases ``apex.amp`` to ampatch."""
    with tempfile.TemporaryDirectory(prefix="ampatch-apex-") as tmp:
        Path(tmp, "sitecustomize.py").write_text(SITECUSTOMIZE)
        _prepend_path(env, tmp)
        yield


SITECUSTOMIZE = '''\
"""Written by `ampatch run --apex-alias`: `from apex import amp` loads ampatch."""
import importlib.machinery, importlib.util, os, sys
import ampatch.compat
ampatch.compat.install_apex_alias()
# Then run the sitecustomize this file shadows, if there is one (under another module
# object: this one is still being imported).
_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _here])
if _spec is not None and _spec.loader is not None:
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
'''


def cmd_run(args: argparse.Namespace) -> int:
    """``ampatch run``: the command's own exit code (128+N when killed by signal N). Without
    ``--opt-level`` the script keeps its own ``opt_level``."""
    cmd = resolve_command(args.command)
    _check_output_path(args.report, "--report")
    if args.half_dtype == "float16" and args.opt_level in _levels_policy.BFLOAT16_LEVELS:
        raise CliError(f"{args.opt_level} always uses bfloat16; --half-dtype float16 "
                       "contradicts it (use O1-O3 for float16)")
    env = child_env(args.opt_level, args.half_dtype,
                    str(Path(args.report).resolve()) if args.report else None)
    with apex_alias(env) if args.apex_alias else nullcontext():
        returncode = subprocess.run(cmd, env=env).returncode
    return 128 - returncode if returncode < 0 else returncode
