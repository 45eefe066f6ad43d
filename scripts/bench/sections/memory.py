"""Section memory: the CNN's peak memory of a training step, O2 against O0, each run in a
fresh process (`python -m bench.child memory`)."""
from __future__ import annotations

import gc
import statistics
import subprocess
from typing import Any

import torch

import ampatch as amp

from .. import workloads
from ..harness import Env, Log, interleaved
from ..meter import PeakMeter, optimizer_state, persistent_bytes, storage_bytes
from ..spawn import child_command, child_environment, child_result
from ..targets import Target

SETTINGS = (dict(rounds=1, steps=3), dict(rounds=2, steps=4))  # (--quick, full run)
LEVELS = ("O0", "O2")
WARMUP = 2  # steps before the measured ones: lazy kernel set-up, optimizer state, allocator

# Issue 8's target.
TARGETS: dict[str, Target] = {"memory.cnn.O2/O0": Target(0.65, "CNN peak memory, O2 / O0")}

WHAT = ("peak = persistent training state (params, buffers, FP32 masters, optimizer state: exact bytes "
        "of their storages) + the transient peak of a steady-state step (CPU: growth of the peak RSS "
        "over the step, after 2 warm-up steps, malloc set to return freed blocks to the OS; CUDA: "
        "max_memory_allocated over the step); one fresh process per run. One-time process costs "
        "(kernel code, allocator pools) are left out. live tensors: unique storages of params, masters, "
        "optimizer state and saved activations at the end of the last forward")


def settings(quick: bool) -> dict[str, int]:
    return SETTINGS[0 if quick else 1]


def measure_in_child(level: str, env: Env, steps: int) -> dict[str, Any]:
    """One level's figures, in the child process (see WHAT): `steps` training steps of the
    CNN, the ones after WARMUP measured."""
    torch.manual_seed(0)
    base, (x, y), loss_fn = workloads.cnn(env)
    model, opt = amp.initialize(base, torch.optim.AdamW(base.parameters(), lr=1e-4), opt_level=level,
                                half_dtype=env.half, verbosity=0)
    meter = PeakMeter(env.device)
    saved: list[torch.Tensor] = []
    transient, live, persistent = [], 0, 0
    for i in range(steps):
        measured = i >= WARMUP and meter.available
        last = i == steps - 1
        opt.zero_grad()
        gc.collect()
        if measured:
            meter.start()
        persistent = persistent_bytes(model, opt)
        saved.clear()

        def pack(t: torch.Tensor, keep: bool = last) -> torch.Tensor:  # this step's `last`, bound now
            if keep:
                saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = loss_fn(model(x), y)
        if last:
            live = storage_bytes(list(model.parameters()) + list(model.buffers()) + list(amp.master_params(opt))
                                 + optimizer_state(opt) + saved)
            saved.clear()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        del loss
        if measured:
            transient.append(meter.growth())
    amp.deinitialize()
    peak = persistent + max(transient) if transient else None
    return {"peak_bytes": peak, "persistent_bytes": persistent,
            "transient_bytes": max(transient) if transient else None, "live_tensor_bytes": live}


def run(env: Env, quick: bool, log: Log) -> dict[str, Any]:
    """O0 and O2 in interleaved rounds, a fresh child process each; medians and O2/O0 ratios."""
    cfg = settings(quick)

    def measure(level: str) -> dict[str, Any]:
        proc = subprocess.run(child_command("memory", env, level=level, steps=cfg["steps"]), capture_output=True,
                              text=True, check=False, env=child_environment())
        return child_result(f"memory {level}", proc.returncode, proc.stdout, proc.stderr)

    per_round = interleaved(LEVELS, cfg["rounds"], measure, log, "memory")
    out: dict[str, Any] = {"what": WHAT}
    for key in ("peak_bytes", "persistent_bytes", "live_tensor_bytes"):
        vals = {m: [d[key] for d in v] for m, v in per_round.items()}
        if any(x is None for v in vals.values() for x in v):
            continue
        out[key] = {m: statistics.median(v) for m, v in vals.items()}
        out[key + "_ratio"] = out[key]["O2"] / out[key]["O0"]
    out["O2/O0"] = out.get("peak_bytes_ratio", out["live_tensor_bytes_ratio"])
    return out


def ratios(result: dict[str, Any]) -> dict[str, float]:
    flat = {"memory.cnn.O2/O0": result["O2/O0"]}
    if "live_tensor_bytes_ratio" in result:
        flat["memory.cnn.live_tensor_bytes.O2/O0"] = result["live_tensor_bytes_ratio"]
    return flat


def render(results: dict[str, Any]) -> list[str]:
    if "memory" not in results:
        return []
    mem, mib, lines = results["memory"], 2 ** 20, []
    if "peak_bytes" in mem:
        pb = mem["peak_bytes"]
        lines.append(f"CNN peak memory of a training step (a decomposition, not the process peak): O0 "
                     f"{pb['O0'] / mib:.1f} MiB, O2 {pb['O2'] / mib:.1f} MiB -> "
                     f"{mem['peak_bytes_ratio']:.3f}")
    lb = mem["live_tensor_bytes"]
    lines.append(f"CNN live tensors at end of forward: O0 {lb['O0'] / mib:.1f} MiB, O2 {lb['O2'] / mib:.1f} "
                 f"MiB -> {mem['live_tensor_bytes_ratio']:.3f}")
    lines.append(f"  (persistent O0 {mem['persistent_bytes']['O0'] / mib:.2f} MiB, O2 "
                 f"{mem['persistent_bytes']['O2'] / mib:.2f} MiB; {mem['what']})")
    return lines + [""]
