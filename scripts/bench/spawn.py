"""Starting the bench's child processes, the parent's side of `python -m bench.child`.

Sections that need a fresh process per run (memory: nothing left over from earlier modes;
fsdp: one process per rank) start `python -m bench.child KIND --flag value ...` (see
child.py) with `scripts/` on PYTHONPATH and malloc set to return freed blocks to the OS;
the child prints its result as the last line of its stdout, in JSON.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from .harness import Env
from .meter import MALLOC_ENV

SCRIPTS = Path(__file__).resolve().parent.parent  # the folder that holds the bench package


def child_command(kind: str, env: Env, **options: Any) -> list[str]:
    """The command line of child KIND, with the parent's device, half dtype and torch threads
    and `options` as --flags (underscores become dashes; True: a bare flag, False/None: left out)."""
    argv = [sys.executable, "-m", "bench.child", kind, "--device", str(env.device), "--dtype", env.half_name,
            "--threads", str(torch.get_num_threads())]
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not None and value is not False:
            argv += [flag, str(value)]
    return argv


def child_environment() -> dict[str, str]:
    """os.environ, with scripts/ first on PYTHONPATH (so `-m bench.child` imports this package)
    and malloc returning freed blocks to the OS (the RSS follows the live tensors)."""
    path = [str(SCRIPTS)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    return dict(os.environ, **MALLOC_ENV, PYTHONPATH=os.pathsep.join(path))


def child_result(kind: str, returncode: int, stdout: str, stderr: str) -> dict[str, Any]:
    """The JSON result a child printed last, or a RuntimeError with the end of its stderr."""
    if returncode != 0:
        raise RuntimeError(f"bench child {kind} failed:\n{stderr[-2000:]}")
    return json.loads(stdout.strip().splitlines()[-1])
