"""``ampatch tune``: its options, and the command that calls `ampatch.tune.tune` (the search
for the fastest precision policy that trains like FP32), prints the table and writes the JSON."""

from __future__ import annotations

import argparse
import re
import sys

from ampatch.cli.common import (
    CliError,
    budget,
    check_fp8_levels,
    check_output_path,
    level_variants,
    positive,
    tolerance,
)
from ampatch.config.policy_file import DEFAULT_PATH
from ampatch.errors import reason
from ampatch.runs.builtin import workload_device
from ampatch.runs.deviation import CONFIDENCE, MIN_SHARE, TOLERANCE, WINDOW
from ampatch.tune.candidates import OBJECTIVES
from ampatch.tune.command import DEFAULT_BUDGET_S, DEFAULT_LEVELS, DEFAULT_STEPS, TuneResult
from ampatch.tune.timing import ROUNDS
from ampatch.workloads import DEFAULT_WORKLOAD, SIZES, WORKLOADS

DESCRIPTION = (
    "Find the fastest precision policy whose loss curve stays like O0's, and write it as a policy file. "
    f"The deviation of a candidate is the largest gap between its loss curve and O0's ({WINDOW}-loss means, update "
    "for update), relative to O0's progress over the run (the mean of its first losses minus the mean of its last). "
    "O0 must make progress beyond its own noise (its least-squares trend against the scatter of its loss; a "
    f"one-sided t test at {CONFIDENCE:.0%} confidence) and beyond a few ulps of its loss's dtype. A candidate "
    "qualifies when it is finite, skips no step after the loss scaler's first back-offs, learns between "
    f"{MIN_SHARE:.0%} and {1 / MIN_SHARE:.0%} of what O0 learns at {CONFIDENCE:.0%} confidence (whatever the "
    "tolerance), and deviates by at most the tolerance beyond the noise of its own per-step differences from O0 on "
    "the same batches. Where the loss cannot tell (O0's progress not yet detectable, or a candidate's differences "
    "too noisy for the tolerance), tune runs O0 and those candidates again with twice the steps, within --budget and "
    "as far as the script goes, and asks the weights (a fixed random projection recorded in every run: how far a "
    "candidate's weights went O0's way, and how close they stay). When neither can tell, it says so: exit 1, no "
    "policy file, and --json says why and what would decide (more steps, a wider tolerance).")


def rounds(text: str) -> int:
    """A number of re-timing rounds: 0 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of rounds (0: no re-timing), got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more (0: no re-timing), got {text!r}")
    return value


def add_tune(sub: argparse._SubParsersAction, half: dict) -> None:
    t = sub.add_parser("tune", help="find the fastest precision policy that still trains like FP32",
                       description=DESCRIPTION, usage="ampatch tune [options] [-- python train.py ARGS...]")
    # "-2%" (and "--rounds -1") reach their parsers (which refuse them by name) instead of looking like options
    t._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)%?$")
    t.add_argument("--tolerance", type=tolerance, default=TOLERANCE,
                   help="largest deviation of the loss curve from O0's, relative to what O0 learns over the run "
                        "(its first losses minus its last), beyond the noise of its per-step differences from O0 "
                        "(default 2%%)")
    t.add_argument("--steps", type=positive, default=DEFAULT_STEPS,
                   help=f"optimizer steps per run to start with (default {DEFAULT_STEPS}); runs that cannot tell yet "
                        "are made longer, doubling, within --budget and as far as the script goes")
    t.add_argument("--budget", type=budget, metavar="TIME", default=DEFAULT_BUDGET_S,
                   help="time for the whole search, recorded repair runs included, e.g. 10m (default 10m; none: "
                        "no limit)")
    t.add_argument("--levels", type=level_variants, default=list(DEFAULT_LEVELS),
                   help=f"levels to try (default {','.join(DEFAULT_LEVELS)}); O5+fp8 adds O5 with each of torchao's "
                        "FP8 recipes (the fp8 extra), O5+fp8:rowwise that one, judged like every level; where FP8 is "
                        "only emulated (every CPU; CUDA below capability 8.9) they are listed with their fidelity but "
                        "never chosen for speed; where it runs on tensor cores, O5's are tried by default")
    t.add_argument("--half-dtype", **half)
    t.add_argument("--out", metavar="PATH", default=DEFAULT_PATH,
                   help=f"the policy file to write (default {DEFAULT_PATH})")
    t.add_argument("--json", metavar="PATH", help="write every candidate, the measure and the outcome (chosen, cannot "
                                                   "tell, no reference) with its reason as JSON, whatever the outcome")
    t.add_argument("--plot", metavar="PATH", help="write a PNG: each candidate's speed-up (or bytes per parameter) "
                                                  "against its deviation, the tolerance, failures with their reason, "
                                                  "the chosen one named")
    t.add_argument("--workload", choices=WORKLOADS, help=f"built-in workload (default: {DEFAULT_WORKLOAD})")
    t.add_argument("--size", choices=SIZES, help="size of the built-in workload (default: large for lm)")
    t.add_argument("--device", help="device the built-in workload trains on, or your script does: what decides the "
                                     "half dtypes worth trying (default: CUDA when available)")
    t.add_argument("--no-repair", action="store_true", help="do not repair failed candidates")
    t.add_argument("--rounds", type=rounds, default=ROUNDS, metavar="N",
                   help=f"interleaved re-timing rounds of the fastest qualifying candidates against O0, each run "
                        f"judged again (default {ROUNDS}; 0: none)")
    t.add_argument("--apex-alias", action="store_true", help="the script's Apex imports load ampatch")
    t.add_argument("--objective", choices=OBJECTIVES, default="speed",
                   help="what to minimise among the policies that train like FP32: speed (default: the fastest), "
                        "or memory (the fewest bytes per trained parameter for weights, masters and optimizer "
                        "state; also tries master_weights='stochastic' and 'kahan', bfloat16 without FP32 masters)")
    t.set_defaults(func=cmd_tune)


def cmd_tune(args: argparse.Namespace) -> int:
    """``ampatch tune``: 0 once a policy is chosen (O0 included), 1 when the runs cannot tell
    (no policy file; the JSON says why and what would decide) or the reference run fails, is
    unsound (the script crashes, never calls scale_loss, its O0 loss is not finite or
    diverges) or makes no detectable progress ("run more steps"), 2 for bad input, 128+N when
    stopped by signal N. ``--json`` is written for every outcome but bad input."""
    from ampatch.tune import NoReference, tune

    check_output_path(args.out, "--out")
    check_output_path(args.json, "--json")
    check_output_path(args.plot, "--plot")
    if args.command is not None and (args.workload or args.size):
        raise CliError("--workload/--size apply to the built-in workloads; give your script its own options after --")
    check_fp8_levels(args.levels, args.half_dtype, workload_device(args.device))
    try:
        result = tune(args.command, workload=args.workload, size=args.size, device=args.device, levels=args.levels,
                      half_dtype=args.half_dtype, tolerance=args.tolerance, steps=args.steps, budget=args.budget,
                      out=args.out, repair=not args.no_repair, rounds=args.rounds, apex_alias=args.apex_alias,
                      log=sys.stderr, objective=args.objective)
    except NoReference as exc:
        print(f"ampatch tune: {reason(exc)}", file=sys.stderr)
        if args.json and isinstance(exc.result, TuneResult):
            exc.result.write_json(args.json)
        return 1
    print(result.render(), flush=True)
    if args.json:
        result.write_json(args.json)
    if args.plot:
        try:
            result.write_plot(args.plot)
        except ImportError:
            print("ampatch: error: --plot needs matplotlib: pip install ampatch[plot]", file=sys.stderr)
            return 1
    if result.interrupted is not None:
        return 128 + result.interrupted
    return 1 if result.cannot_tell else 0
