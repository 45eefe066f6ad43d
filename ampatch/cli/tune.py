"""``ampatch tune``: its options, and the command that searches for the fastest precision
policy that trains like FP32 (``ampatch.tune`` does the work), prints the table and writes
the policy file."""

from __future__ import annotations

import argparse
import re
import sys
from contextlib import nullcontext

from ampatch.cli.common import CliError, budget, check_output_path, opt_levels, positive
from ampatch.config.policy_file import DEFAULT_PATH
from ampatch.runs import builtin, runner
from ampatch.workloads import DEFAULT_WORKLOAD, SIZES, WORKLOADS

DEFAULT_STEPS = 40
DEFAULT_BUDGET_S = 600.0
DEFAULT_SIZE = {"lm": "large", "cnn": "medium", "lstm": "medium"}


def tolerance(text: str) -> float:
    """"2%", "0.02" -> 0.02; refuses a negative, zero or unparsable tolerance."""
    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"must be above 0 (a relative deviation such as 2% or 0.02), got {text!r}")
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(%?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a relative deviation such as 2% or 0.02, got {text!r}")
    value = float(m.group(1)) / (100 if m.group(2) else 1)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be above 0 (a relative deviation such as 2% or 0.02), got {text!r}")
    return value


def add_tune(sub: argparse._SubParsersAction, half: dict) -> None:
    t = sub.add_parser("tune", help="find the fastest precision policy that still trains like FP32",
                       usage="ampatch tune [options] [-- python train.py ARGS...]")
    # "-2%" reaches `tolerance` (which refuses it by name) instead of looking like an option to argparse
    t._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)%?$")
    t.add_argument("--tolerance", type=tolerance, default=0.02,
                   help="largest deviation of the loss curve from O0's, relative (default 2%%)")
    t.add_argument("--steps", type=positive, default=DEFAULT_STEPS,
                   help=f"optimizer steps per run (default {DEFAULT_STEPS})")
    t.add_argument("--budget", type=budget, metavar="TIME", default=DEFAULT_BUDGET_S,
                   help="time for the whole search, e.g. 10m (default 10m; none: no limit)")
    t.add_argument("--levels", type=opt_levels, default=["O1", "O2", "O3", "O4", "O5"],
                   help="levels to try (default O1,O2,O3,O4,O5)")
    t.add_argument("--half-dtype", **half)
    t.add_argument("--out", metavar="PATH", default=DEFAULT_PATH,
                   help=f"the policy file to write (default {DEFAULT_PATH})")
    t.add_argument("--json", metavar="PATH", help="write every candidate and the choice as JSON")
    t.add_argument("--workload", choices=WORKLOADS, help=f"built-in workload (default: {DEFAULT_WORKLOAD})")
    t.add_argument("--size", choices=SIZES, help="size of the built-in workload (default: large for lm)")
    t.add_argument("--device", help="device the built-in workload trains on, or your script does: what decides the "
                                     "half dtypes worth trying (default: CUDA when available)")
    t.add_argument("--no-repair", action="store_true", help="do not repair failed candidates")
    t.add_argument("--rounds", type=int, default=2, metavar="N",
                   help="interleaved re-timing rounds of the fastest qualifying candidates against O0 (default 2; "
                        "0: none)")
    t.add_argument("--apex-alias", action="store_true", help="the script's Apex imports load ampatch")
    t.set_defaults(func=cmd_tune)


def cmd_tune(args: argparse.Namespace) -> int:
    """``ampatch tune``: 0 once a policy is chosen (O0 included), 1 when the reference run
    fails (the script crashes, or never calls scale_loss), 2 for bad input, 130 on Ctrl-C."""
    from ampatch.config.policy_file import save
    from ampatch.tune import candidates, report
    from ampatch.tune.measure import Job
    from ampatch.tune.search import NoReference, Search

    check_output_path(args.out, "--out")
    check_output_path(args.json, "--json")
    half = None if args.half_dtype in (None, "auto") else args.half_dtype
    if args.command is not None:
        if args.workload or args.size:
            raise CliError("--workload/--size apply to the built-in workloads; give your script its own options "
                           "after --")
        cmd = runner.resolve_command(args.command)
        # the device the script trains on, as far as this machine tells (what candidates are worth trying)
        device, what = builtin.workload_device(args.device), " ".join(args.command)
        job_cmd = lambda steps: list(cmd)  # noqa: E731 - AMPATCH_MAX_STEPS stops it
        rerun = f"ampatch run --policy {{policy}} -- {what}"
    else:
        workload = args.workload or DEFAULT_WORKLOAD
        device = builtin.workload_device(args.device)
        size = args.size or DEFAULT_SIZE[workload]
        what = f"built-in workload {workload} ({size}, {device}, 1 torch thread)"
        base = [sys.executable, "-m", f"ampatch.workloads.{workload}", "--device", device, "--threads", "1",
                "--size", size, "--seed", "0"]
        job_cmd = lambda steps: base + ["--steps", str(steps)]  # noqa: E731
        rerun = f"ampatch run --policy {{policy}} -- python -m ampatch.workloads.{workload} --size {size} --threads 1"
    cands = candidates.initial(args.levels, device, half)
    print(builtin.machine_notice(device, ["O0", *args.levels], half), file=sys.stderr, flush=True)
    budget_text = "no budget" if args.budget is None else f"a {args.budget:g}s budget"
    print(f"ampatch tune: {what}: O0, then {len(cands)} candidate(s), {args.steps} steps each, repairs and "
          f"re-timing, within {budget_text}; tolerance {args.tolerance:.2%}", file=sys.stderr, flush=True)
    script = args.command is not None
    started = nullcontext(runner.popen) if script else builtin.launcher(device, sys.stderr)
    try:
        with started as launch:
            job = Job(job_cmd, args.steps, launch, args.apex_alias, script)
            result = Search(job, cands, args.tolerance, args.budget, sys.stderr, repair=not args.no_repair,
                            rounds=args.rounds).run()
    except NoReference as exc:
        print(f"ampatch tune: {exc}", file=sys.stderr)
        return 1
    out = None if result.interrupted is not None else args.out
    print(report.render(result, f"ampatch tune: {what}, {args.steps} steps per run", out, rerun), flush=True)
    if out:
        save(report.policy_of(result, args.steps, what, device), out)
    if args.json:
        report.write_json(args.json, result)
    return 128 + result.interrupted if result.interrupted is not None else 0
