"""The ``ampatch`` command: parsing, and one ``cmd_*`` function per subcommand (with its
``add_*`` parser entry in ``SUBCOMMANDS``). The only place in ampatch that prints.

``compare`` trains a built-in workload, or the script after ``--``, once per opt level and
prints one table (``ampatch.compare`` does the work); ``run`` runs a script once, forced to a
level, with ``--apex-alias`` making its Apex imports load ampatch. Exit codes: the runs' (1
when a level failed), 2 for a usage error, 130 after Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from ampatch import levels as levels_policy
from ampatch.cliargs import (HALF_OPTION, KEEP_FP32_HELP, LEVELS, budget, module_names, opt_level, opt_levels,
                             positive, threads)
from ampatch.compare import UsageError, builtin, runner
from ampatch.compare.budget import DEFAULT_BUDGET_S, TARGET_STEPS
from ampatch.compare.plot import write_plot
from ampatch.compare.rows import common_steps, summarize
from ampatch.compare.sizing import sizes_in_words
from ampatch.compare.table import format_table, interrupted_note, machine_of, write_json
from ampatch.diagnose import command as diagnosis
from ampatch.keep import parse_names
from ampatch.diagnose.child import DEFAULT_STEPS as DIAGNOSE_STEPS
from ampatch.diagnose.render import render, write_plot as write_diagnosis_plot
from ampatch.workloads import DEFAULT_STEPS, DEFAULT_WORKLOAD, SIZES, WORKLOADS

WORKLOAD_OPTIONS = ("steps", "workload", "device", "threads", "size")  # and --budget: see _compare_script


class CliError(UsageError):
    """A usage error: reported as one ``ampatch: error:`` line, exit code 2 (as is every
    `UsageError` the compare package raises)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise CliError(message)


def add_compare(sub: argparse._SubParsersAction, half: dict) -> None:
    cmp = sub.add_parser("compare", help="train once per opt level and print one table",
                         usage="ampatch compare [options] [-- python train.py ARGS...]")
    cmp.add_argument("--levels", type=opt_levels, default=list(LEVELS),
                     help="comma-separated opt levels (default: O0,O1,O2,O3,O4,O5)")
    cmp.add_argument("--steps", type=positive,
                     help=f"steps per run (built-in workloads only; default {DEFAULT_STEPS[DEFAULT_WORKLOAD]}, "
                          "within the budget)")
    cmp.add_argument("--budget", type=budget, metavar="TIME", default=argparse.SUPPRESS,
                     help=f"time for the whole comparison, e.g. 120s or 3m, or none (built-in workloads only; "
                          f"default {DEFAULT_BUDGET_S:g}s, or none when --steps is given): each level gets a share "
                          "of what is left, weighted by its expected step cost, and stops early when it runs out; "
                          "later levels run at most as many steps as the earlier ones, so the losses compare "
                          "step for step")
    cmp.add_argument("--size", choices=(builtin.AUTO, *SIZES), metavar="SIZE",
                     help=f"size of the built-in workload: {builtin.AUTO} (default: a few seconds of calibration "
                          f"pick the largest where every level runs >= {TARGET_STEPS} steps in the budget, or its "
                          f"--steps in about {DEFAULT_BUDGET_S:g}s without one), or {', '.join(SIZES)}, each about "
                          f"4x the compute of the one before ({DEFAULT_WORKLOAD}: {sizes_in_words(DEFAULT_WORKLOAD)})")
    cmp.add_argument("--workload", choices=WORKLOADS, help=f"built-in workload (default: {DEFAULT_WORKLOAD})")
    cmp.add_argument("--device", help="device for the built-in workloads: auto (default: CUDA when "
                     "available, else CPU), cpu, cuda, cuda:1, ...")
    cmp.add_argument("--threads", type=threads, metavar="N",
                     help=f"torch threads of the built-in workloads (default {builtin.DEFAULT_THREADS}: stable "
                          "timings on a shared machine; 0: torch's default)")
    cmp.add_argument("--json", metavar="PATH", help="write all rows, loss curves included")
    cmp.add_argument("--plot", metavar="PATH", help="write a PNG of loss curves and loss scale")
    cmp.add_argument("--half-dtype", **half)
    cmp.add_argument("--keep-fp32", type=module_names, metavar="NAMES", help=KEEP_FP32_HELP)
    cmp.set_defaults(func=cmd_compare)


def add_run(sub: argparse._SubParsersAction, half: dict) -> None:
    run = sub.add_parser("run", help="run a script once, optionally forced to one opt level",
                         usage="ampatch run [--opt-level LEVEL] [--apex-alias] [options] -- python train.py ARGS")
    run.add_argument("--opt-level", type=opt_level, default=None,
                     help="force every amp.initialize to this level (default: the script's own level)")
    run.add_argument("--half-dtype", **half)
    run.add_argument("--keep-fp32", type=module_names, metavar="NAMES", help=KEEP_FP32_HELP)
    run.add_argument("--report", metavar="PATH", help="write the run's report() JSON here")
    run.add_argument("--apex-alias", action="store_true",
                     help="make 'from apex import amp' (and apex.parallel, apex.optimizers, ...) in the "
                          "script load ampatch")
    run.set_defaults(func=cmd_run)


def add_diagnose(sub: argparse._SubParsersAction, half: dict) -> None:
    diag = sub.add_parser("diagnose", help="find where half precision hurts, and verify a fix",
                          usage="ampatch diagnose [options] [-- python train.py ARGS...]")
    diag.add_argument("--opt-level", type=opt_level, default=None,
                      help="the level to diagnose (default: the script's own; O1 for a built-in workload)")
    diag.add_argument("--half-dtype", **half)
    diag.add_argument("--steps", type=positive, default=DIAGNOSE_STEPS,
                      help=f"optimizer steps recorded; each run stops after them (default {DIAGNOSE_STEPS})")
    diag.add_argument("--workload", choices=WORKLOADS, help=f"built-in workload (default: {DEFAULT_WORKLOAD})")
    diag.add_argument("--size", choices=SIZES, default="small", help="size of the built-in workload (default small)")
    diag.add_argument("--keep-fp32", type=module_names, metavar="NAMES",
                      help="modules already kept in FP32: diagnosed, and verified, with them")
    diag.add_argument("--apex-alias", action="store_true", help="the script's Apex imports load ampatch")
    diag.add_argument("--json", metavar="PATH", help="write the diagnosis (every module) as JSON")
    diag.add_argument("--plot", metavar="PATH", help="write a PNG of each module's error and headroom")
    diag.set_defaults(func=cmd_diagnose)


SUBCOMMANDS: dict[str, Callable[[argparse._SubParsersAction, dict], None]] = {
    "compare": add_compare, "run": add_run, "diagnose": add_diagnose}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (the command after ``--`` is split off before parsing)."""
    parser = _Parser(prog="ampatch", description="Automatic mixed precision: compare opt "
                     "levels, or run a training script forced to one level.")
    sub = parser.add_subparsers(dest="subcommand", metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for add in SUBCOMMANDS.values():
        add(sub, HALF_OPTION)
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
            raise CliError(f"choose a command: {' or '.join(SUBCOMMANDS)} (see ampatch --help)")
        args.command = command
        return args.func(args)
    except UsageError as exc:
        print(f"ampatch: error: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    except KeyboardInterrupt:
        return 130


def _check_output_path(path: str | None, option: str) -> None:
    if path and not Path(path).resolve().parent.is_dir():
        raise CliError(f"{option}: directory of {path!r} does not exist")


class Compared(NamedTuple):
    """The runs of a comparison (losses compared before step ``upto``; None: all) and what the
    table and ``--json`` say about them; ``device`` for the machine line if no run reports one."""

    runs: list[runner.LevelRun]
    interrupted: bool
    upto: int | None
    title: str
    header: dict[str, Any]
    notes: list[str]
    device: str


def _compare_script(args: argparse.Namespace) -> Compared:
    given = [f"--{o}" for o in WORKLOAD_OPTIONS if getattr(args, o) is not None]
    given += ["--budget"] if hasattr(args, "budget") else []
    if given:
        raise CliError(f"{'/'.join(given)} apply to the built-in workloads; give your script its own options after --")
    cmd = runner.resolve_command(args.command)
    runs, interrupted = runner.run_all({lv: lambda cap, deadline: cmd for lv in args.levels},
                                       args.half_dtype, sys.stderr, keep_fp32=args.keep_fp32)
    return Compared(runs, interrupted, None, f"ampatch compare: {' '.join(args.command)}",
                    {"command": list(args.command)}, [], "cpu")


def _compare_builtin(args: argparse.Namespace) -> Compared:
    began, workload = time.time(), args.workload or DEFAULT_WORKLOAD
    device = builtin.workload_device(args.device)
    print(builtin.machine_notice(device, args.levels, args.half_dtype), file=sys.stderr, flush=True)
    # an explicit --budget (none included) wins; --steps alone asks for exactly that many steps
    seconds = args.budget if hasattr(args, "budget") else (None if args.steps else DEFAULT_BUDGET_S)
    with builtin.launcher(device, sys.stderr) as launch:
        plan = builtin.plan(workload, levels=args.levels, half_dtype=args.half_dtype, seconds=seconds,
                            steps=args.steps or DEFAULT_STEPS[workload], device=device,
                            threads=builtin.DEFAULT_THREADS if args.threads is None else args.threads,
                            size=args.size or builtin.AUTO, log=sys.stderr, launch=launch, began=began)
        runs, interrupted = runner.run_all(plan.commands(args.levels), args.half_dtype, sys.stderr,
                                           plan.budget, plan.steps, launch, keep_fp32=args.keep_fp32)
    upto = common_steps(runs) if plan.budget is not None else None
    return Compared(runs, interrupted, upto, plan.title(upto), plan.header(), plan.notes(upto), device)


def cmd_compare(args: argparse.Namespace) -> int:
    """``ampatch compare``: one run per level, one table; 1 if any run failed, 130 on Ctrl-C."""
    _check_output_path(args.json, "--json")
    _check_output_path(args.plot, "--plot")
    done = _compare_script(args) if args.command is not None else _compare_builtin(args)
    rows = summarize(done.runs, done.upto)
    machine, note = machine_of(rows, done.device)
    notes = [note or "", *done.notes, interrupted_note(rows, args.levels) if done.interrupted else "",
             f"note: kept in FP32 at every level (--keep-fp32): {args.keep_fp32}" if args.keep_fp32 else ""]
    print(format_table(rows, done.title, machine, notes), flush=True)
    if args.json:
        write_json(args.json, {**done.header, "levels": args.levels, "machine": machine, "keep_fp32": args.keep_fp32,
                               "compared_steps": done.upto, "interrupted": done.interrupted}, rows)
    ok = rows and all(r.ok for r in rows) and len(rows) == len(args.levels)
    code = 130 if done.interrupted else 0 if ok else 1
    if args.plot and rows:
        try:
            write_plot(args.plot, rows, done.title)
        except ImportError:
            print("ampatch: error: --plot needs matplotlib: pip install matplotlib "
                  "(or pip install ampatch[plot])", file=sys.stderr)
            return code or 1
        except (OSError, ValueError) as exc:  # unwritable path, unknown image format
            print(f"ampatch: error: --plot: {exc}", file=sys.stderr)
            return code or 1
    return code


def cmd_run(args: argparse.Namespace) -> int:
    """``ampatch run``: the command's own exit code (128+N when killed by signal N). Without
    ``--opt-level`` the script keeps its own ``opt_level``."""
    cmd = runner.resolve_command(args.command)
    _check_output_path(args.report, "--report")
    if args.half_dtype == "float16" and args.opt_level in levels_policy.BFLOAT16_LEVELS:
        raise CliError(f"{args.opt_level} always uses bfloat16; --half-dtype float16 "
                       "contradicts it (use O1-O3 for float16)")
    env = runner.child_env(args.opt_level, args.half_dtype,
                           str(Path(args.report).resolve()) if args.report else None, keep_fp32=args.keep_fp32)
    if args.apex_alias:
        env = runner.with_apex_alias(env)
    returncode = subprocess.run(cmd, env=env).returncode
    return 128 - returncode if returncode < 0 else returncode


def cmd_diagnose(args: argparse.Namespace) -> int:
    """``ampatch diagnose``: 0 once diagnosed (whatever it found), 1 when the script gave nothing
    to diagnose (it crashed first, or never trained under amp), 2 for a usage error."""
    _check_output_path(args.json, "--json")
    _check_output_path(args.plot, "--plot")
    if args.command is not None:
        if args.workload:
            raise CliError("--workload and a script after -- exclude each other")
        cmd, level, shown = runner.resolve_command(args.command), args.opt_level, " ".join(args.command)
    else:
        workload = args.workload or DEFAULT_WORKLOAD
        cmd = [sys.executable, "-m", f"ampatch.workloads.{workload}", "--size", args.size, "--threads", "1",
               "--steps", str(args.steps)]
        level, shown = args.opt_level or "O1", f"built-in workload {workload} ({args.size})"
    req = diagnosis.Request(cmd, level, args.half_dtype, args.steps, args.apex_alias, tuple(parse_names(args.keep_fp32 or "")))
    try:
        result = diagnosis.diagnose(req, sys.stderr)
    except diagnosis.RunFailed as exc:
        print(f"ampatch diagnose: {exc}", file=sys.stderr)
        return 1
    print(render(result, shown), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        try:
            write_diagnosis_plot(args.plot, result, f"ampatch diagnose: {shown}")
        except ImportError:
            print("ampatch: error: --plot needs matplotlib: pip install ampatch[plot]", file=sys.stderr)
            return 1
    return 0
