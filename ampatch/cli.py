"""The ``ampatch`` command: compare opt levels on a workload or any script, or force one level.

``ampatch compare`` runs a training script once per opt level, each in a fresh process
forced to that level through ``AMPATCH_OPT_LEVEL``, collects the JSON report each run
writes to ``AMPATCH_REPORT`` at exit, and prints one table. ``ampatch run`` runs a script
once, forced to a level with ``--opt-level`` and with ``--apex-alias`` making its Apex
imports load ampatch. This module is the only place in ampatch that prints.
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
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from ampatch import levels as _levels_policy
from ampatch.workloads import DEFAULT_STEPS, DEFAULT_WORKLOAD, WORKLOADS

LEVELS = tuple(_levels_policy.LEVELS)
WARMUP_FRACTION = 0.2                  # share of step times skipped before the median
FINAL_LOSS_WINDOW = 5                  # "final loss" is the mean of this many last losses
PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)


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
    cmp.add_argument("--steps", type=_positive, help="steps per run (built-in workloads only)")
    cmp.add_argument("--workload", choices=WORKLOADS,
                     help=f"built-in workload (default: {DEFAULT_WORKLOAD})")
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
        env["AMPATCH_OPT_LEVEL"] = level
    if report:
        env["AMPATCH_REPORT"] = report
    # O0 has no half type and O4/O5 are bfloat16 by definition
    if half_dtype in ("bfloat16", "float16") and level != "O0" and level not in _levels_policy.BFLOAT16_LEVELS:
        env["AMPATCH_HALF_DTYPE"] = half_dtype
    elif half_dtype is not None:
        env.pop("AMPATCH_HALF_DTYPE", None)
    site_dirs = {*site.getsitepackages(), site.getusersitepackages()}
    if PACKAGE_ROOT not in site_dirs:  # a source checkout: let the child import this ampatch
        _prepend_path(env, PACKAGE_ROOT)
    return env


def _prepend_path(env: dict[str, str], directory: str) -> None:
    env["PYTHONPATH"] = os.pathsep.join(p for p in (directory, env.get("PYTHONPATH")) if p)


def run_level(cmd: Sequence[str], level: str, half_dtype: str | None) -> dict[str, Any]:
    """Run ``cmd`` forced to ``level``; the report it wrote, or why the run failed."""
    with tempfile.TemporaryDirectory(prefix="ampatch-") as tmp:
        report_path, err_path = Path(tmp, "report.json"), Path(tmp, "stderr.txt")
        start = time.perf_counter()
        with open(err_path, "wb") as err:
            proc = subprocess.run(cmd, env=child_env(level, half_dtype, str(report_path)),
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
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


def run_all(cmd_for: dict[str, list[str]], half_dtype: str | None) -> list[dict[str, Any]]:
    """Run every level in turn with one progress line per start and finish on stderr."""
    rows, start, n = [], time.perf_counter(), len(cmd_for)
    for i, (level, cmd) in enumerate(cmd_for.items(), 1):
        print(f"[{i}/{n}] {level} running (t+{time.perf_counter() - start:.1f}s)",
              file=sys.stderr, flush=True)
        try:
            row = run_level(cmd, level, half_dtype)
        except KeyboardInterrupt:
            print(f"[{i}/{n}] {level} interrupted; stopping", file=sys.stderr)
            break
        print(f"[{i}/{n}] {level} {'ok' if row['ok'] else 'FAILED'} in {row['wall_s']:.1f}s "
              f"(t+{time.perf_counter() - start:.1f}s)" + ("" if row["ok"] else f": {row['error']}"),
              file=sys.stderr, flush=True)
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- summary

def summarize(row: dict[str, Any], baseline: dict[str, Any] | None) -> dict[str, Any]:
    """Add the table's numbers (and the curves) to a run's row; ``baseline`` is O0's row."""
    rep = row["report"] or {}
    times = rep.get("step_times_s") or []
    losses = [float(x) if x is not None else math.nan for x in rep.get("losses") or []]
    steady = times[int(len(times) * WARMUP_FRACTION):] or times
    row["half_dtype"] = None if row["level"] == "O0" else rep.get("half_dtype")
    row["median_step_ms"] = 1000 * statistics.median(steady) if steady else None
    row["peak_memory_mib"] = rep["peak_memory_bytes"] / 2**20 \
        if rep.get("peak_memory_bytes") else None
    tail = losses[-FINAL_LOSS_WINDOW:]
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
    pairs = list(zip(losses, baseline["losses"])) if base_ok else []
    row["max_loss_dev_vs_O0"] = max((abs(a - b) if math.isfinite(a - b) else math.inf
                                     for a, b in pairs), default=None)
    return row


def summarize_all(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Summarize O0 first (the baseline), then every other row."""
    base = next((r for r in rows if r["level"] == "O0"), None)
    if base is not None:  # its own numbers first; the loop then compares it with itself
        summarize(base, None)
    for row in rows:
        summarize(row, base)
    return rows


COLUMNS = [("level", "level", "{}"), ("half dtype", "half_dtype", "{}"),
           ("step ms", "median_step_ms", "{:.1f}"), ("speed-up", "speedup_vs_O0", "{:.2f}x"),
           ("peak MiB", "peak_memory_mib", "{:.0f}"), ("final loss", "final_loss", "{:.4f}"),
           ("max dev vs O0", "max_loss_dev_vs_O0", "{:.3g}"),
           ("skipped", "skipped_steps", "{}"), ("loss scale", "final_loss_scale", "{:g}")]


def _cell(row: dict[str, Any], key: str, fmt: str) -> str:
    value = row.get(key)
    if key == "skipped_steps":
        value = len(value or [])
    return "-" if value is None else fmt.format(value)


def format_table(rows: list[dict[str, Any]], title: str) -> str:
    """The comparison table with its footnotes, as text."""
    ok = [[_cell(r, key, fmt) for _, key, fmt in COLUMNS] for r in rows if r["ok"]]
    widths = [max([len(h)] + [len(c[i]) for c in ok]) for i, (h, _, _) in enumerate(COLUMNS)]

    def line(cells: list[str]) -> str:  # two text columns left-aligned, numbers right
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))

    out = [title, line([h for h, _, _ in COLUMNS])]
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
    return "\n".join(out)


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
    """``ampatch compare``: one run per level, one table; 1 if any run failed."""
    _check_output_path(args.json, "--json")
    _check_output_path(args.plot, "--plot")
    if args.command is not None:
        if args.steps is not None or args.workload is not None:
            raise CliError("--steps/--workload apply to the built-in workloads; "
                           "give your script its own options after --")
        cmd = resolve_command(args.command)
        cmd_for = {level: cmd for level in args.levels}
        header: dict[str, Any] = {"command": list(args.command)}
        title = f"ampatch compare: {' '.join(args.command)}"
    else:
        workload = args.workload or DEFAULT_WORKLOAD
        steps = args.steps or DEFAULT_STEPS[workload]
        cmd_for = {level: [sys.executable, "-m", f"ampatch.workloads.{workload}",
                           "--steps", str(steps), "--opt-level", level]
                   for level in args.levels}
        header = {"workload": workload, "steps": steps}
        title = f"ampatch compare: workload {workload}, {steps} steps"
    rows = summarize_all(run_all(cmd_for, args.half_dtype))
    print(format_table(rows, title), flush=True)
    if args.json:
        write_json(args.json, {**header, "levels": args.levels}, rows)
    code = 0 if rows and all(r["ok"] for r in rows) and len(rows) == len(cmd_for) else 1
    if args.plot:
        try:
            write_plot(args.plot, rows, title)
        except ImportError:
            print("ampatch: error: --plot needs matplotlib: pip install matplotlib "
                  "(or pip install ampatch[plot])", file=sys.stderr)
            return 1
        except (OSError, ValueError) as exc:  # unwritable path, unknown image format
            print(f"ampatch: error: --plot: {exc}", file=sys.stderr)
            return 1
    return code


@contextmanager
def apex_alias(env: dict[str, str]) -> Iterator[None]:
    """Put a ``sitecustomize`` on the child's path that aliases ``apex.amp`` to ampatch."""
    try:
        from ampatch import compat
        compat.install_apex_alias  # noqa: B018 - fail here, not in the child
    except (ImportError, AttributeError) as exc:
        raise CliError(f"--apex-alias needs ampatch.compat.install_apex_alias, which this "
                       f"ampatch does not provide ({exc})") from None
    with tempfile.TemporaryDirectory(prefix="ampatch-apex-") as tmp:
        Path(tmp, "sitecustomize.py").write_text(SITECUSTOMIZE)
        env["AMPATCH_APEX_ALIAS"] = "1"
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
    if args.half_dtype == "float16" and args.opt_level in ("O4", "O5"):
        raise CliError(f"{args.opt_level} always uses bfloat16; --half-dtype float16 "
                       "contradicts it (use O1-O3 for float16)")
    env = child_env(args.opt_level, args.half_dtype,
                    str(Path(args.report).resolve()) if args.report else None)
    with apex_alias(env) if args.apex_alias else nullcontext():
        returncode = subprocess.run(cmd, env=env).returncode
    return 128 - returncode if returncode < 0 else returncode
