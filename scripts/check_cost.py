"""What the inf/NaN check costs where ampatch skips it by default (O4, O1 in bfloat16).

Trains the embedded `lm` workload at O4 twice, side by side in one process: with the
default static loss scale 1.0 (no check: `scale_loss` does nothing) and with
`loss_scale="dynamic"` (one fused unscale + inf/NaN check per step, and its host sync).
Prints the median step time of each, their ratio, and the check alone (the fused kernel
on the model's grads plus the host read of the flag) as a fraction of an unchecked step.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/check_cost.py --steps 40
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import ampatch as amp
from ampatch.optim.scaler import unscale_
from ampatch.workloads import _common, lm


def lm_args(steps: int) -> argparse.Namespace:
    """The lm workload's own arguments (its parser's defaults: seed 0), on the CPU."""
    return _common.parse_args("lm", ["--steps", str(steps), "--device", "cpu"], steps)


def check_alone(steps: int, reps: int = 50) -> float:
    """Median seconds of one fused unscale + inf/NaN check + flag read on the lm's grads."""
    torch.manual_seed(0)
    model, opt, batches, loss_fn = lm.build(lm_args(steps))
    x, y = batches[0]
    loss_fn(model(x), y).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        bool(unscale_(grads, 1.0, None).item())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def step_times(loss_scale: float | str, steps: int) -> list[float]:
    torch.manual_seed(0)
    model, opt, batches, loss_fn = lm.build(lm_args(steps))
    model, opt = amp.initialize(model, opt, opt_level="O4", loss_scale=loss_scale, verbosity=0)
    times = []
    for x, y in batches:
        start = time.perf_counter()
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        times.append(time.perf_counter() - start)
    amp.deinitialize()
    return times[len(times) // 5:]  # the first fifth is warm-up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    results: dict[str, list[float]] = {"static 1.0 (no check)": [], "dynamic (checked)": []}
    for _ in range(2):  # interleaved, so load changes on a shared machine hit both alike
        results["static 1.0 (no check)"] += step_times(1.0, args.steps)
        results["dynamic (checked)"] += step_times("dynamic", args.steps)
    medians = {k: statistics.median(v) for k, v in results.items()}
    for k, v in medians.items():
        print(f"{k:24s} {1000 * v:8.1f} ms/step")
    ratio = medians["dynamic (checked)"] / medians["static 1.0 (no check)"]
    print(f"checked / unchecked: {ratio:.3f} (whole steps; noisy on a shared machine)")
    alone = check_alone(args.steps)
    print(f"check alone: {1000 * alone:.2f} ms = {alone / medians['static 1.0 (no check)']:.2%} of an unchecked step")


if __name__ == "__main__":
    main()
