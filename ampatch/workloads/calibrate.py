"""Time a few steps of a built-in workload per size and step kind: what ``ampatch compare``
reads to choose the size (``ampatch.runs.sizing``).

``python -m ampatch.workloads.calibrate lm --levels O0,O1,O4 --out PATH`` times, from the
smallest size up, one step kind per distinct dtype of the levels (FP32 for O0, then each half
dtype, at the first level that uses it; a level with FP8, "O5+fp8:rowwise", is a kind of its own:
emulated FP8 steps cost a few times bfloat16's): the model is built, initialized at that level, run
one warm-up step and ``TIMED_STEPS`` timed ones, then deinitialized. Each size costs about
``GROWTH`` times the one before, so it stops before a size whose round (a step of every
level) would take more than ``SLACK`` times ``--stop-above`` (the caller's longest round that
can fit), or whose measuring would end past ``--time-limit``. The JSON it writes after each
size is the measurement only; the choice is the caller's.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import ampatch as amp
from ampatch import workloads
from ampatch.base.dtypes import HALF_NAMES
from ampatch.config import levels
from ampatch.config.values import DEFAULT_FP8_RECIPE, parse_names
from ampatch.workloads import _common

TIMED_STEPS = 2  # after one warm-up step, per size and kind
GROWTH = 4.0     # each size is about this many times the compute of the one before (workloads.SIZES)
SLACK = 1.5      # a size predicted to need up to this many times --stop-above is still measured
FP32 = "float32"
FP8_KIND = "+fp8:"  # a step kind with FP8: "bfloat16+fp8:tensorwise"


def step_kinds(level_names: Sequence[str], device: str, half_dtype: str | None) -> dict[str, str]:
    """Level (as `--levels` names it) -> its step kind: ``float32`` for O0, else the name of the
    half dtype it runs in; with FP8, that and the recipe ("bfloat16+fp8:rowwise")."""
    def kind(label: str) -> str:
        v = levels.variant(label)  # "O5+kahan" steps bfloat16 weights as O5 does
        level, fp8 = v.level, v.fp8
        dtype = levels.half_name(level, levels.half_dtype_for(level, device, half_dtype)) or FP32
        return dtype if fp8 is None else f"{dtype}{FP8_KIND}{DEFAULT_FP8_RECIPE if fp8 is True else fp8}"
    return {lv: kind(lv) for lv in level_names}


def dtype_of_kind(kind: str) -> str:
    """The dtype of a step kind ("bfloat16+fp8:rowwise" -> "bfloat16")."""
    return kind.partition(FP8_KIND)[0]


def time_kind(module: Any, size: str, level: str, args: argparse.Namespace) -> dict[str, float]:
    """Build the workload at ``size``, initialize it at ``level``, and time its steps (seconds):
    ``build`` (model, data, initialize), ``first`` (the warm-up step), ``step`` (the median)."""
    start = time.perf_counter()
    run_args = _common.parse_args(args.workload, ["--steps", str(TIMED_STEPS + 1), "--size", size,
                                                  "--device", args.device, "--seed", "0"], TIMED_STEPS + 1)
    torch.manual_seed(run_args.seed)
    model, optimizer, batches, loss_fn = module.build(run_args)
    v = levels.variant(level)
    level, fp8 = v.level, v.fp8
    half = levels.half_dtype_for(level, args.device, args.half_dtype) if levels.uses_half(level) else None
    model, optimizer = amp.initialize(model, optimizer, opt_level=level, half_dtype=half, verbosity=0, fp8=fp8)
    model.train()
    times = []
    try:
        built = time.perf_counter()
        for batch in batches:
            begin = time.perf_counter()
            _common.train_step(model, optimizer, batch, loss_fn, run_args.device).item()  # .item(): synchronize
            times.append(time.perf_counter() - begin)
    finally:
        amp.deinitialize()
    return {"build": built - start, "first": times[0], "step": statistics.median(times[1:])}


def calibrate(args: argparse.Namespace) -> dict[str, Any]:
    """Measure sizes from the smallest up (see the module's docstring); the JSON's content."""
    module = importlib.import_module(f"ampatch.workloads.{args.workload}")
    kinds = step_kinds(args.levels, args.device, args.half_dtype)
    first_level: dict[str, str] = {}  # kind -> the first level that uses it
    for lv, kind in kinds.items():
        first_level.setdefault(kind, lv)
    began = time.perf_counter()
    out: dict[str, Any] = {"workload": args.workload, "kinds": kinds, "sizes": []}
    last: tuple[float, float] | None = None  # the last size's (cost in seconds, round in seconds)
    for size in args.sizes:
        spent = time.perf_counter() - began
        if last is not None and (spent + last[0] * GROWTH > args.time_limit
                                 or last[1] * GROWTH > args.stop_above * SLACK):
            break
        measured = {kind: time_kind(module, size, level, args) for kind, level in first_level.items()}
        round_s = sum(measured[kind]["step"] for kind in kinds.values())
        out["sizes"].append({"size": size, "dims": module.SIZES[size].describe(), "round_s": round_s,
                             **{key: {k: m[key] for k, m in measured.items()} for key in ("step", "first", "build")}})
        last = (time.perf_counter() - began - spent, round_s)
        out["busy_s"] = time.perf_counter() - began
        write(args.out, out)
    return out


def write(path: str, data: dict[str, Any]) -> None:
    """Replace ``path`` with ``data`` as JSON in one step (a reader never sees half a file)."""
    tmp = f"{path}.tmp"
    Path(tmp).write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The calibration's command line."""
    p = argparse.ArgumentParser(prog="python -m ampatch.workloads.calibrate",
                                description="Time steps of a built-in workload per size and step kind.")
    p.add_argument("workload", choices=workloads.WORKLOADS)
    p.add_argument("--levels", default="O0,O1", help="comma-separated opt levels whose step kinds to time")
    p.add_argument("--half-dtype", choices=HALF_NAMES, default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    p.add_argument("--sizes", default=",".join(workloads.SIZES), help="sizes to try, smallest first")
    p.add_argument("--stop-above", type=float, default=float("inf"), metavar="SECONDS",
                   help="the longest round (a step of every level) the caller can use: bigger sizes are skipped")
    p.add_argument("--time-limit", type=float, default=5.0, metavar="SECONDS",
                   help="do not start a size whose measuring would end past this many seconds")
    p.add_argument("--out", required=True, metavar="PATH", help="write the measurements here (JSON)")
    args = p.parse_args(argv)
    args.levels = [levels.variant(lv, "--levels").label for lv in parse_names(args.levels)]
    args.sizes = parse_names(args.sizes)
    bad = [s for s in args.sizes if s not in workloads.SIZES]
    if bad or not args.sizes:
        p.error(f"--sizes: expected some of {', '.join(workloads.SIZES)}, got {args.sizes}")
    args.device = str(_common.resolve_device(args.device))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Calibrate and write the JSON; exit code 0."""
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    calibrate(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
