#!/usr/bin/env python3
"""How fast is a matmul in FP32, bfloat16 and float16 on this machine? (Know the hardware.)

Mixed precision only pays where the half dtype has a fast path; this times one matmul per
dtype (one torch thread, median of repeats) and prints ampatch's machine line beside it.

    python scripts/half_matmul.py                    # 1024 x 256 @ 256 x 256 on the CPU
    python scripts/half_matmul.py --n 1024 --device cuda
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from ampatch.machine import hardware
from ampatch.machine.device_text import machine_line


def time_matmul(a: torch.Tensor, b: torch.Tensor, seconds: float) -> float:
    """Median seconds of a @ b over repeats that fill about `seconds`."""
    sync = torch.cuda.synchronize if a.is_cuda else (lambda: None)
    for _ in range(2):
        a @ b
    sync()
    times: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 3:
        t0 = time.perf_counter()
        a @ b
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--m", type=int, default=1024, help="rows of the left matrix")
    p.add_argument("--n", type=int, default=256, help="the inner and output width")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seconds", type=float, default=1.0, help="time per dtype")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    print(machine_line(hardware.describe(a.device), ["bfloat16", "float16"]))
    x, w = torch.randn(a.m, a.n, device=a.device), torch.randn(a.n, a.n, device=a.device)
    base = None
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        t = time_matmul(x.to(dtype), w.to(dtype), a.seconds)
        base = base or t
        print(f"  {a.m} x {a.n} @ {a.n} x {a.n} {str(dtype).removeprefix('torch.'):<9} {t * 1e3:9.3f} ms"
              f"  {t / base:6.2f} x FP32")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
