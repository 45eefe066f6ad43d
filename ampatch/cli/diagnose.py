"""``ampatch diagnose``: its options, and the command that diagnoses a script or a built-in
workload (``ampatch.diagnose`` does the work) and prints the diagnosis."""

from __future__ import annotations

import argparse
import json
import sys

from ampatch.cli.common import (
    CliError,
    add_level_options,
    budget,
    check_fp8_levels,
    check_half_dtype,
    check_output_path,
    fp8_recipe,
    positive,
)
from ampatch.config.values import parse_names
from ampatch.diagnose import command as diagnosis
from ampatch.diagnose.render import render
from ampatch.diagnose.render import write_plot as write_diagnosis_plot
from ampatch.errors import reason
from ampatch.record.child import DEFAULT_STEPS as DIAGNOSE_STEPS
from ampatch.runs import runner
from ampatch.runs.builtin import workload_device
from ampatch.runs.longer import DEFAULT_BUDGET_S
from ampatch.workloads import DEFAULT_WORKLOAD, SIZES, WORKLOADS


def add_diagnose(sub: argparse._SubParsersAction, half: dict) -> None:
    diag = sub.add_parser("diagnose", help="find where half precision hurts, and verify a fix",
                          usage="ampatch diagnose [options] [-- python train.py ARGS...]")
    add_level_options(diag, half, "the level to diagnose (default: the script's own; O1 for a built-in workload)",
                      "modules already kept in FP32: diagnosed, and verified, with them",
                      "the script's Apex imports load ampatch")
    diag.add_argument("--steps", type=positive, default=DIAGNOSE_STEPS,
                      help=f"optimizer steps recorded; each run stops after them (default {DIAGNOSE_STEPS})")
    diag.add_argument("--workload", choices=WORKLOADS, help=f"built-in workload (default: {DEFAULT_WORKLOAD})")
    diag.add_argument("--size", choices=SIZES, default="small", help="size of the built-in workload (default small)")
    diag.add_argument("--fp8", type=fp8_recipe, nargs="?", const="tensorwise", metavar="RECIPE",
                      help="run the Linear layers in FP8 with torchao (the fp8 extra; AMPATCH_FP8): tensorwise (the "
                           "default), rowwise or rowwise_with_gw_hp; each converted layer is measured against "
                           "bfloat16 on its own inputs, those FP8 hurts are named and a rerun without them verifies "
                           "it (default level O5 for a built-in workload)")
    diag.add_argument("--budget", type=budget, metavar="TIME", default=DEFAULT_BUDGET_S,
                      help="time for verification runs made longer where the runs cannot tell yet whether the fix "
                           "follows O0 (doubling their steps, as tune does), e.g. 5m (default 10m; none: no limit)")
    diag.add_argument("--json", metavar="PATH", help="write the diagnosis (every module) as JSON")
    diag.add_argument("--plot", metavar="PATH", help="write a PNG of each module's local error against the line where "
                                                     "diagnose would name it, and of its headroom (float16)")
    diag.set_defaults(func=cmd_diagnose)


def cmd_diagnose(args: argparse.Namespace) -> int:
    """``ampatch diagnose``: 0 once diagnosed (whatever it found), 1 when the script gave nothing
    to diagnose (it crashed first, or never trained under amp), 2 for a usage error."""
    check_output_path(args.json, "--json")
    check_output_path(args.plot, "--plot")
    check_half_dtype(args.opt_level, args.half_dtype)
    fp8 = None if args.fp8 in (None, "off") else args.fp8
    if args.fp8 == "off":
        raise CliError("--fp8 off: diagnose --fp8 measures the layers run in FP8; leave --fp8 out to diagnose "
                       "without it")
    if args.command is not None:
        if args.workload:
            raise CliError("--workload and a script after -- exclude each other")
        cmd, level, shown = runner.resolve_command(args.command), args.opt_level, " ".join(args.command)
        rerun = " ".join([*(["--opt-level", level] if level else []),
                          *(["--half-dtype", args.half_dtype] if args.half_dtype else []),
                          *(["--fp8", fp8] if fp8 else []),
                          *(["--apex-alias"] if args.apex_alias else [])])
        rerun = f"ampatch run {rerun + ' ' if rerun else ''}{{options}}-- {shown}"
    else:
        workload = args.workload or DEFAULT_WORKLOAD
        cmd = [sys.executable, "-m", f"ampatch.workloads.{workload}", "--size", args.size, "--threads", "1",
               "--steps", str(args.steps)]
        level, shown = args.opt_level or ("O5" if fp8 else "O1"), f"built-in workload {workload} ({args.size})"
        rerun = None
    if fp8 and level is not None:
        check_fp8_levels([f"{level}+fp8:{fp8}"], args.half_dtype, workload_device(None))  # CUDA if here
    kept = tuple(parse_names(args.keep_fp32 or ""))
    req = diagnosis.Request(cmd, level, args.half_dtype, args.steps, args.apex_alias, kept, fp8, args.budget)
    try:
        result = diagnosis.diagnose(req, sys.stderr)
    except diagnosis.RunFailed as exc:
        print(f"ampatch diagnose: {reason(exc)}", file=sys.stderr)
        return 1
    print(render(result, shown, rerun), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.to_dict(), f, indent=1)
    if args.plot:
        try:
            write_diagnosis_plot(args.plot, result, f"ampatch diagnose: {shown}")
        except ImportError:
            print("ampatch: error: --plot needs matplotlib: pip install ampatch[plot]", file=sys.stderr)
            return 1
    return 0
