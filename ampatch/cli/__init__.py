"""The ``ampatch`` command: the parser, and one module per subcommand, each with its ``add_*``
parser entry (in ``SUBCOMMANDS``) and its ``cmd_*`` function. The command line is the only part
of ampatch that prints; the packages it drives (``ampatch.runs``, ``ampatch.compare``,
``ampatch.diagnose``) return results and write progress to the stream they are given.

- ``compare`` trains a built-in workload, or the script after ``--``, once per opt level and
  prints one table;
- ``run`` runs a script once, forced to a level, with ``--apex-alias`` making its Apex
  imports load ampatch;
- ``diagnose`` finds where half precision hurts a script and verifies a fix;
- ``tune`` finds the fastest precision policy that still trains like FP32 and writes it to
  a policy file (``amp.initialize(..., policy=PATH)``, ``ampatch run --policy PATH``).

Exit codes: the runs' (1 when a level failed, nothing could be diagnosed, or tune's runs cannot
tell), 2 for a usage error, 130 after Ctrl-C, 128+N after signal N (SIGTERM, SIGHUP: handled as
Ctrl-C is, see ``ampatch.runs.process``); ``run`` exits with its script's status.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from ampatch.cli.common import HALF_OPTION, CliError
from ampatch.cli.compare import add_compare
from ampatch.cli.diagnose import add_diagnose
from ampatch.cli.run import add_run
from ampatch.cli.tune import add_tune
from ampatch.errors import reason
from ampatch.runs import UsageError, process

__all__ = ["main", "build_parser", "SUBCOMMANDS", "CliError"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise CliError(message)


SUBCOMMANDS: dict[str, Callable[[argparse._SubParsersAction, dict], None]] = {
    "compare": add_compare, "run": add_run, "diagnose": add_diagnose, "tune": add_tune}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (the command after ``--`` is split off before parsing)."""
    parser = _Parser(prog="ampatch", description="Automatic mixed precision: compare the opt levels on a "
                     "training script (compare), run it forced to one level (run), diagnose where half precision "
                     "hurts it (diagnose), or find the fastest precision policy that still trains like FP32 and "
                     "write it as a policy file (tune).")
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
        with process.stopping():  # SIGTERM, SIGHUP: stop as Ctrl-C does (`run` passes them on instead)
            return args.func(args)
    except UsageError as exc:
        print(f"ampatch: error: {reason(exc)}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    except KeyboardInterrupt as exc:  # Ctrl-C, or process.Stopped
        return 128 + process.signal_of(exc)
