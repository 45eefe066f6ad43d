"""The entry of the bench's child processes (the parent starts them through spawn.py):

    python -m bench.child memory --level O2 --steps 3 [--device cpu --dtype bfloat16 --threads 1]
    python -m bench.child fsdp --mode O2 --rank 0 --rdzv PATH --steps 3 --width 256 --depth 3 --batch 32

(with scripts/ on PYTHONPATH). Each measures one run in this fresh process and prints its
result as one JSON line on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence

import torch

from .harness import Env
from .sections import fsdp, memory


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.child", description=__doc__.split("\n\n")[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--device", default="cpu")
    common.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    common.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (0: torch's default)")
    common.add_argument("--steps", type=int, default=3, help="training steps, the first 2 unmeasured")
    kinds = p.add_subparsers(dest="kind", required=True)
    mem = kinds.add_parser("memory", parents=[common], help="the memory section: one level of the CNN")
    mem.add_argument("--level", required=True, choices=memory.LEVELS)
    sharded = kinds.add_parser("fsdp", parents=[common], help="the --fsdp section: one rank of one mode")
    sharded.add_argument("--mode", required=True, choices=fsdp.MODES)
    sharded.add_argument("--rank", type=int, required=True)
    sharded.add_argument("--rdzv", required=True, help="the file the ranks meet at (init_method file://)")
    for name in ("width", "depth", "batch"):
        sharded.add_argument(f"--{name}", type=int, required=True)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    env = Env(torch.device(a.device), getattr(torch, a.dtype))
    if a.kind == "memory":
        print(json.dumps(memory.measure_in_child(a.level, env, a.steps)), flush=True)
        return 0
    result = fsdp.measure_in_child(a.mode, a.rank, a.rdzv, env, a.steps, a.width, a.depth, a.batch)
    print(json.dumps(result), flush=True)
    os._exit(0)  # gloo can abort in interpreter teardown: the result is out, leave at once


if __name__ == "__main__":
    raise SystemExit(main())
