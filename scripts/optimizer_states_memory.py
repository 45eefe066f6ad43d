#!/usr/bin/env python3
"""Process peak and step time of optimizer_states "bfloat16" / "int8" against O5 (issue 46).

Each run builds the same FP32 model (`--layers` x Linear(`--width`, `--width`): 25.2M
parameters by default), AdamW, `amp.initialize`s it at O5 with one configuration and trains
`--steps` steps, in a fresh process of its own with no allocator tuning (no MALLOC_* or
AMPATCH_* variable in its environment), torch on one thread. Its figures: the process's peak
resident memory (VmHWM, `telemetry.peak_memory_bytes`, what `report()` and `ampatch compare`
read: the peak RSS a user sees from a shell), and the median training step (zero_grad,
forward, scale_loss, step) in the thread's CPU time, the first `--warmup` steps left out.
The configurations run interleaved in a rotating order, `--repeats` rounds; the table quotes
medians of the peaks, and the step time against O5 as the median over rounds of each round's
ratio to that round's O5 run (a machine that changes speed between rounds shifts both sides).

Targets (issue 46), on the process peak: "int8" at least 5 bytes per parameter below O5,
"bfloat16" at least 3, "stochastic" + "int8" at least 9.5; each step no more than 1.3x O5's.

    python scripts/optimizer_states_memory.py                # 5 configurations x 3 repeats
    python scripts/optimizer_states_memory.py --repeats 1 --steps 6
    python scripts/optimizer_states_memory.py --one int8     # one run here, as JSON
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from lowmem_memory import fresh_env, machine  # this directory's: the same fresh process, the same machine line
from torch import nn

import ampatch as amp
from ampatch.session.telemetry import peak_memory_bytes

# configuration -> initialize keywords (all at O5)
CONFIGS = {"O5": {},
           "bfloat16": {"optimizer_states": "bfloat16"},
           "int8": {"optimizer_states": "int8"},
           "stochastic": {"master_weights": "stochastic"},
           "stochastic+int8": {"master_weights": "stochastic", "optimizer_states": "int8"}}
TARGETS = {"bfloat16": 3.0, "int8": 5.0, "stochastic+int8": 9.5}  # bytes per parameter below O5's process peak
TIME_TARGET = 1.3  # each configuration's step at most this times O5's


def measure(config: str, a: argparse.Namespace) -> dict:
    """One run of `config`, in this process."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(a.width, a.width) for _ in range(a.layers)))
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = amp.initialize(model, opt, opt_level="O5", verbosity=0, **CONFIGS[config])
    x, y = torch.randn(a.batch, a.width), torch.randn(a.batch, a.width)
    times = []
    for _ in range(a.steps):
        start = time.thread_time()
        opt.zero_grad(set_to_none=True)
        loss = (model(x) - y).square().mean()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        times.append(time.thread_time() - start)
        del loss
    peak = peak_memory_bytes()
    report = amp.report()
    amp.deinitialize()
    return {"params": params, "peak": peak, "step_s": statistics.median(times[a.warmup:]),
            "train_bytes_per_param": report.training_bytes_per_param,
            "state_bytes_per_param": report.state_bytes_per_param}


def run_fresh(config: str, a: argparse.Namespace) -> dict:
    """One run of `config` in a fresh process (`lowmem_memory.fresh_env`: no allocator tuning)."""
    options = [f"--{name}={getattr(a, name)}" for name in ("width", "layers", "batch", "steps", "warmup")]
    out = subprocess.run([sys.executable, os.path.abspath(__file__), *options, "--one", config], capture_output=True,
                         text=True, check=True, env=fresh_env()).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("width", 2048), ("layers", 6), ("batch", 8), ("steps", 12)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the step time")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated: " + ", ".join(CONFIGS))
    p.add_argument("--one", choices=list(CONFIGS), metavar="CONFIG", help="one run of CONFIG here, printed as JSON")
    a = p.parse_args(argv)
    if a.one:
        print(json.dumps(measure(a.one, a)))
        return 0
    names = [c for c in a.configs.split(",") if c]
    if "O5" not in names:
        names.insert(0, "O5")
    runs: dict[str, list[dict]] = {c: [] for c in names}
    for r in range(a.repeats):
        for config in names[r % len(names):] + names[:r % len(names)]:
            runs[config].append(run_fresh(config, a))
    n, mib = runs["O5"][0]["params"], 2 ** 20
    o5 = statistics.median(x["peak"] for x in runs["O5"])
    print(f"process peak (peak RSS of a fresh process, no allocator tuning) and training step (thread CPU time, "
          f"1 thread), CPU: AdamW, {a.layers} x Linear({a.width}, {a.width}) ({n / 1e6:.1f}M params), batch "
          f"{a.batch}, O5, {a.steps} steps ({a.warmup} warm-up), torch {torch.__version__}, {datetime.date.today()}; "
          f"median of {a.repeats} runs per configuration, interleaved")
    print(machine())
    print(f"command: python scripts/optimizer_states_memory.py {' '.join(sys.argv[1:] if argv is None else argv)}"
          .rstrip())
    print(f"  {'configuration':<16} {'peak MiB':>9} {'below O5':>12} {'state B/p':>10} {'step ms':>8} {'vs O5':>7}"
          "  runs (peak MiB / step ms)")
    ok = True
    for config, rs in runs.items():
        peak = statistics.median(x["peak"] for x in rs)
        saved = (o5 - peak) / n
        ratio = statistics.median(x["step_s"] / o["step_s"] for x, o in zip(rs, runs["O5"]))
        step = statistics.median(x["step_s"] for x in rs)
        if config != "O5":
            ok &= saved >= TARGETS.get(config, 0.0) and ratio <= TIME_TARGET
        print(f"  {config:<16} {peak / mib:9.1f} {saved:7.2f} B/p {rs[0]['state_bytes_per_param']:10.2f} "
              f"{step * 1e3:8.1f} {ratio:6.2f}x  "
              + ", ".join(f"{x['peak'] / mib:.0f}/{x['step_s'] * 1e3:.0f}" for x in rs))
    print("targets: " + ", ".join(f"{c} >= {t} B/param below O5" for c, t in TARGETS.items())
          + f", each step <= {TIME_TARGET}x O5's: {'met' if ok else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
