"""Section gpu (issue 13): a GPU-sized transformer in every mode, the default with
`--device cuda` (the CPU-sized workloads are launch-bound there and say nothing about mixed
precision); on CUDA also each mode's peak memory. `--quick` shrinks it so that the code path
also runs on a CPU."""
from __future__ import annotations

import gc
import statistics
from typing import Any

import torch

import ampatch as amp

from .. import workloads
from ..harness import MODES, Env, Log, interleaved, scaled, summarise, timed_steps
from ..meter import PeakMeter
from ..targets import Target, TargetBlock

# Issue 13's workload: TransformerEncoder(d_model 1024, 16 heads, 6 layers), batch 16 x 512
# tokens. --quick (the smoke test, on any device) keeps the shape of the code, not the size.
SETTINGS = (dict(d_model=64, heads=4, layers=2, batch=2, seq=16, rounds=2, warmup=1, steps=2),
            dict(d_model=1024, heads=16, layers=6, batch=16, seq=512, rounds=5, warmup=3, steps=5))
SHAPE = ("d_model", "heads", "layers", "batch", "seq")

TARGETS = TargetBlock("targets (issue 13, GPU workload)", {
    "gpu.O1/autocast": Target(1.03, "GPU transformer step, O1 / autocast+GradScaler"),
    "gpu.O2/autocast": Target(0.85, "GPU transformer step, O2 / autocast+GradScaler"),
    "gpu.O2_peak/(autocast_peak+masters)": Target(1.0, "GPU transformer peak memory, O2 / (autocast + FP32 masters)"),
}, width=62)

PAIRS = [("O1", "autocast"), ("O2", "autocast"), ("O3", "autocast"), ("O2", "O3"),
         ("autocast", "fp32"), ("O1", "fp32"), ("O2", "fp32"), ("O3", "fp32")]


def settings(quick: bool) -> dict[str, int]:
    return SETTINGS[0 if quick else 1]


def run(env: Env, quick: bool, log: Log) -> dict[str, Any]:
    """Interleaved rounds as in the training sections; on CUDA also each mode's peak memory:
    the most allocated over its block (model copy, optimizer state, masters, activations),
    less what was allocated before it (the template model and the data)."""
    c = settings(quick)
    torch.manual_seed(0)
    base, data, loss_fn = workloads.gpu_transformer(env, c)
    peaks: dict[str, list[int]] = {m: [] for m in MODES}
    losses: dict[str, float] = {}
    master_bytes = 0
    meter = PeakMeter(env.device)

    def measure(mode: str) -> float:
        nonlocal master_bytes
        gc.collect()
        if env.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            meter.start()
        step, opt = workloads.make_mode(mode, base, data, loss_fn, env)
        try:
            if mode == "O2":
                master_bytes = sum(p.numel() * p.element_size() for p in amp.master_params(opt))
            for _ in range(c["warmup"]):
                step()
            times, loss = timed_steps(step, c["steps"], env)
            losses[mode] = float(loss.detach().float())
            if env.cuda:  # before deinitialize, which casts the model back to FP32
                peaks[mode].append(meter.growth())
        finally:
            amp.deinitialize()
        del step, opt, loss  # the loss's graph holds the params (AccumulateGrad): free them all
        return statistics.median(times)

    per_round = interleaved(MODES, c["rounds"], measure, log, "gpu")
    medians, ratios = summarise(per_round, PAIRS)
    out: dict[str, Any] = {
        "config": {k: c[k] for k in SHAPE},
        "half_dtype": env.half_name,
        "grad_scaler": env.half == torch.float16,
        "median_step_ms": scaled(medians, 1e3), "ratios": ratios,
        "per_round_ms": {m: [v * 1e3 for v in vs] for m, vs in per_round.items()},
        "final_loss": losses, "master_bytes": master_bytes,
        "params": sum(p.numel() for p in base.parameters())}
    if env.cuda:
        peak = {m: int(statistics.median(v)) for m, v in peaks.items()}
        out["peak_bytes"] = peak
        out["ratios"]["O2_peak/(autocast_peak+masters)"] = peak["O2"] / (peak["autocast"] + master_bytes)
        out["ratios"]["O2_peak/autocast_peak"] = peak["O2"] / peak["autocast"]
    return out


def ratios(result: dict[str, Any]) -> dict[str, float]:
    return {f"gpu.{k}": v for k, v in result["ratios"].items()}


def render(results: dict[str, Any]) -> list[str]:
    if "gpu" not in results:
        return []
    g = results["gpu"]
    c = g["config"]
    recipe = "autocast with GradScaler" if g["grad_scaler"] else "autocast (bfloat16: no GradScaler)"
    lines = [f"GPU-sized transformer: TransformerEncoder(d_model {c['d_model']}, {c['heads']} heads, {c['layers']} "
             f"layers), batch {c['batch']} x {c['seq']} tokens, AdamW, {g['half_dtype']}, {recipe}; "
             f"{g['params'] / 1e6:.1f}M params",
             f"{'mode':<10}{'step ms':>10}{'vs fp32':>10}{'vs autocast':>13}{'peak MiB':>11}{'final loss':>12}"]
    ms, peak = g["median_step_ms"], g.get("peak_bytes", {})
    for m in MODES:
        vs_fp32 = ms["fp32"] / ms[m]
        vs_ac = ms[m] / ms["autocast"]
        p = f"{peak[m] / 2**20:.0f}" if m in peak else "-"
        lines.append(f"{m:<10}{ms[m]:>10.2f}{vs_fp32:>9.2f}x{vs_ac:>12.3f}x{p:>11}{g['final_loss'][m]:>12.4g}")
    if peak:
        lines.append(f"FP32 masters under O2: {g['master_bytes'] / 2**20:.0f} MiB; O2 peak / (autocast peak + masters) "
                     f"= {g['ratios']['O2_peak/(autocast_peak+masters)']:.3f}")
    else:
        lines.append("peak memory: measured on CUDA only")
    lines += TARGETS.lines(ratios(g))
    return lines + [""]
