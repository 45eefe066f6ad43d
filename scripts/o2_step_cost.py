"""The O2 step's cost against O3's (issue 44's target: O2 / O3 <= 1.25).

A "step" is `amp.scale_loss(loss).backward()` + `optimizer.step()` + `zero_grad()` over 200
parameters of 64 x 64 with AdamW: the graph is cheap, so the figure is what O2's FP32 masters
add (grad widening, the master step, the copy back) over O3's plain half step. O2 and O3 run
alternately in one process, one thread; each round's figure is the median thread CPU time of
20 steps, and the ratio printed is the median of the per-round ratios.

    python scripts/o2_step_cost.py [--rounds 15] [--half-dtype bfloat16]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import ampatch as amp

PARAMS, SHAPE, STEPS = 200, (64, 64), 20


def median_step_ns(level: str, half: torch.dtype) -> float:
    """Median thread CPU time of one step at `level`, after one untimed step."""
    torch.manual_seed(0)
    model = nn.ParameterList([nn.Parameter(torch.randn(*SHAPE) * 0.1) for _ in range(PARAMS)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=half, verbosity=0)

    def one() -> int:
        loss = torch.stack([p.sum() for p in model]).float().sum()
        t0 = time.thread_time_ns()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        return time.thread_time_ns() - t0

    one()
    try:
        return statistics.median(one() for _ in range(STEPS))
    finally:
        amp.deinitialize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--half-dtype", default="bfloat16", choices=["bfloat16", "float16"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    half = getattr(torch, args.half_dtype)
    o2, o3 = [], []
    for _ in range(args.rounds):
        o2.append(median_step_ns("O2", half))
        o3.append(median_step_ns("O3", half))
    ratios = [a / b for a, b in zip(o2, o3)]
    print(f"O2 step {statistics.median(o2) / 1e6:.2f} ms, O3 step {statistics.median(o3) / 1e6:.2f} ms, "
          f"O2/O3 median of {args.rounds} rounds {statistics.median(ratios):.3f} (target <= 1.25)")


if __name__ == "__main__":
    main()
