#!/usr/bin/env python3
"""How near FP32 training the low-memory master modes end on the fine-tuning case where O3
stalls (issue 30), by seed: the figures quoted in `test_o3_stalls_where_both_modes_learn`.

The case is the test's own (`tests/optim/test_lowmem.py`'s `_fine_tuning`: a pretrained-like start,
updates of ~0.1 bfloat16 ulp per step, 200 steps, AdamW and SGD with momentum). Distances are
|loss - O0's| over O0's progress, for the final loss (FP32, after deinitialize) and for the end
of the training curve (mean of the last 40 losses, as tune and compare judge). The "bf16
floor" row is O0's own final weights rounded to the nearest bfloat16: where a mode whose
weights are bfloat16 values ends, at best, on the final loss.

    python scripts/lowmem_finetune.py              # seeds 0-7
    python scripts/lowmem_finetune.py --seeds 4
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "optim"))
from test_lowmem import _fine_tuning  # noqa: E402  (one definition of the case)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=8, help="stochastic rounding seeds (default 8)")
    a = ap.parse_args()
    if a.seeds < 1:
        ap.error("--seeds must be at least 1")
    torch.set_num_threads(1)
    print(f"fine-tuning case of tests/optim/test_lowmem.py, torch {torch.__version__}; distance from O0 "
          "over O0's progress (final loss | curve end)")
    for optimizer in ("adamw", "sgd_momentum"):
        o0 = _fine_tuning("O0", None, optimizer)
        progress = o0.start - o0.final

        def dist(run, o0=o0, progress=progress) -> tuple[float, float]:  # this optimizer's O0, bound now
            return abs(run.final - o0.final) / progress, abs(run.curve - o0.curve) / progress

        rows = {"O3": [dist(_fine_tuning("O3", None, optimizer))],
                "O5": [dist(_fine_tuning("O5", None, optimizer))],
                "O5+kahan": [dist(_fine_tuning("O5", "kahan", optimizer))],
                "O5+stochastic": [dist(_fine_tuning("O5", "stochastic", optimizer, seed=s)) for s in range(a.seeds)]}
        print(f"{optimizer}: O0 loss {o0.start:.6f} -> {o0.final:.6f}; "
              f"bf16 floor (O0's final weights to nearest) {abs(o0.rounded - o0.final) / progress:.4f}")
        for name, values in rows.items():
            finals, curves = [v[0] for v in values], [v[1] for v in values]
            if len(values) == 1:
                print(f"  {name:<14} final {finals[0]:.4f}   curve {curves[0]:.4f}")
            else:
                print(f"  {name:<14} final {min(finals):.4f}-{max(finals):.4f} (median {statistics.median(finals):.4f})"
                      f"   curve {min(curves):.4f}-{max(curves):.4f} (mean {statistics.fmean(curves):.4f}), "
                      f"{len(values)} seeds")


if __name__ == "__main__":
    main()
