"""Section o1 (issue 44): O1 at torch.autocast's cost, measured on the calls where O1's own
work shows (tiny layers: per-call overhead, not arithmetic).

- `F.linear` forward, 4x16 and 8x64 (parameter weight and bias, gradients on): each run of
  calls under a fresh O1 session or a fresh autocast region, so both serve the weights from
  their caches after the first call;
- a training step of 16 x (Linear(16, 16) + GELU), batch 16, MSE, AdamW, each mode as its
  recipe says (O1: `scale_loss` and the patched optimizer; autocast: its region), timed by
  phase (zero_grad, forward and loss, backward with `scale_loss`, step); and the same with
  forward and loss under `torch.compile` (Inductor; imported first by this section when it
  runs first, so under the O1 session, as in issue 44).

Rounds interleave O1 with autocast; a ratio is the median of per-round ratios (the clock is
the harness's: thread CPU time on CPU with one torch thread). Under the compiled phase's O1
session, autocast's steps run inside `amp.disable_casts()` (one compiled graph each).
"""
from __future__ import annotations

import contextlib
import copy
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import ampatch as amp

from ..harness import Env, Log, interleaved, quiet_gc, summarise, time_calls
from ..targets import Target, TargetBlock

MODES = ("autocast", "O1")
LINEARS = {"linear_4x16": (4, 16), "linear_8x64": (8, 64)}
DEPTH, WIDTH, BATCH = 16, 16, 16
PHASES = ("zero_grad", "forward", "backward", "step")
# (--quick, full run): interleaved rounds of each case, calls per timed block, steps per block
SETTINGS = (dict(rounds=3, calls=200, step_rounds=3, warmup=1, steps=3),
            dict(rounds=21, calls=3000, step_rounds=15, warmup=3, steps=15))

TARGETS = TargetBlock("targets (issue 44)", {
    "o1.linear_8x64.O1/autocast": Target(1.15, "F.linear 8x64 forward, O1 / autocast"),
    "o1.mlp16.O1/autocast": Target(1.07, "16 x (Linear(16,16)+GELU) train step, O1 / autocast"),
    "o1.mlp16_compiled.O1/autocast": Target(1.05, "the same under torch.compile, O1 / autocast"),
}, width=58)


def settings(quick: bool) -> dict[str, int]:
    return SETTINGS[0 if quick else 1]


def run(env: Env, quick: bool, log: Log) -> dict[str, Any]:
    cfg = settings(quick)
    out: dict[str, Any] = {key: run_linear(env, cfg, *shape) for key, shape in LINEARS.items()}
    log("  o1: F.linear done")
    out["mlp16"] = run_step(env, cfg, log)
    out["mlp16_compiled"] = run_compiled(env, cfg, log)
    return out


def run_linear(env: Env, cfg: dict[str, int], batch: int, width: int) -> dict[str, Any]:
    """us per `F.linear(x, w, b)` call under autocast and under O1, in interleaved rounds."""
    w = nn.Parameter(torch.randn(width, width, device=env.device))
    b = nn.Parameter(torch.randn(width, device=env.device))
    x = torch.randn(batch, width, device=env.device)
    call = lambda: F.linear(x, w, b)  # noqa: E731 - looked up at call time: the patched one under O1

    def measure(mode: str) -> float:
        if mode == "O1":
            amp.initialize(nn.Linear(1, 1).to(env.device), opt_level="O1", half_dtype=env.half, verbosity=0)
        try:
            with env.autocast() if mode == "autocast" else contextlib.nullcontext():
                time_calls(call, cfg["calls"] // 10, env)  # warm-up: the first call fills the cache
                t = time_calls(call, cfg["calls"], env)
                env.sync()
                return t
        finally:
            amp.deinitialize()

    per_round = interleaved(MODES, cfg["rounds"], measure)
    medians, ratios = summarise(per_round, [("O1", "autocast")])
    return {"us_per_call": {m: v * 1e6 for m, v in medians.items()}, "ratios": ratios, "rounds": cfg["rounds"]}


def mlp(env: Env) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
    return (nn.Sequential(*layers).to(env.device), torch.randn(BATCH, WIDTH, device=env.device),
            torch.randn(BATCH, WIDTH, device=env.device))


def phased_step(mode: str, model: nn.Module, opt: torch.optim.Optimizer, forward: Callable, env: Env,
                scaler: Any = None) -> Callable[[], dict[str, float]]:
    """One training step of `mode`, returning the seconds of each of `PHASES`."""
    def step() -> dict[str, float]:
        t = [env.now()]

        def tick() -> None:  # the end of a phase: wait for the device, then read the clock
            env.sync()
            t.append(env.now())

        opt.zero_grad()
        tick()
        if mode == "autocast":
            with env.autocast():
                loss = forward()
            tick()
            (scaler.scale(loss) if scaler is not None else loss).backward()
            tick()
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
        else:
            loss = forward()
            tick()
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            tick()
            opt.step()
        tick()
        return {p: t[i + 1] - t[i] for i, p in enumerate(PHASES)}
    return step


def _block(step: Callable[[], dict[str, float]], cfg: dict[str, int]) -> dict[str, float]:
    """Warm-up, then the median of each phase and of the total over `steps` steps."""
    for _ in range(cfg["warmup"]):
        step()
    with quiet_gc():
        runs = [step() for _ in range(cfg["steps"])]
    out = {p: statistics.median(r[p] for r in runs) for p in PHASES}
    out["total"] = statistics.median(sum(r.values()) for r in runs)
    return out


def run_step(env: Env, cfg: dict[str, int], log: Log) -> dict[str, Any]:
    """The eager training step, each round on fresh copies (a new O1 session per O1 block)."""
    base, x, y = mlp(env)

    def measure(mode: str) -> dict[str, float]:
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        scaler = torch.amp.GradScaler(env.device.type) if mode == "autocast" and env.half == torch.float16 else None
        if mode == "O1":
            model, opt = amp.initialize(model, opt, opt_level="O1", half_dtype=env.half, verbosity=0)
        try:
            return _block(phased_step(mode, model, opt, lambda: F.mse_loss(model(x), y), env, scaler), cfg)
        finally:
            amp.deinitialize()

    per_round = interleaved(MODES, cfg["step_rounds"], measure, log, "o1 mlp16")
    return _step_summary(per_round, cfg)


def run_compiled(env: Env, cfg: dict[str, int], log: Log) -> dict[str, Any]:
    """Forward and loss compiled once per mode (Inductor) inside one O1 session; autocast's
    steps inside `amp.disable_casts()`, its optimizer outside the session."""
    base, x, y = mlp(env)
    models = {m: copy.deepcopy(base) for m in MODES}
    opts = {m: torch.optim.AdamW(models[m].parameters(), lr=1e-4) for m in MODES}
    models["O1"], opts["O1"] = amp.initialize(models["O1"], opts["O1"], opt_level="O1", half_dtype=env.half,
                                              verbosity=0)
    try:
        compiled = {m: torch.compile(lambda model=models[m]: F.mse_loss(model(x), y)) for m in MODES}
        scaler = torch.amp.GradScaler(env.device.type) if env.half == torch.float16 else None
        steps = {"O1": phased_step("O1", models["O1"], opts["O1"], compiled["O1"], env)}
        autocast_step = phased_step("autocast", models["autocast"], opts["autocast"], compiled["autocast"], env,
                                    scaler)

        def autocast_off_o1() -> dict[str, float]:
            with amp.disable_casts():
                return autocast_step()

        steps["autocast"] = autocast_off_o1
        for mode in MODES:  # compile outside the timed rounds
            for _ in range(2):
                steps[mode]()
        log("  o1: mlp16 compiled")
        per_round = interleaved(MODES, cfg["step_rounds"], lambda m: _block(steps[m], cfg), log, "o1 compiled")
    finally:
        amp.deinitialize()
    return _step_summary(per_round, cfg)


def _step_summary(per_round: dict[str, list[dict[str, float]]], cfg: dict[str, int]) -> dict[str, Any]:
    totals = {m: [r["total"] for r in rounds] for m, rounds in per_round.items()}
    medians, ratios = summarise(totals, [("O1", "autocast")])
    phases = {m: {p: statistics.median(r[p] for r in rounds) * 1e6 for p in PHASES} for m, rounds in per_round.items()}
    return {"us_per_step": {m: v * 1e6 for m, v in medians.items()}, "ratios": ratios, "phases_us": phases,
            "rounds": cfg["step_rounds"], "steps": cfg["steps"]}


def ratios(result: dict[str, Any]) -> dict[str, float]:
    return {f"o1.{case}.{k}": v for case, r in result.items() for k, v in r["ratios"].items()}


LABELS = {"linear_4x16": "F.linear 4x16 forward (us per call)", "linear_8x64": "F.linear 8x64 forward (us per call)",
          "mlp16": f"{DEPTH} x (Linear({WIDTH},{WIDTH})+GELU) train step (us)",
          "mlp16_compiled": "the same, torch.compile (inductor) (us)"}


def render(results: dict[str, Any]) -> list[str]:
    if "o1" not in results:
        return []
    o1 = results["o1"]
    lines = [f"O1 against torch.autocast (issue 44), batch {BATCH} for the step; median of per-round ratios",
             f"{'case':<48}{'autocast':>10}{'O1':>10}{'O1/autocast':>13}{'rounds':>8}"]
    for key, label in LABELS.items():
        r = o1[key]
        values = r.get("us_per_call") or r["us_per_step"]
        lines.append(f"{label:<48}{values['autocast']:>10.2f}{values['O1']:>10.2f}{r['ratios']['O1/autocast']:>13.3f}"
                     f"{r['rounds']:>8}")
    for key in ("mlp16", "mlp16_compiled"):
        ph = o1[key]["phases_us"]
        lines.append(f"  {key}, O1 - autocast by phase (us): " + ", ".join(
            f"{p} {ph['O1'][p] - ph['autocast'][p]:+.1f}" for p in PHASES))
    return lines + TARGETS.lines(ratios(o1)) + [""]
