"""Section micro: the per-call overhead of O1's wrappers on tiny ops (against no patching and
torch.autocast), and the unscale + inf/NaN check against GradScaler's."""
from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import ampatch as amp
from ampatch.optim.scaler import unscale_ as amp_unscale_

from ..harness import Env, Log, interleaved, median_difference, quiet_gc, scaled, summarise, time_calls
from ..targets import Target

# rounds (interleaved), calls per timed block, unscale calls per round: (--quick, full run)
SETTINGS = (dict(rounds=3, calls=200, unscale_calls=5), dict(rounds=31, calls=5000, unscale_calls=40))

# The calls, in the report's order, with the report's label.
LABELS = {"linear": "F.linear 4x16 @ 16x16 (param weight, grad on)",
          "add": "x + y, 4x16 (not wrapped)",
          "nocast": "torch.softmax fp32 (wrapped, nothing to cast)",
          "nocast_method": "x.sum() fp32 (wrapped method, nothing to cast)",
          "nocast_nested": "F.softmax fp32 (2 wrappers, nothing to cast)"}

# Issue 8's targets on these calls.
TARGETS: dict[str, Target] = {
    "micro.linear.O1/autocast": Target(1.25, "tiny F.linear, O1 / autocast"),
    "micro.add.O1-unpatched_us": Target(0.5, "x + y under O1 minus unpatched (us)"),
    "micro.nocast.O1-unpatched_us": Target(0.5, "wrapped op, nothing to cast: O1 minus unpatched (us)"),
    "micro.unscale.ampatch/GradScaler": Target(1.1, "unscale+check of 200 grads / GradScaler.unscale_"),
}

UNSCALE_GRADS, UNSCALE_SHAPE, UNSCALE_SCALE = 200, (64, 64), 2.0 ** 16


def settings(quick: bool) -> dict[str, int]:
    return SETTINGS[0 if quick else 1]


@contextlib.contextmanager
def o1_session(env: Env) -> Iterator[None]:
    """An O1 session (its patches are process-wide) on a dummy model."""
    amp.initialize(nn.Linear(1, 1).to(env.device), opt_level="O1", half_dtype=env.half, verbosity=0)
    try:
        yield
    finally:
        amp.deinitialize()


def run(env: Env, quick: bool, log: Log) -> dict[str, Any]:
    """us per call of each call unpatched, under autocast and under O1, in interleaved rounds."""
    cfg = settings(quick)
    dev = env.device
    w = nn.Parameter(torch.randn(16, 16, device=dev))
    b = nn.Parameter(torch.randn(16, device=dev))
    x = torch.randn(4, 16, device=dev)
    y = torch.randn(4, 16, device=dev)
    calls = cfg["calls"]

    # torch.* / F.* / methods are looked up at call time: under O1 they are the patched objects.
    calls_by_key: dict[str, Callable[[], Any]] = {
        "linear": lambda: F.linear(x, w, b),      # HALF: x is cast, w and b come from the cast cache
        "add": lambda: x + y,                     # not wrapped (torch promotes natively)
        "nocast": lambda: torch.softmax(x, -1),   # FLOAT, one wrapper, FP32 input: nothing to cast
        "nocast_method": lambda: x.sum(),         # FLOAT Tensor method, nothing to cast
        "nocast_nested": lambda: F.softmax(x, -1),  # F.softmax -> Tensor.softmax: two wrappers
    }
    variants = {"unpatched": contextlib.nullcontext, "autocast": env.autocast, "O1": lambda: o1_session(env)}

    def measure(variant: str) -> dict[str, float]:
        out = {}
        with variants[variant]():
            for key, fn in calls_by_key.items():
                time_calls(fn, calls // 10, env)  # warm-up (the first call fills the cast caches)
                out[key] = time_calls(fn, calls, env)
        return out

    rounds = interleaved(list(variants), cfg["rounds"], measure)
    out: dict[str, Any] = {}
    for key in calls_by_key:
        per_round = {v: [r[key] for r in rounds[v]] for v in variants}
        medians, ratios = summarise(per_round, [("O1", "autocast"), ("O1", "unpatched"), ("autocast", "unpatched")])
        out[key] = {"us_per_call": scaled(medians, 1e6), "ratios": ratios,
                    "O1-unpatched_us": median_difference(per_round["O1"], per_round["unpatched"]) * 1e6,
                    "autocast-unpatched_us": median_difference(per_round["autocast"], per_round["unpatched"]) * 1e6}
    log("  micro: calls done")
    out["unscale"] = run_unscale(env, cfg)
    log("  micro: unscale done")
    return out


def run_unscale(env: Env, cfg: dict[str, int]) -> dict[str, Any]:
    """Unscale + inf/NaN check of 200 FP32 grads (64 x 64), scale 2**16, like with like:

    - "ampatch": grads collected from the optimizer's param_groups, then
      ampatch.optim.scaler.unscale_ (the fused kernel path scale_loss's exit uses) - against
      "GradScaler": torch.amp.GradScaler.unscale_(optimizer) (collects grads, fused kernel;
      no host sync; neither includes the skip decision).
    - "ampatch_exit": the whole amp.scale_loss exit at O1 with a dynamic scale (param walk,
      unscale + check, host-side verdict, scale update, cache clear) - against
      "GradScaler_full": unscale_ + the found-inf host read + update().
    Grads are reset to the same scaled values, untimed, before every timed call.
    """
    dev, n, scale = env.device, UNSCALE_GRADS, UNSCALE_SCALE
    params = [nn.Parameter(torch.zeros(*UNSCALE_SHAPE, device=dev)) for _ in range(n)]
    pristine = [torch.randn(*UNSCALE_SHAPE, device=dev) * scale for _ in range(n)]
    grads = [g.clone() for g in pristine]
    opt = torch.optim.AdamW(params, lr=1e-4)

    def reset() -> None:
        torch._foreach_copy_(grads, pristine)
        for p, g in zip(params, grads):
            p.grad = g

    def timed(fn: Callable[[], Any], after: Callable[[], Any] = lambda: None) -> float:
        times = []
        with quiet_gc():
            for _ in range(cfg["unscale_calls"]):
                reset()
                env.sync()
                t0 = env.now()
                fn()
                env.sync()
                times.append(env.now() - t0)
                after()
        return statistics.median(times)

    def ampatch_unscale() -> None:
        gs = [p.grad for group in opt.param_groups for p in group["params"] if p.grad is not None]
        amp_unscale_(gs, 1.0 / scale, None)

    gscaler = torch.amp.GradScaler(env.device.type, init_scale=scale, growth_interval=10 ** 9)
    gscaler.scale(torch.ones((), device=dev))  # lazy init of its scale tensor

    def gradscaler_unscale() -> None:
        gscaler.unscale_(opt)

    def gradscaler_full() -> None:
        gscaler.unscale_(opt)
        _ = sum(v.item() for v in gscaler._found_inf_per_device(opt).values())  # the skip decision's read
        gscaler.update()

    def ampatch_exit_round() -> float:
        amp.initialize(nn.Linear(1, 1).to(dev), opt, opt_level="O1", half_dtype=env.half, loss_scale="dynamic",
                       verbosity=0)
        try:
            times = []
            loss = torch.zeros((), device=dev, requires_grad=True)
            with quiet_gc():
                for _ in range(cfg["unscale_calls"]):
                    for p in params:
                        p.grad = None
                    cm = amp.scale_loss(loss, opt)
                    cm.__enter__()      # stashes nothing (grads are None), as before a real backward
                    reset()             # "backward": scaled grads appear
                    env.sync()
                    t0 = env.now()
                    cm.__exit__(None, None, None)
                    env.sync()
                    times.append(env.now() - t0)
            return statistics.median(times)
        finally:
            amp.deinitialize()

    variants: dict[str, Callable[[], float]] = {
        "ampatch": lambda: timed(ampatch_unscale),
        "GradScaler": lambda: timed(gradscaler_unscale, gscaler.update),
        "ampatch_exit": ampatch_exit_round,
        "GradScaler_full": lambda: timed(gradscaler_full),
    }
    per_round = interleaved(list(variants), max(3, cfg["rounds"] // 2), lambda k: variants[k]())
    medians, ratios = summarise(per_round, [("ampatch", "GradScaler"), ("ampatch_exit", "GradScaler_full")])
    return {"us_per_call": scaled(medians, 1e6), "ratios": ratios, "grads": n, "grad_shape": list(UNSCALE_SHAPE)}


def ratios(result: dict[str, Any]) -> dict[str, float]:
    flat: dict[str, float] = {}
    for key in LABELS:
        for k, v in result[key]["ratios"].items():
            flat[f"micro.{key}.{k}"] = v
        flat[f"micro.{key}.O1-unpatched_us"] = result[key]["O1-unpatched_us"]
        flat[f"micro.{key}.autocast-unpatched_us"] = result[key]["autocast-unpatched_us"]
    for k, v in result["unscale"]["ratios"].items():
        flat[f"micro.unscale.{k}"] = v
    return flat


def render(results: dict[str, Any]) -> list[str]:
    if "micro" not in results:
        return []
    micro = results["micro"]
    lines = ["micro, us per call (median of rounds)          unpatched  autocast        O1   O1/autocast  "
             "O1-unpatched"]
    for key, label in LABELS.items():
        m = micro[key]
        u = m["us_per_call"]
        lines.append(f"{label:<47}{u['unpatched']:>8.2f}{u['autocast']:>10.2f}{u['O1']:>10.2f}"
                     f"{m['ratios']['O1/autocast']:>14.3f}{m['O1-unpatched_us']:>+13.2f}")
    un = micro["unscale"]
    u = un["us_per_call"]
    lines.append(f"unscale + inf check, {un['grads']} grads 64x64: ampatch.optim.scaler.unscale_ "
                 f"{u['ampatch']:.1f} us vs GradScaler.unscale_ {u['GradScaler']:.1f} us -> "
                 f"{un['ratios']['ampatch/GradScaler']:.3f}")
    lines.append(f"  whole scale_loss exit (O1, dynamic) {u['ampatch_exit']:.1f} us vs GradScaler unscale_+"
                 f"found_inf read+update {u['GradScaler_full']:.1f} us -> "
                 f"{un['ratios']['ampatch_exit/GradScaler_full']:.3f}")
    return lines + [""]

