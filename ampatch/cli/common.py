"""What the `ampatch` subcommands share: the usage error, argument types (argparse `type=`
functions raise `ArgumentTypeError`, which the parser reports as a usage error), shared options."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ampatch.base.dtypes import HALF_NAMES
from ampatch.config import levels as levels_policy
from ampatch.config.values import parse_fp8, parse_loss_scale, parse_master_weights, parse_names, parse_optimizer_states
from ampatch.errors import CliError, reason
from ampatch.runs.budget import parse_seconds

__all__ = ["CliError", "check_output_path", "LEVELS", "HALF_OPTION", "opt_level", "opt_levels", "level_variant",
           "level_variants", "check_fp8_levels", "positive", "threads", "budget", "loss_scale", "master_weights",
           "optimizer_states", "with_states", "fp8_recipe", "layer_names", "module_names", "tolerance",
           "KEEP_FP32_HELP", "policy_path", "argument", "add_level_options"]

LEVELS = tuple(levels_policy.LEVELS)
# the --half-dtype option every subcommand has
HALF_OPTION: dict[str, Any] = dict(choices=("auto", *HALF_NAMES), default=None,
                                   help="half type for O1-O3 (default and 'auto': float16 on CUDA, bfloat16 "
                                        "elsewhere; O4/O5 always use bfloat16)")


def argument(parse: Callable[[str], Any], message: Callable[[str, Exception], str] | None = None
             ) -> Callable[[str], Any]:
    """An argparse `type=` from a parser of ampatch's: its ValueError/TypeError becomes the
    `ArgumentTypeError` argparse reports as a usage error (`message(text, error)` words it;
    default: the parser's own message)."""
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except (TypeError, ValueError) as exc:
            raise argparse.ArgumentTypeError(message(text, exc) if message else reason(exc)) from None
    convert.__name__ = getattr(parse, "__name__", "argument")  # argparse names the type in its errors
    return convert


opt_level = argument(levels_policy.normalize,
                     lambda text, _: f"unknown opt level {text!r} (choose from {', '.join(LEVELS)})")
# A level of `compare --levels` / `tune --levels`: "O5", a level that casts the model with a
# low-memory master mode, "O5+stochastic" / "O5+kahan", or with FP8, "O5+fp8" / "O5+fp8:rowwise"
# (`levels.variant`, the one reading of them).
level_variant = argument(
    lambda text: levels_policy.variant(text).label,
    lambda text, exc: reason(exc) if "+" in text else (f"unknown opt level {text!r} (choose from {', '.join(LEVELS)}, "
                                                   "or e.g. O5+kahan, O5+fp8)"))


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


budget = argument(parse_seconds)


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


KEEP_FP32_HELP = ("comma-separated module names, as model.named_modules() gives them ('1.head' with several "
                  "models), that run in FP32 at every level, added to the script's own keep_fp32 "
                  "(AMPATCH_KEEP_FP32)")


def _checked_text(parse: Callable[[str], Any]) -> Callable[[str], str]:
    """The stripped text, once `parse` accepted it (passed on as text, to an AMPATCH_* variable)."""
    def check(text: str) -> str:
        parse(text.strip())
        return text.strip()
    check.__name__ = parse.__name__
    return check


loss_scale = argument(_checked_text(parse_loss_scale))          # a number or "dynamic"
master_weights = argument(_checked_text(parse_master_weights))  # True, False, stochastic or kahan
optimizer_states = argument(lambda text: parse_optimizer_states(text.strip(), "--optimizer-states").value)


def with_states(labels: list[str], states: str | None) -> list[str]:
    """`compare --optimizer-states`: each level that names no state precision of its own gets
    `states`, but O0, the FP32 reference the others are compared with (O0+int8 says it)."""
    if states is None:
        return labels
    out = []
    for label in labels:
        v = levels_policy.variant(label)
        out.append(label if label == "O0" else v._replace(optimizer_states=v.optimizer_states or states).label)
    return list(dict.fromkeys(out))


def _fp8_text(text: str) -> str:
    """`--fp8 RECIPE` for AMPATCH_FP8: a recipe name, or "off"."""
    return parse_fp8(text.strip(), "--fp8") or "off"


fp8_recipe = argument(_fp8_text)


def layer_names(text: str) -> str:
    """"a, b" -> "a,b": layer names or globs for AMPATCH_FP8_MODULES."""
    found = parse_names(text)
    if not found:
        raise argparse.ArgumentTypeError("--fp8-modules needs layer names or globs, e.g. "
                                         "--fp8-modules 'blocks.*.mlp.*'")
    return ",".join(found)


def module_names(text: str) -> str:
    """"a, b" -> "a,b": module names as `named_modules()` gives them, for AMPATCH_KEEP_FP32."""
    found = parse_names(text)
    if not found:
        raise argparse.ArgumentTypeError("--keep-fp32 needs module names, e.g. --keep-fp32 head,blocks.0.attn")
    return ",".join(found)


def check_output_path(path: str | None, option: str) -> None:
    """An output file's directory must exist before any run starts."""
    if path and not Path(path).resolve().parent.is_dir():
        raise CliError(f"{option}: directory of {path!r} does not exist")


def check_fp8_levels(labels: list[str], half_dtype: str | None, device: str | None) -> None:
    """Refuse a level with FP8 ("O2+fp8") whose layers would compute in float16 here, with
    `initialize`'s own message (fp8 runs where they compute in bfloat16 or FP32)."""
    from ampatch.config.options import fp8_conflict  # imports torch: only when a level has fp8
    for label in labels:
        v = levels_policy.variant(label)
        level, fp8 = v.level, v.fp8
        why = fp8_conflict(level, fp8, half_dtype, device) if fp8 is not None else None
        if why:
            raise CliError(f"{label}: {why}")


def check_half_dtype(level: str | None, half_dtype: str | None) -> None:
    """Refuse ``--half-dtype float16`` with a level that is always bfloat16 (O4/O5)."""
    reason = levels_policy.half_dtype_conflict(level, half_dtype) if level is not None else None
    if reason:
        raise CliError(reason)


def _policy_file(text: str) -> str:
    """A policy file (``--policy``): read and checked now, so a broken one stops the command
    before any run; its absolute path, for the runs' ``AMPATCH_POLICY``."""
    from ampatch.config.policy_file import load  # imports torch: only when the option is given
    load(text)  # a PolicyError is a ValueError: `argument` reports it
    return str(Path(text).resolve())


policy_path = argument(_policy_file)


def add_level_options(parser: argparse.ArgumentParser, half: dict, level_help: str, keep_help: str,
                      alias_help: str) -> None:
    """The options of a subcommand that runs a script at a level (`run`, `diagnose`):
    --opt-level, --half-dtype, --keep-fp32 and --apex-alias."""
    parser.add_argument("--opt-level", type=opt_level, default=None, help=level_help)
    parser.add_argument("--half-dtype", **half)
    parser.add_argument("--keep-fp32", type=module_names, metavar="NAMES", help=keep_help)
    parser.add_argument("--apex-alias", action="store_true", help=alias_help)
