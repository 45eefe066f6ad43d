"""``ampatch compare``: its options, and the command that runs the levels (``ampatch.runs``
and ``ampatch.compare`` do the work) and prints the table."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Any, NamedTuple

from ampatch.cli.common import (
    KEEP_FP32_HELP,
    LEVELS,
    CliError,
    budget,
    check_fp8_levels,
    check_output_path,
    level_variants,
    module_names,
    optimizer_states,
    policy_path,
    positive,
    threads,
    tolerance,
    with_states,
)
from ampatch.compare.plot import write_plot
from ampatch.compare.table import format_table, interrupted_note, judge_rows, machine_of, write_json
from ampatch.runs import builtin, process, runner
from ampatch.runs.budget import DEFAULT_BUDGET_S, TARGET_STEPS
from ampatch.runs.deviation import TOLERANCE
from ampatch.runs.sizing import sizes_in_words
from ampatch.runs.stats import common_steps, summarize
from ampatch.workloads import DEFAULT_STEPS, DEFAULT_WORKLOAD, SIZES, WORKLOADS

WORKLOAD_OPTIONS = ("workload", "device", "threads", "size")  # and --budget: see compare_script


def add_compare(sub: argparse._SubParsersAction, half: dict) -> None:
    cmp = sub.add_parser("compare", help="train once per opt level and print one table",
                         usage="ampatch compare [options] [-- python train.py ARGS...]")
    cmp.add_argument("--levels", type=level_variants, default=list(LEVELS),
                     help="comma-separated opt levels (default: O0,O1,O2,O3,O4,O5); a level that casts the model "
                          "may carry a low-memory master mode: O5+stochastic, O5+kahan (master_weights); any level "
                          "the precision of its optimizer's state: O5+int8, O1+bfloat16 (optimizer_states); a level "
                          "that computes in bfloat16 or FP32 may run its Linear layers in FP8 with torchao (the fp8 "
                          "extra): O5+fp8 (tensorwise), O5+fp8:rowwise, O5+fp8:rowwise_with_gw_hp (emulated where "
                          "the GPU has no FP8 tensor cores: numerics only, not speed)")
    cmp.add_argument("--steps", type=positive,
                     help=f"optimizer steps per run (a built-in workload: default {DEFAULT_STEPS[DEFAULT_WORKLOAD]}, "
                          "within the budget; a script: it stops after them, AMPATCH_MAX_STEPS, as tune's and "
                          "diagnose's runs do; default: as many as it runs)")
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
    cmp.add_argument("--tolerance", type=tolerance, default=TOLERANCE,
                     help="the tolerance of the verdict column, as tune's --tolerance (default 2%%)")
    cmp.add_argument("--json", metavar="PATH", help="write all rows, loss curves and verdicts included")
    cmp.add_argument("--plot", metavar="PATH", help="write a PNG: each level's deviation from O0 over the steps with "
                                                    "its noise and the tolerance, speed-up and memory per level, and "
                                                    "the loss scale where it moves")
    cmp.add_argument("--half-dtype", **half)
    cmp.add_argument("--keep-fp32", type=module_names, metavar="NAMES", help=KEEP_FP32_HELP)
    cmp.add_argument("--optimizer-states", type=optimizer_states, metavar="PRECISION",
                     help="keep every level's optimizer state in this precision: float32, bfloat16 or int8 (a level "
                          "that names its own, O5+int8, keeps it; O0 stays the FP32 reference)")
    cmp.add_argument("--policy", type=policy_path, metavar="PATH",
                     help="add a row for a policy file (ampatch tune --out), run as `ampatch run --policy` runs it")
    cmp.set_defaults(func=cmd_compare)


class Compared(NamedTuple):
    """The runs of a comparison (losses compared before step ``upto``; None: all) and what the
    table and ``--json`` say about them; ``device`` for the machine line if no run reports one."""

    runs: list[runner.LevelRun]
    interrupted: int | None    # the signal that stopped the comparison (SIGINT: Ctrl-C)
    upto: int | None
    title: str
    header: dict[str, Any]
    notes: list[str]
    device: str


def compare_script(args: argparse.Namespace) -> Compared:
    given = [f"--{o}" for o in WORKLOAD_OPTIONS if getattr(args, o) is not None]
    given += ["--budget"] if hasattr(args, "budget") else []
    if given:
        raise CliError(f"{'/'.join(given)} apply to the built-in workloads; give your script its own options after --")
    cmd = runner.resolve_command(args.command)
    check_fp8_levels(args.levels, args.half_dtype, builtin.workload_device(None))
    runs, interrupted = runner.run_all({lv: lambda cap, deadline: cmd for lv in args.levels},
                                       args.half_dtype, sys.stderr, keep_fp32=args.keep_fp32, max_steps=args.steps)
    if args.policy and not interrupted:
        interrupted = with_policy_row(runs, lambda: policy_run(cmd, args.policy, args.keep_fp32,
                                                               max_steps=args.steps))
    title = f"ampatch compare: {' '.join(args.command)}" + (f", {args.steps} steps per run" if args.steps else "")
    return Compared(runs, interrupted, None, title, {"command": list(args.command), "steps": args.steps}, [], "cpu")


def compare_builtin(args: argparse.Namespace) -> Compared:
    began, workload = time.time(), args.workload or DEFAULT_WORKLOAD
    device = builtin.workload_device(args.device)
    check_fp8_levels(args.levels, args.half_dtype, device)
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
        if args.policy and not interrupted:
            steps = common_steps(runs) or plan.steps
            interrupted = with_policy_row(runs, lambda: policy_run(plan.commands(["O0"])["O0"](steps, None),
                                                                   args.policy, args.keep_fp32, launch))
    upto = common_steps(runs) if plan.budget is not None else None
    return Compared(runs, interrupted, upto, plan.title(upto), plan.header(), plan.notes(upto), device)


def with_policy_row(runs: list[runner.LevelRun], run: Any) -> int | None:
    """Append the ``--policy`` row that ``run()`` measures; a Ctrl-C or SIGTERM/SIGHUP during it
    returns its signal (the table of the finished levels is still printed), else None."""
    try:
        runs.append(run())
    except KeyboardInterrupt as exc:
        return process.signal_of(exc)
    return None


def policy_run(cmd: list[str], policy: str, keep_fp32: str | None,
               launch: runner.Launch = runner.popen, max_steps: int | None = None) -> runner.LevelRun:
    """The ``--policy`` row: ``cmd`` run with ``AMPATCH_POLICY`` (the policy's level, not a forced
    one), labelled ``policy:LEVEL``; a script stops after ``max_steps``."""
    print(f"[policy] running with {policy}", file=sys.stderr, flush=True)
    env = runner.child_env(None, None, keep_fp32=keep_fp32, policy=policy, max_steps=max_steps)
    done = runner.run_child(cmd, env, collect=runner.COLLECT, launch=launch)
    run = runner.level_run(done, None)
    print(f"[policy] {'ok' if run.ok else 'FAILED: ' + str(run.error)} in {run.wall_s:.1f}s", file=sys.stderr,
          flush=True)
    return dataclasses.replace(run, level=f"policy:{run.level}")


def cmd_compare(args: argparse.Namespace) -> int:
    """``ampatch compare``: one run per level, one table; 1 if any run failed, 130 on Ctrl-C
    (128+N when signal N stopped it)."""
    check_output_path(args.json, "--json")
    check_output_path(args.plot, "--plot")
    args.levels = with_states(args.levels, args.optimizer_states)
    done = compare_script(args) if args.command is not None else compare_builtin(args)
    rows = summarize(done.runs, done.upto)
    verdicts = judge_rows(rows, args.tolerance, done.upto)
    machine, note = machine_of(rows, done.device)
    notes = [note or "", *done.notes, interrupted_note(rows, args.levels) if done.interrupted is not None else "",
             f"note: kept in FP32 at every level (--keep-fp32): {args.keep_fp32}" if args.keep_fp32 else ""]
    print(format_table(rows, done.title, machine, notes, verdicts, args.tolerance), flush=True)
    if args.json:
        write_json(args.json, {**done.header, "levels": args.levels, "machine": machine, "keep_fp32": args.keep_fp32,
                               "compared_steps": done.upto, "interrupted": done.interrupted is not None,
                               "tolerance": args.tolerance}, rows, verdicts)
    ok = rows and all(r.ok for r in rows) and len(rows) == len(args.levels) + bool(args.policy)
    code = 128 + done.interrupted if done.interrupted is not None else 0 if ok else 1
    if args.plot and rows:
        try:
            write_plot(args.plot, rows, done.title, verdicts, args.tolerance, done.upto)
        except ImportError:
            print("ampatch: error: --plot needs matplotlib: pip install matplotlib "
                  "(or pip install ampatch[plot])", file=sys.stderr)
            return code or 1
        except (OSError, ValueError) as exc:  # unwritable path, unknown image format
            print(f"ampatch: error: --plot: {exc}", file=sys.stderr)
            return code or 1
    return code
