#!/usr/bin/env python3
"""Peak training memory of master_weights "stochastic" and "kahan" against O5 (issue 30).

Each mode trains the same 25M-parameter model (a stack of Linear layers, SGD with momentum)
in a fresh process, side by side, measured as scripts/o2_memory.py does (Linux only):

- persistent: exact bytes of the storages that live across steps (params, masters,
  compensations, optimizer state), after zero_grad(set_to_none=True);
- the growth of the peak RSS over one training step, read after each phase (forward,
  backward, scale_loss exit, optimizer step), with malloc returning freed blocks to the OS
  (MALLOC_MMAP_THRESHOLD_), after two warm-up steps;
- peak = persistent + the largest growth, per parameter; and the process's whole peak RSS
  (it includes the FP32 model every mode builds before amp.initialize).

Target: against O5, "stochastic" saves >= 3 bytes per parameter and "kahan" >= 1.5.

    python scripts/lowmem_memory.py                  # 6 x Linear(2048, 2048): 25.2M params
    python scripts/lowmem_memory.py --one kahan      # one mode in this process, as JSON
"""
from __future__ import annotations

import argparse
import gc
import json
import resource
import sys

import torch
from torch import nn

import ampatch as amp
from bench.meter import PeakMeter, measure_each_fresh, persistent_bytes, rss_measurable

# mode name -> initialize keywords
MODES = {"O5": {"opt_level": "O5"},
         "O5+stochastic": {"opt_level": "O5", "master_weights": "stochastic"},
         "O5+kahan": {"opt_level": "O5", "master_weights": "kahan"},
         "O3": {"opt_level": "O3"}}
TARGETS = {"O5+stochastic": 3.0, "O5+kahan": 1.5}  # bytes per parameter saved against O5


def measure(mode: str, a: argparse.Namespace) -> dict:
    """One mode's figures, measured in this process (see the module's docstring)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(a.width, a.width) for _ in range(a.layers)))
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    model, opt = amp.initialize(model, opt, verbosity=0, **MODES[mode])
    x, y = torch.randn(a.batch, a.width), torch.randn(a.batch, a.width)
    meter = PeakMeter(torch.device("cpu"))
    growth: dict[str, int] = {}
    persistent = 0
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        gc.collect()
        persistent = persistent_bytes(model, opt) + _compensation_bytes()
        meter.start()
        growth = {}
        loss = (model(x) - y).square().mean()
        growth["forward"] = meter.growth()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
            growth["backward"] = meter.growth()
        growth["scale_loss exit"] = meter.growth()
        opt.step()
        growth["step"] = meter.growth()
        del loss
    report = amp.report()
    amp.deinitialize()
    return {"params": params, "persistent": persistent, "growth": growth,
            "peak": persistent + max(growth.values()), "bytes_per_param_report": report.bytes_per_param,
            "process_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def _compensation_bytes() -> int:
    """The kahan compensations: not among the tensors `persistent_bytes` walks."""
    from ampatch.session.session import current
    session = current()
    return sum(c.numel() * c.element_size() for h in session.optimizers for c in getattr(h.masters, "comp", {}).values())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--one", choices=list(MODES), metavar="MODE",
                   help="measure only MODE, in this process, and print its figures as JSON")
    a = p.parse_args(argv)
    if not rss_measurable():
        print("needs Linux's /proc/self/clear_refs", file=sys.stderr)
        return 2
    if a.one:
        print(json.dumps(measure(a.one, a)))
        return 0
    args = [f"--width={a.width}", f"--layers={a.layers}", f"--batch={a.batch}"]
    res = measure_each_fresh(__file__, args, MODES)
    n = res["O5"]["params"]
    mib = 2 ** 20
    print(f"peak training memory, CPU: {a.layers} x Linear({a.width}, {a.width}) = {n / 1e6:.1f}M params, SGD "
          f"momentum 0.9, batch {a.batch}, bfloat16, torch {torch.__version__}; a fresh process per mode")
    print(f"command: python scripts/lowmem_memory.py {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip())
    print(f"  {'mode':<14} {'persistent':>10} {'peak':>9} {'B/param':>8} {'vs O5':>7} {'report':>7} "
          f"{'process peak':>12}  growth per phase (MiB)")
    ok = True
    for mode, r in res.items():
        per = r["peak"] / n
        saved = (res["O5"]["peak"] - r["peak"]) / n
        phases = ", ".join(f"{k} +{v / mib:.0f}" for k, v in r["growth"].items())
        print(f"  {mode:<14} {r['persistent'] / mib:8.1f}Mi {r['peak'] / mib:7.1f}Mi {per:8.2f} {saved:+7.2f} "
              f"{r['bytes_per_param_report']:7.2f} {r['process_peak'] / mib:10.1f}Mi  {phases}")
        if mode in TARGETS:
            ok &= saved >= TARGETS[mode]
    print("  B/param: peak bytes per parameter; vs O5: bytes per parameter saved against O5 (targets: "
          + ", ".join(f"{m} >= {t}" for m, t in TARGETS.items()) + f"): {'met' if ok else 'NOT met'}; report: "
          "report().bytes_per_param (weights + masters or compensations)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
