"""Section compiled (issue 13): the transformer step with its forward and loss under
torch.compile, O1 and O2 against torch.compile + torch.autocast, and the graph breaks of each."""
from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import ampatch as amp

from .. import workloads
from ..harness import Env, Log, interleaved, timed_steps
from ..targets import Target, TargetBlock

SETTINGS = (dict(rounds=2, warmup=1, steps=1), dict(rounds=7, warmup=2, steps=3))  # (--quick, full run)
LEVELS = ("O1", "O2")
BACKEND = "inductor"

TARGETS = TargetBlock("targets (issue 13)", {
    "compiled.O1/autocast": Target(1.02, "compiled transformer step, O1 / autocast"),
    "compiled.O2/autocast": Target(1.02, "compiled transformer step, O2 / autocast"),
})


def settings(quick: bool) -> dict[str, int]:
    return SETTINGS[0 if quick else 1]


def run(env: Env, quick: bool, log: Log, backend: str = BACKEND) -> dict[str, Any]:
    """The transformer's forward and loss compiled once per mode (after amp.initialize);
    optimizer and scale_loss run eagerly; plus torch._dynamo.explain's graph breaks.

    One phase per level: its session stays up while its rounds interleave with autocast's
    (a new session would mean a new compile). Under the O1 session the autocast steps run
    inside amp.disable_casts(): O1's patches are process-wide, and disabled they compile to
    the plain ops, so autocast has one compiled graph per phase."""
    import torch._dynamo

    cfg = settings(quick)
    torch.manual_seed(0)
    base, (x, y), loss_fn = workloads.transformer(env)
    modes = ("autocast",) + LEVELS
    models = {m: copy.deepcopy(base) for m in modes}
    opts = {m: torch.optim.AdamW(models[m].parameters(), lr=1e-4) for m in modes}

    def forward_and_loss(model: nn.Module) -> Callable:
        def fwd(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return loss_fn(model(x), y)
        return fwd

    fwds = {m: forward_and_loss(models[m]) for m in modes}
    compiled = {m: torch.compile(fwds[m], backend=backend) for m in modes}

    def step(mode: str) -> None:
        opt = opts[mode]
        opt.zero_grad()
        if mode == "autocast":
            with amp.disable_casts(), env.autocast():
                loss = compiled[mode](x, y)
            with amp.disable_casts():
                loss.backward()
                opt.step()
            return
        loss = compiled[mode](x, y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()

    def graph_breaks(mode: str) -> dict[str, int]:
        if mode == "autocast":
            with env.autocast():
                explained = torch._dynamo.explain(fwds[mode])(x, y)
        else:
            explained = torch._dynamo.explain(fwds[mode])(x, y)
        return {"graphs": explained.graph_count, "graph_breaks": explained.graph_break_count}

    def measure(mode: str) -> float:
        return statistics.median(timed_steps(lambda: step(mode), cfg["steps"], env)[0])

    breaks = {"autocast": graph_breaks("autocast")}
    per_round: dict[str, list[float]] = {}
    recompiles = 0
    for level in LEVELS:
        amp.initialize(models[level], opts[level], opt_level=level, half_dtype=env.half, verbosity=0)
        try:
            breaks[level] = graph_breaks(level)
            t0 = time.perf_counter()
            for mode in ("autocast", level):  # compile outside the timed rounds
                for _ in range(cfg["warmup"]):
                    step(mode)
            log(f"  compiled: {level} and autocast compiled with {backend} in {time.perf_counter() - t0:.1f} s")
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            phase = interleaved(("autocast", level), cfg["rounds"], measure, log, f"compiled: {level}")
            per_round[level], per_round[f"autocast@{level}"] = phase[level], phase["autocast"]
            recompiles += torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
        finally:
            amp.deinitialize()
    per_round = {m: per_round[m] for m in ("O1", "O2", "autocast@O1", "autocast@O2")}  # the JSON's order
    ratios = {f"{level}/autocast": statistics.median(
        a / b for a, b in zip(per_round[level], per_round[f"autocast@{level}"])) for level in LEVELS}
    medians = {m: statistics.median(v) * 1e3 for m, v in per_round.items()}
    medians["autocast"] = statistics.median(per_round["autocast@O1"] + per_round["autocast@O2"]) * 1e3
    return {"backend": backend, "median_step_ms": medians, "ratios": ratios, "graph_breaks": breaks,
            "recompiles_during_rounds": recompiles, "flat": ratios_of(ratios),
            "per_round_ms": {m: [v * 1e3 for v in vs] for m, vs in per_round.items()}}


def ratios_of(ratios: dict[str, float]) -> dict[str, float]:
    return {f"compiled.{k}": v for k, v in ratios.items()}


def ratios(result: dict[str, Any]) -> dict[str, float]:
    return dict(result["flat"])


def render(results: dict[str, Any]) -> list[str]:
    """Its own block, after issue 8's targets, with its targets (a blank line before)."""
    if "compiled" not in results:
        return []
    c = results["compiled"]
    ms, b = c["median_step_ms"], c["graph_breaks"]
    lines = ["", f"torch.compile (backend {c['backend']}), transformer step, median ms; graphs / graph breaks "
             f"(torch._dynamo.explain); recompiles during the timed rounds: {c['recompiles_during_rounds']}",
             f"{'':<12}{'autocast':>10}{'O1':>10}{'O2':>10}{'O1/autocast':>13}{'O2/autocast':>13}",
             f"{'step ms':<12}{ms['autocast']:>10.2f}{ms['O1']:>10.2f}{ms['O2']:>10.2f}"
             f"{c['ratios']['O1/autocast']:>13.3f}{c['ratios']['O2/autocast']:>13.3f}",
             f"{'graphs/brk':<12}" + "".join(f"{b[m]['graphs']:>6}/{b[m]['graph_breaks']:<3}" for m in
                                            ("autocast",) + LEVELS)]
    lines += TARGETS.lines(c["flat"])
    same = all(b[m] == b["autocast"] for m in LEVELS)
    lines.append(f"  {'graph breaks equal to autocast':<55} {'yes' if same else 'NO':>8}")
    return lines
