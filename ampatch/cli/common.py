"""What the `ampatch` subcommands share: the usage error, argument types (argparse `type=`
functions raise `ArgumentTypeError`, which the parser reports as a usage error), shared options."""

from __future__ import annotations

import argparse
from collections.abc import Callable
import re
from pathlib import Path
from typing import Any

from ampatch.base.dtypes import HALF_NAMES
from ampatch.config import levels as levels_policy
from ampatch.config.values import parse_loss_scale, parse_master_weights, parse_names
from ampatch.runs import UsageError
from ampatch.runs.budget import parse_seconds

__all__ = ["CliError", "check_output_path", "LEVELS", "HALF_OPTION", "opt_level", "opt_levels", "level_variant", "level_variants", "positive", "threads", "budget", "loss_scale", "master_weights", "module_names", "KEEP_FP32_HELP", "policy_path"]

LEVELS = tuple(levels_policy.LEVELS)
# the --half-dtype option every subcommand has
HALF_OPTION: dict[str, Any] = dict(choices=("auto", *HALF_NAMES), default=None,
                                   help="half type for O1-O3 (default and 'auto': float16 on CUDA, bfloat16 "
                                        "elsewhere; O4/O5 always use bfloat16)")


def opt_level(text: str) -> str:
    try:
        return levels_policy.normalize(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"unknown opt level {text!r} (choose from {', '.join(LEVELS)})") from None


def level_variant(text: str) -> str:
    """A level of `compare --levels`: "O5", or a level that casts the model with a low-memory
    master mode, "O5+stochastic" / "O5+kahan" (`levels.variant`)."""
    try:
        return levels_policy.variant_label(*levels_policy.variant(text))
    except ValueError as exc:
        if "+" in text:
            raise argparse.ArgumentTypeError(str(exc)) from None
        raise argparse.ArgumentTypeError(f"unknown opt level {text!r} (choose from {', '.join(LEVELS)}, or e.g. "
                                         "O5+kahan)") from None


def opt_levels(text: str, each: Callable[[str], str] = opt_level) -> list[str]:
    levels = [each(t) for t in re.split(r"[,\s]+", text) if t]
    if not levels:
        raise argparse.ArgumentTypeError("no opt level given")
    return list(dict.fromkeys(levels))


def level_variants(text: str) -> list[str]:
    """`compare --levels`: opt levels, each maybe with a low-memory master mode ("O5+kahan")."""
    return opt_levels(text, level_variant)


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def threads(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"--threads must be 0 (torch's default) or a positive number, got {text!r}")
    return int(text)


def budget(text: str) -> float | None:
    try:
        return parse_seconds(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


KEEP_FP32_HELP = ("comma-separated module names, as model.named_modules() gives them ('1.head' with several "
                  "models), that run in FP32 at every level, added to the script's own keep_fp32 "
                  "(AMPATCH_KEEP_FP32)")


def loss_scale(text: str) -> str:
    """A loss scale as `initialize` takes it: a number or "dynamic" (checked here, passed on as text)."""
    try:
        parse_loss_scale(text.strip())
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text.strip()


def master_weights(text: str) -> str:
    """`master_weights` as `initialize` takes it: True, False, stochastic or kahan (checked
    here, passed on as text for AMPATCH_MASTER_WEIGHTS)."""
    try:
        parse_master_weights(text.strip())
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text.strip()


def module_names(text: str) -> str:
    """"a, b" -> "a,b": module names as `named_modules()` gives them, for AMPATCH_KEEP_FP32."""
    found = parse_names(text)
    if not found:
        raise argparse.ArgumentTypeError("--keep-fp32 needs module names, e.g. --keep-fp32 head,blocks.0.attn")
    return ",".join(found)


class CliError(UsageError):
    """A usage error: reported as one ``ampatch: error:`` line, exit code 2 (as is every
    `UsageError` the compare package raises)."""


def check_output_path(path: str | None, option: str) -> None:
    """An output file's directory must exist before any run starts."""
    if path and not Path(path).resolve().parent.is_dir():
        raise CliError(f"{option}: directory of {path!r} does not exist")


def check_half_dtype(level: str | None, half_dtype: str | None) -> None:
    """Refuse ``--half-dtype float16`` with a level that is always bfloat16 (O4/O5)."""
    reason = levels_policy.half_dtype_conflict(level, half_dtype)
    if reason:
        raise CliError(reason)


def policy_path(text: str) -> str:
    """A policy file (``--policy``): read and checked now, so a broken one stops the command
    before any run; its absolute path, for the runs' ``AMPATCH_POLICY``."""
    from ampatch.config.policy_file import PolicyError, load  # imports torch: only when the option is given
    try:
        load(text)
    except PolicyError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return str(Path(text).resolve())
