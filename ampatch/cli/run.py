"""``ampatch run``: one run of a script, forced to a level (or kept at its own), with modules
kept in FP32 or Apex's imports aliased to ampatch."""

from __future__ import annotations

import argparse
from pathlib import Path

from ampatch.cli.common import (
    KEEP_FP32_HELP,
    add_level_options,
    check_half_dtype,
    check_output_path,
    fp8_recipe,
    layer_names,
    loss_scale,
    master_weights,
    optimizer_states,
    policy_path,
)
from ampatch.config import env as envvars
from ampatch.runs import process, runner


def add_run(sub: argparse._SubParsersAction, half: dict) -> None:
    run = sub.add_parser("run", help="run a script once, optionally forced to one opt level",
                         usage="ampatch run [--opt-level LEVEL] [--apex-alias] [options] -- python train.py ARGS")
    add_level_options(run, half, "force every amp.initialize to this level (default: the script's own level)",
                      KEEP_FP32_HELP, "make 'from apex import amp' (and apex.parallel, apex.optimizers, ...) in the "
                      "script load ampatch")
    run.add_argument("--loss-scale", type=loss_scale, metavar="SCALE",
                     help="force the loss scale of every amp.initialize: a number or 'dynamic' (AMPATCH_LOSS_SCALE)")
    run.add_argument("--master-weights", type=master_weights, metavar="MODE",
                     help="force master_weights of every amp.initialize: True, False, stochastic or kahan (the last "
                          "two: a bfloat16 model at O2/O3/O5 without FP32 masters; AMPATCH_MASTER_WEIGHTS)")
    run.add_argument("--optimizer-states", type=optimizer_states, metavar="PRECISION",
                     help="force optimizer_states of every amp.initialize: float32 (the optimizer's own), bfloat16 "
                          "or int8, the precision the optimizer's state is kept in (AMPATCH_OPTIMIZER_STATES)")
    run.add_argument("--fp8", type=fp8_recipe, nargs="?", const="tensorwise", metavar="RECIPE",
                     help="run the script's Linear layers in FP8 with torchao (the fp8 extra): tensorwise (the "
                          "default), rowwise or rowwise_with_gw_hp; 'off' turns off the script's own fp8 "
                          "(AMPATCH_FP8). Emulated where the GPU has no FP8 tensor cores: numerics only, not speed")
    run.add_argument("--fp8-modules", type=layer_names, metavar="NAMES",
                     help="the Linear layers that run in FP8 while fp8 is on: comma-separated names or globs as "
                          "model.named_modules() gives them, replacing the script's own choice "
                          "(AMPATCH_FP8_MODULES; what ampatch diagnose --fp8 recommends)")
    run.add_argument("--policy", type=policy_path, metavar="PATH",
                     help="apply a policy file (ampatch tune --out) to every amp.initialize, over the script's own "
                          "keywords (AMPATCH_POLICY)")
    run.add_argument("--report", metavar="PATH", help="write the run's report() JSON here")
    run.set_defaults(func=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    """``ampatch run``: the command's own exit code (128+N when killed by signal N). Without
    ``--opt-level`` the script keeps its own ``opt_level``. SIGINT, SIGTERM and SIGHUP to
    ``ampatch run`` go on to the script, which ends when it chooses (a checkpoint saved);
    nothing it started outlives ``ampatch run`` (`process.attached`)."""
    cmd = runner.resolve_command(args.command)
    check_output_path(args.report, "--report")
    check_half_dtype(args.opt_level, args.half_dtype)
    env = runner.child_env(args.opt_level, args.half_dtype, str(Path(args.report).resolve()) if args.report else None,
                           keep_fp32=args.keep_fp32, policy=args.policy)
    if args.loss_scale is not None:
        env[envvars.LOSS_SCALE] = args.loss_scale
    if args.master_weights is not None:
        env[envvars.MASTER_WEIGHTS] = args.master_weights
    if args.optimizer_states is not None:
        env[envvars.OPTIMIZER_STATES] = args.optimizer_states
    if args.fp8 is not None:
        env[envvars.FP8] = args.fp8
    if args.fp8_modules is not None:
        env[envvars.FP8_MODULES] = args.fp8_modules
    if args.apex_alias:
        env = runner.with_apex_alias(env)
    return process.attached(cmd, env)
