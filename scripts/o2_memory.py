#!/usr/bin/env python3
"""Where O2's peak memory goes, against torch.autocast, measured on CPU (issue 13's proxy).

On a GPU, `scripts/bench --device cuda` measures the peak with max_memory_allocated. On a
CPU there is no allocator counter, so this measures, for one training step of a transformer,
in a fresh process per mode (Linux only):

- persistent: exact bytes of the storages that live across steps (params, FP32 masters,
  optimizer state), after zero_grad(set_to_none=True);
- the growth of the peak RSS over the step, read after each phase (forward, backward,
  scale_loss exit, optimizer step), with malloc returning freed blocks to the OS
  (MALLOC_MMAP_THRESHOLD_), after two warm-up steps.

peak = persistent + the largest growth. Issue 13's target: O2 peak <= autocast peak + the FP32
master copy.

    python scripts/o2_memory.py                 # d_model 512, 4 layers, batch 4 x 128, bfloat16
    python scripts/o2_memory.py --one O2        # one mode in this process, its figures as JSON
                                                # (how the command runs each mode)
"""
from __future__ import annotations

import argparse
import gc
import json
import sys

import torch
import torch.nn.functional as F

# bench's memory section measures with the same meter (exact storage bytes + peak RSS growth),
# so the two scripts' figures stay comparable
from bench.meter import PeakMeter, measure_each_fresh, persistent_bytes, rss_measurable
from torch import nn

import ampatch as amp

MODES = ("autocast", "O2")


def measure(mode: str, a: argparse.Namespace) -> dict:
    """One mode's figures, measured in this process (see the module's docstring)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(a.d_model, a.heads, batch_first=True, dropout=0.0)
    model = nn.TransformerEncoder(layer, a.layers, enable_nested_tensor=False)
    x, y = torch.randn(a.batch, a.seq, a.d_model), torch.randn(a.batch, a.seq, a.d_model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    params = sum(p.numel() for p in model.parameters())
    half = getattr(torch, a.dtype)
    if mode != "autocast":
        model, opt = amp.initialize(model, opt, opt_level=mode, half_dtype=half, verbosity=0)
    meter = PeakMeter(torch.device("cpu"))
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        gc.collect()
        persistent = persistent_bytes(model, opt)
        meter.start()  # the peak RSS (VmHWM) restarts from the current RSS
        growth: dict[str, int] = {}

        def mark(name: str, growth: dict[str, int] = growth) -> None:  # this step's dict, bound now
            growth[name] = meter.growth()

        if mode == "autocast":
            with torch.autocast("cpu", dtype=half):
                loss = F.mse_loss(model(x), y)
            mark("forward")
            loss.backward()
            mark("backward")
        else:
            loss = F.mse_loss(model(x), y)
            mark("forward")
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
                mark("backward")
            mark("scale_loss exit")
        opt.step()
        mark("step")
        del loss
    amp.deinitialize()
    return {"params": params, "master_bytes": params * 4 if mode != "autocast" else 0,
            "persistent": persistent, "growth": growth, "peak": persistent + max(growth.values())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--one", choices=MODES, metavar="MODE",
                   help="measure only MODE, in this process, and print its figures as JSON (the command runs "
                        "each mode this way, in a fresh process)")
    a = p.parse_args(argv)
    if not rss_measurable():
        print("needs Linux's /proc/self/clear_refs", file=sys.stderr)
        return 2
    if a.one:
        print(json.dumps(measure(a.one, a)))
        return 0
    args = [f"--d-model={a.d_model}", f"--heads={a.heads}", f"--layers={a.layers}", f"--batch={a.batch}",
            f"--seq={a.seq}", f"--dtype={a.dtype}"]
    res = measure_each_fresh(__file__, args, MODES)
    mib = 2 ** 20
    print(f"O2 memory vs autocast, CPU proxy: TransformerEncoder(d_model {a.d_model}, {a.heads} heads, {a.layers} "
          f"layers), batch {a.batch} x {a.seq}, AdamW, {a.dtype}; {res['O2']['params'] / 1e6:.1f}M params, "
          f"torch {torch.__version__}")
    print(f"command: python scripts/o2_memory.py {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip())
    for mode in MODES:
        r = res[mode]
        phases = ", ".join(f"{k} +{v / mib:.1f}" for k, v in r["growth"].items())
        print(f"  {mode:<9} persistent {r['persistent'] / mib:7.1f} MiB; peak RSS growth through {phases}; "
              f"peak {r['peak'] / mib:.1f} MiB")
    masters = res["O2"]["master_bytes"]
    ratio = res["O2"]["peak"] / (res["autocast"]["peak"] + masters)
    print(f"  O2 peak / (autocast peak + FP32 masters {masters / mib:.1f} MiB) = {ratio:.3f} (target <= 1)")
    half_grads = res["O2"]["params"] * 2
    print(f"  O2's scale_loss exit turns the {a.dtype} model grads ({half_grads / mib:.1f} MiB) into FP32 master "
          f"grads ({masters / mib:.1f} MiB), a chunk at a time (master.py): its growth over backward is the masters' "
          "grads plus at most a chunk")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
