"""Sections transformer, mlp, cnn: a training step in every mode (fp32, autocast, O1, O2,
O3), in interleaved rounds; one table for the three."""
from __future__ import annotations

import statistics
from typing import Any

import torch

import ampatch as amp

from .. import workloads
from ..harness import MODES, Env, Log, interleaved, scaled, summarise, timed_steps
from ..targets import Target

BUILDERS = {"transformer": workloads.transformer, "mlp": workloads.mlp, "cnn": workloads.cnn}
NAMES = tuple(BUILDERS)

# rounds (interleaved), warm-up steps and timed steps per mode block: (--quick, full run)
SETTINGS: dict[str, tuple[dict[str, int], dict[str, int]]] = {
    "transformer": (dict(rounds=2, warmup=1, steps=1), dict(rounds=9, warmup=2, steps=3)),
    "mlp": (dict(rounds=2, warmup=1, steps=2), dict(rounds=15, warmup=3, steps=10)),
    "cnn": (dict(rounds=2, warmup=1, steps=1), dict(rounds=5, warmup=2, steps=3)),
}

# Issue 8's targets on these workloads.
TARGETS: dict[str, Target] = {
    "transformer.O1/autocast": Target(1.03, "transformer step, O1 / autocast"),
    "transformer.O2/autocast": Target(0.95, "transformer step, O2 / autocast"),
    "transformer.O2/O3": Target(1.08, "transformer step, O2 / O3"),
    "mlp.O1/autocast": Target(1.10, "deep MLP step, O1 / autocast"),
    "mlp.O2/autocast": Target(0.95, "deep MLP step, O2 / autocast"),
}

PAIRS = [("O1", "autocast"), ("O2", "autocast"), ("O2", "O3"), ("O3", "autocast"),
         ("autocast", "fp32"), ("O1", "fp32"), ("O2", "fp32"), ("O3", "fp32")]
TABLE_RATIOS = ("O1/autocast", "O2/autocast", "O2/O3", "autocast/fp32")


def settings(name: str, quick: bool) -> dict[str, int]:
    return SETTINGS[name][0 if quick else 1]


def run(name: str, env: Env, quick: bool, log: Log) -> dict[str, Any]:
    """Median step time per mode, and the medians of per-round ratios of PAIRS."""
    cfg = settings(name, quick)
    torch.manual_seed(0)
    base, data, loss_fn = BUILDERS[name](env)

    def measure(mode: str) -> float:
        step, _ = workloads.make_mode(mode, base, data, loss_fn, env)
        try:
            for _ in range(cfg["warmup"]):
                step()
            times = timed_steps(step, cfg["steps"], env)[0]
        finally:
            amp.deinitialize()
        return statistics.median(times)

    per_round = interleaved(MODES, cfg["rounds"], measure, log, name)
    medians, ratios = summarise(per_round, PAIRS)
    return {"median_step_ms": scaled(medians, 1e3), "ratios": ratios,
            "per_round_ms": {m: [v * 1e3 for v in vs] for m, vs in per_round.items()}}


def ratios(name: str, result: dict[str, Any]) -> dict[str, float]:
    return {f"{name}.{k}": v for k, v in result["ratios"].items()}


def render(results: dict[str, Any]) -> list[str]:
    """One table for the workloads that ran (none: no lines)."""
    trained = [n for n in NAMES if n in results]
    if not trained:
        return []
    lines = ["training step, median ms (AdamW; ratios: median of per-round ratios, interleaved rounds)",
             f"{'workload':<12}" + "".join(f"{m:>9}" for m in MODES) + "".join(f"{k:>12}" for k in TABLE_RATIOS)]
    for n in trained:
        r = results[n]
        lines.append(f"{n:<12}" + "".join(f"{r['median_step_ms'][m]:>9.2f}" for m in MODES)
                     + "".join(f"{r['ratios'][k]:>12.3f}" for k in TABLE_RATIOS))
    return lines + [""]
