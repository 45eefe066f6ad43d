#!/usr/bin/env python3
"""Peak memory of master_weights "stochastic" and "kahan" against O5, as a user measures it.

Each run builds the same FP32 model (`--layers` x Linear(`--width`, `--width`): 25.2M
parameters by default), an optimizer, `amp.initialize`s it and trains three steps, in a
fresh process of its own with no allocator tuning (the MALLOC_* variables are removed from
its environment). Its figure is the process's peak resident memory, read before
`deinitialize` (and once after `initialize`: the peak up to then), as `report()` reads it:
VmHWM, i.e. `ru_maxrss` as `/usr/bin/time -v` shows it for a script started from a shell
(Linux's `ru_maxrss` of a process exec'd by a larger one, pytest say, starts at that one's
peak). The modes run interleaved in a
rotating order, `--repeats` rounds per optimizer; the table quotes medians.

Targets (issue 35), on the process peak: "stochastic" at least 3 bytes per parameter below
O5, "kahan" at least 1.5, for SGD with and without momentum and for AdamW; initialize with
a low-memory mode peaks no higher than O5's initialize.

    python scripts/lowmem_memory.py                      # 3 optimizers x 3 modes x 3 repeats
    python scripts/lowmem_memory.py --optimizers adamw --repeats 1
    python scripts/lowmem_memory.py --one kahan --optimizer sgd   # one run here, as JSON
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys

import torch
from torch import nn

import ampatch as amp
from ampatch.session.telemetry import peak_memory_bytes

# mode name -> initialize keywords
MODES = {"O5": {"opt_level": "O5"},
         "stochastic": {"opt_level": "O5", "master_weights": "stochastic"},
         "kahan": {"opt_level": "O5", "master_weights": "kahan"}}
OPTIMIZERS = {"sgd": lambda ps: torch.optim.SGD(ps, lr=1e-3),
              "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9),
              "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-4)}
TARGETS = {"stochastic": 3.0, "kahan": 1.5}  # bytes per parameter below O5's process peak


def peak_bytes() -> int:
    """The process's peak resident memory so far, as `report()` and `ampatch compare` read it
    (`telemetry.peak_memory_bytes`: VmHWM on Linux, which is `ru_maxrss` without the peak
    of the process that launched this one carried over)."""
    return peak_memory_bytes()


def measure(mode: str, a: argparse.Namespace) -> dict:
    """One run of `mode` with `a.optimizer`, in this process."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    start = peak_bytes()
    model = nn.Sequential(*(nn.Linear(a.width, a.width) for _ in range(a.layers)))
    params = sum(p.numel() for p in model.parameters())
    opt = OPTIMIZERS[a.optimizer](model.parameters())
    built = peak_bytes()
    model, opt = amp.initialize(model, opt, verbosity=0, **MODES[mode])
    initialized = peak_bytes()
    x, y = torch.randn(a.batch, a.width), torch.randn(a.batch, a.width)
    for _ in range(a.steps):
        opt.zero_grad(set_to_none=True)
        loss = (model(x) - y).square().mean()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        del loss
    trained = peak_bytes()
    report = amp.report()
    amp.deinitialize()
    return {"params": params, "start": start, "built": built, "initialize": initialized, "peak": trained,
            "deinitialize": peak_bytes(), "bytes_per_param_report": report.bytes_per_param}


def fresh_env() -> dict[str, str]:
    """This environment without allocator tuning (MALLOC_*) or ampatch overrides (AMPATCH_*)."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "AMPATCH_"))}


def run_fresh(mode: str, optimizer: str, a: argparse.Namespace) -> dict:
    args = [f"--width={a.width}", f"--layers={a.layers}", f"--batch={a.batch}", f"--steps={a.steps}"]
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), *args, "--optimizer", optimizer,
                           "--one", mode], capture_output=True, text=True, check=True, env=fresh_env())
    return json.loads(proc.stdout.strip().splitlines()[-1])


def machine() -> str:
    """The machine line of ampatch's own tables (CPU model, cores, flags, torch, bfloat16 native or not)."""
    from ampatch.machine import hardware
    from ampatch.machine.device_text import machine_line
    return "machine: " + machine_line(hardware.describe("cpu"), ["bfloat16"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="comma-separated: " + ", ".join(OPTIMIZERS))
    p.add_argument("--optimizer", choices=list(OPTIMIZERS), default="sgd_momentum", help="with --one")
    p.add_argument("--one", choices=list(MODES), metavar="MODE", help="one run of MODE here, printed as JSON")
    a = p.parse_args(argv)
    if a.one:
        print(json.dumps(measure(a.one, a)))
        return 0
    mib, names = 2 ** 20, list(MODES)
    print(f"process peak (peak RSS of a fresh process, no allocator tuning), CPU: {a.layers} x Linear({a.width}, "
          f"{a.width}), batch {a.batch}, bfloat16, {a.steps} steps, torch {torch.__version__}, "
          f"{datetime.date.today()}; median of {a.repeats} runs per mode, modes interleaved")
    print(machine())
    print(f"command: python scripts/lowmem_memory.py {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip())
    ok = True
    for optimizer in a.optimizers.split(","):
        runs: dict[str, list[dict]] = {m: [] for m in names}
        for r in range(a.repeats):
            for mode in names[r % len(names):] + names[:r % len(names)]:
                runs[mode].append(run_fresh(mode, optimizer, a))
        n = runs["O5"][0]["params"]
        med = {m: {k: statistics.median(x[k] for x in rs) for k in ("peak", "initialize", "start")}
               for m, rs in runs.items()}
        print(f"{optimizer} ({n / 1e6:.1f}M params)")
        print(f"  {'mode':<11} {'peak MiB':>9} {'below O5':>12} {'initialize MiB':>15} {'vs O5':>8}  runs (peak MiB)")
        for mode, m in med.items():
            saved = (med["O5"]["peak"] - m["peak"]) / n
            init = (m["initialize"] - med["O5"]["initialize"]) / mib
            print(f"  {mode:<11} {m['peak'] / mib:9.1f} {saved:7.2f} B/p {m['initialize'] / mib:15.1f} {init:+8.1f}  "
                  + ", ".join(f"{x['peak'] / mib:.0f}" for x in runs[mode]))
            if mode in TARGETS:
                ok &= saved >= TARGETS[mode] and m["initialize"] <= med["O5"]["initialize"]
    print("targets: " + ", ".join(f"{m} >= {t} B/param below O5" for m, t in TARGETS.items())
          + f", initialize no higher than O5's: {'met' if ok else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
