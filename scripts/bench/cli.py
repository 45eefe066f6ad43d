"""The bench's command line: choose the device, clock and sections, run them, print the
report, write the JSON (see the package's docstring for the commands)."""
from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ampatch.config.levels import half_dtype_for

from . import __doc__ as USAGE
from . import registry
from .harness import Clock, Env, cpu_name, machine_line
from .meter import rss_measurable
from .sections import fsdp

COMMAND = "python scripts/bench"  # how the report names the command that made it


def log(msg: str) -> None:
    """Progress, on stderr (the report goes to stdout)."""
    print(msg, file=sys.stderr, flush=True)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=COMMAND, description=USAGE.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH", help="also write every number to PATH")
    p.add_argument("--quick", action="store_true", help="few rounds (smoke test; ratios are noisy)")
    p.add_argument("--only", default="",
                   help=f"comma-separated sections: {', '.join(registry.SECTIONS)}, or {', '.join(registry.GROUPS)}")
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads for reproducible ratios on a shared machine (0: torch's default)")
    p.add_argument("--clock", default="auto", choices=("auto", "thread", "wall"),
                   help="thread: CPU time of the calling thread (default on CPU with one torch thread); "
                        "wall: perf_counter (default otherwise)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float16"),
                   help="half type (default: float16 on CUDA, bfloat16 elsewhere, as ampatch's auto choice)")
    p.add_argument("--fsdp", action="store_true", help="only the FSDP2 peak memory per rank, O2 against O0 (issue 14)")
    return p


def write_json(path: str | None, data: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=1)


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    command = " ".join([COMMAND] + list(sys.argv[1:] if argv is None else argv))
    try:
        device = torch.device(args.device)
    except (RuntimeError, ValueError) as exc:
        p.error(f"--device: {exc}")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: no CUDA device here (torch {torch.__version__}); the CPU sections "
                "run without --device")
    if args.json:  # before minutes of measuring: a folder that does not exist yet is made (out/)
        try:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            p.error(f"--json {args.json}: {exc}")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    env = Env(torch.device(args.device), half_dtype_for("O1", device, args.dtype), Clock.choose(args.clock, device))
    if args.fsdp:
        return run_fsdp(args, env, command)
    try:
        sections = registry.select(args.only, env.device.type)
    except ValueError as exc:
        p.error(str(exc))

    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # imports torch._dynamo once, outside timing
    gc.collect()
    gc.freeze()  # the import-time heap moves out of the collector's sight: later collections are cheap

    start = time.perf_counter()
    results: dict[str, Any] = {}
    for name in sections:
        t0 = time.perf_counter()
        results[name] = registry.SECTIONS[name].run(env, args.quick, log)
        log(f"{name}: {time.perf_counter() - t0:.1f} s")
    meta = {"torch": torch.__version__, "device": str(env.device), "half_dtype": env.half_name,
            "threads": torch.get_num_threads(),
            "threads_note": "fixed by --threads" if args.threads > 0 else "torch default",
            "clock": env.clock.label, "cpu": cpu_name(), "python": platform.python_version(),
            "machine": machine_line(env), "command": command, "quick": args.quick, "sections": sections,
            "rounds": {s: registry.SECTIONS[s].settings(args.quick) for s in sections},
            "seconds": round(time.perf_counter() - start, 1)}
    flat = registry.flat_ratios(results)
    header = [f"ampatch bench: torch {meta['torch']}, device {meta['device']}, half {meta['half_dtype']}, "
              f"torch threads {meta['threads']} ({meta['threads_note']}), {meta['cpu']}",
              f"machine: {meta['machine']}", f"clock: {meta['clock']}", f"command: {meta['command']}", ""]
    print("\n".join(header + registry.render(results, flat)))
    print(f"\n({meta['seconds']} s)")
    write_json(args.json, {"meta": meta, "ratios": flat, "targets": registry.target_records(sections, flat),
                           "results": results})
    return 0


def run_fsdp(args: argparse.Namespace, env: Env, command: str) -> int:
    """`--fsdp`: the FSDP2 section alone, its table, and `--json`."""
    if not rss_measurable():
        print("bench --fsdp: the CPU memory measure needs /proc/self/clear_refs (Linux)", file=sys.stderr)
        return 2
    start = time.perf_counter()
    res = fsdp.run(env, args.quick, log)
    cfg = fsdp.settings(args.quick)
    meta = {"torch": torch.__version__, "half_dtype": env.half_name, "cpu": cpu_name(), "quick": args.quick,
            "command": command, "rounds": cfg["rounds"], "steps": cfg["steps"],
            "seconds": round(time.perf_counter() - start, 1)}
    lines = [f"ampatch bench --fsdp: torch {meta['torch']}, half {meta['half_dtype']}, {meta['cpu']}",
             f"command: {meta['command']}", ""] + fsdp.render(res)
    print("\n".join(lines))
    print(f"\n({meta['seconds']} s)")
    write_json(args.json, {"meta": meta, "ratios": fsdp.ratios(res), "results": {"fsdp": res}})
    return 0
