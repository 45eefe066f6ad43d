#!/usr/bin/env python3
"""Side-by-side benchmark: ampatch O1/O2/O3 against torch.autocast and plain FP32 (issue 8).

Every result is a ratio measured in one process with the modes interleaved: each round runs
every mode once, in a rotating order, and a ratio is the median over rounds of that round's
ratio. On a shared machine absolute times drift; ratios taken inside one round barely do.

    python scripts/bench.py                          # everything (< 5 minutes on 2 CPU cores)
    python scripts/bench.py --json bench.json        # the same, and the numbers as JSON
    python scripts/bench.py --quick --only micro     # a few seconds (the smoke test)
    python scripts/bench.py --fsdp                   # alone: FSDP2 peak memory per rank, O2 vs O0

Sections (``--only``, comma-separated): ``transformer``, ``mlp``, ``cnn`` (``train`` = all
three), ``micro``, ``memory``, ``compiled`` (the transformer step under torch.compile),
and ``gpu``: a GPU-sized transformer (issue 13), the default
with ``--device cuda`` (the CPU-sized workloads are launch-bound there and say nothing about
mixed precision); ``--quick`` shrinks it so that the code path also runs on a CPU.

    python scripts/bench.py --device cuda --json gpu.json   # gpu + micro, about a minute
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import ampatch as amp
from ampatch import hardware

MODES = ("fp32", "autocast", "O1", "O2", "O3")
SECTIONS = ("transformer", "mlp", "cnn", "micro", "memory", "compiled", "gpu")
DEFAULT_SECTIONS = {"cpu": ("transformer", "mlp", "cnn", "micro", "memory", "compiled"), "cuda": ("gpu", "micro")}

# The clock of every timed block (main() picks it). With one torch thread on CPU all the work
# of a step runs on the calling thread (autograd runs a CPU backward on the caller), so the
# thread's CPU time is the step time without the time other processes held the core: ratios
# stay stable on a shared machine. Elsewhere: wall time (perf_counter), synchronized on CUDA.
CLOCK: Callable[[], float] = time.perf_counter

# Targets of issue 8: key -> (limit, what is compared). All are "measured <= limit".
TARGETS: dict[str, tuple[float, str]] = {
    "transformer.O1/autocast": (1.03, "transformer step, O1 / autocast"),
    "transformer.O2/autocast": (0.95, "transformer step, O2 / autocast"),
    "transformer.O2/O3": (1.08, "transformer step, O2 / O3"),
    "mlp.O1/autocast": (1.10, "deep MLP step, O1 / autocast"),
    "mlp.O2/autocast": (0.95, "deep MLP step, O2 / autocast"),
    "micro.linear.O1/autocast": (1.25, "tiny F.linear, O1 / autocast"),
    "micro.add.O1-unpatched_us": (0.5, "x + y under O1 minus unpatched (us)"),
    "micro.nocast.O1-unpatched_us": (0.5, "wrapped op, nothing to cast: O1 minus unpatched (us)"),
    "micro.unscale.ampatch/GradScaler": (1.1, "unscale+check of 200 grads / GradScaler.unscale_"),
    "memory.cnn.O2/O0": (0.65, "CNN peak memory, O2 / O0"),
}


# ----------------------------------------------------------------------------- settings

def rounds_for(quick: bool) -> dict[str, dict[str, int]]:
    """rounds (interleaved), warmup steps and timed steps per mode block, per workload."""
    if quick:
        return {"transformer": dict(rounds=2, warmup=1, steps=1),
                "mlp": dict(rounds=2, warmup=1, steps=2),
                "cnn": dict(rounds=2, warmup=1, steps=1),
                "micro": dict(rounds=3, calls=200, unscale_calls=5),
                "memory": dict(rounds=1, steps=3)}
    return {"transformer": dict(rounds=9, warmup=2, steps=3),
            "mlp": dict(rounds=15, warmup=3, steps=10),
            "cnn": dict(rounds=5, warmup=2, steps=3),
            "micro": dict(rounds=31, calls=5000, unscale_calls=40),
            "memory": dict(rounds=2, steps=4)}


class Env:
    """Device, half dtype and the helpers that depend on them."""

    def __init__(self, device: str, half: torch.dtype) -> None:
        self.device = torch.device(device)
        self.half = half
        self.cuda = self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device.type, dtype=self.half)


# ----------------------------------------------------------------------------- workloads

# Losses look F.* up at call time, as a training script does: under O1 they are patched.
def mse_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def cross_entropy(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, target)


def transformer_workload(env: Env) -> tuple[nn.Module, tuple, Callable]:
    """2 x TransformerEncoderLayer(256, 4, 1024), batch 16 x 64 tokens, MSE to a target."""
    model = nn.Sequential(*[nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True) for _ in range(2)])
    x = torch.randn(16, 64, 256)
    y = torch.randn(16, 64, 256)
    return model.to(env.device), (x.to(env.device), y.to(env.device)), mse_loss


def mlp_workload(env: Env) -> tuple[nn.Module, tuple, Callable]:
    """60 x (Linear(64, 64) + LayerNorm + GELU), batch 64: per-call overhead dominates."""
    layers: list[nn.Module] = []
    for _ in range(60):
        layers += [nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU()]
    x = torch.randn(64, 64)
    y = torch.randn(64, 64)
    return nn.Sequential(*layers).to(env.device), (x.to(env.device), y.to(env.device)), mse_loss


def cnn_workload(env: Env) -> tuple[nn.Module, tuple, Callable]:
    """Conv-BN-ReLU net on 32 x 3 x 32 x 32 images, 10 classes, cross entropy.

    Activations dominate its memory (as in most conv nets), which is what O2 saves on."""
    def block(cin: int, cout: int, stride: int = 1) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

    model = nn.Sequential(*block(3, 32), *block(32, 32), *block(32, 64, 2), *block(64, 64),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
    x = torch.randn(32, 3, 32, 32)
    y = torch.randint(0, 10, (32,))
    return model.to(env.device), (x.to(env.device), y.to(env.device)), cross_entropy


WORKLOADS = {"transformer": transformer_workload, "mlp": mlp_workload, "cnn": cnn_workload}


def make_mode(mode: str, base: nn.Module, data: tuple, loss_fn: Callable, env: Env) -> tuple[Callable, Any]:
    """(one full training step, returning its loss; the optimizer) for `mode` on a fresh deep
    copy of `base`: fp32, autocast (with a GradScaler when the half type is float16, as torch's
    recipe says), or an ampatch level, which calls amp.initialize here: the caller calls
    amp.deinitialize() after."""
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = data
    if mode == "fp32":
        def step() -> torch.Tensor:
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            return loss
    elif mode == "autocast":
        scaler = torch.amp.GradScaler(env.device.type) if env.half == torch.float16 else None

        def step() -> torch.Tensor:
            opt.zero_grad()
            with env.autocast():
                loss = loss_fn(model(x), y)
            if scaler is None:  # bfloat16 needs no GradScaler
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            return loss
    else:
        model, opt = amp.initialize(model, opt, opt_level=mode, half_dtype=env.half, verbosity=0)

        def step() -> torch.Tensor:
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            return loss
    return step, opt


@contextlib.contextmanager
def quiet_gc():
    """No garbage collection inside a timed block (it would land on a random mode)."""
    gc.collect()  # cheap: main() froze the import-time heap
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def timed_steps(step: Callable[[], Any], steps: int, env: Env) -> tuple[list[float], Any]:
    """Seconds of each of `steps` calls of `step` (device synchronized around each, no garbage
    collection in between), and what the last call returned."""
    times, out = [], None
    with quiet_gc():
        for _ in range(steps):
            env.sync()
            t0 = CLOCK()
            out = step()
            env.sync()
            times.append(CLOCK() - t0)
    return times, out


def rotated(items: Sequence[str], r: int) -> list[str]:
    k = r % len(items)
    return list(items[k:]) + list(items[:k])


def summarise(per_round: dict[str, list[float]], pairs: Sequence[tuple[str, str]]) -> tuple[dict, dict]:
    """Per-mode medians of round medians, and for each pair the median of per-round ratios."""
    medians = {m: statistics.median(v) for m, v in per_round.items()}
    ratios = {}
    for a, b in pairs:
        if a in per_round and b in per_round:
            ratios[f"{a}/{b}"] = statistics.median(x / y for x, y in zip(per_round[a], per_round[b]))
    return medians, ratios


def bench_training(name: str, env: Env, cfg: dict[str, int], log: Callable[[str], None]) -> dict:
    torch.manual_seed(0)
    base, data, loss_fn = WORKLOADS[name](env)
    per_round: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(cfg["rounds"]):
        for mode in rotated(MODES, r):
            step, _ = make_mode(mode, base, data, loss_fn, env)
            try:
                for _ in range(cfg["warmup"]):
                    step()
                times = timed_steps(step, cfg["steps"], env)[0]
            finally:
                amp.deinitialize()
            per_round[mode].append(statistics.median(times))
        log(f"  {name}: round {r + 1}/{cfg['rounds']}")
    pairs = [("O1", "autocast"), ("O2", "autocast"), ("O2", "O3"), ("O3", "autocast"),
             ("autocast", "fp32"), ("O1", "fp32"), ("O2", "fp32"), ("O3", "fp32")]
    medians, ratios = summarise(per_round, pairs)
    return {"median_step_ms": {m: v * 1e3 for m, v in medians.items()}, "ratios": ratios,
            "per_round_ms": {m: [v * 1e3 for v in vs] for m, vs in per_round.items()}}


# ----------------------------------------------------------------------------- micro

def _time_calls(fn: Callable[[], Any], calls: int) -> float:
    """Seconds per call of fn over `calls` calls (loop overhead included, same for every variant)."""
    with quiet_gc():
        t0 = CLOCK()
        for _ in range(calls):
            fn()
        return (CLOCK() - t0) / calls


@contextlib.contextmanager
def o1_session(env: Env, **kwargs: Any):
    dummy = nn.Linear(1, 1).to(env.device)
    amp.initialize(dummy, opt_level="O1", half_dtype=env.half, verbosity=0, **kwargs)
    try:
        yield
    finally:
        amp.deinitialize()


def bench_micro(env: Env, cfg: dict[str, int], log: Callable[[str], None]) -> dict:
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
    results: dict[str, dict[str, list[float]]] = {k: {v: [] for v in variants} for k in calls_by_key}
    for r in range(cfg["rounds"]):
        for variant in rotated(list(variants), r):
            with variants[variant]():
                for key, fn in calls_by_key.items():
                    _time_calls(fn, calls // 10)  # warm-up (the first call fills the cast caches)
                    results[key][variant].append(_time_calls(fn, calls))
    out: dict[str, Any] = {}
    for key, per_round in results.items():
        medians, ratios = summarise(per_round, [("O1", "autocast"), ("O1", "unpatched"), ("autocast", "unpatched")])
        out[key] = {"us_per_call": {k: v * 1e6 for k, v in medians.items()}, "ratios": ratios,
                    "O1-unpatched_us": statistics.median(
                        (a - u) * 1e6 for a, u in zip(per_round["O1"], per_round["unpatched"])),
                    "autocast-unpatched_us": statistics.median(
                        (a - u) * 1e6 for a, u in zip(per_round["autocast"], per_round["unpatched"]))}
    log("  micro: calls done")
    out["unscale"] = bench_unscale(env, cfg)
    log("  micro: unscale done")
    return out


def bench_unscale(env: Env, cfg: dict[str, int]) -> dict:
    """Unscale + inf/NaN check of 200 FP32 grads (64 x 64), scale 2**16, like with like:

    - "ampatch": grads collected from the optimizer's param_groups, then
      ampatch.scaler.unscale_ (the fused kernel path scale_loss's exit uses) - against
      "GradScaler": torch.amp.GradScaler.unscale_(optimizer) (collects grads, fused kernel;
      no host sync; neither includes the skip decision).
    - "ampatch_exit": the whole amp.scale_loss exit at O1 with a dynamic scale (param walk,
      unscale + check, host-side verdict, scale update, cache clear) - against
      "GradScaler_full": unscale_ + the found-inf host read + update().
    Grads are reset to the same scaled values, untimed, before every timed call.
    """
    from ampatch.scaler import unscale_ as amp_unscale_

    dev, n = env.device, 200
    scale = 2.0 ** 16
    params = [nn.Parameter(torch.zeros(64, 64, device=dev)) for _ in range(n)]
    pristine = [torch.randn(64, 64, device=dev) * scale for _ in range(n)]
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
                t0 = CLOCK()
                fn()
                env.sync()
                times.append(CLOCK() - t0)
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
                    t0 = CLOCK()
                    cm.__exit__(None, None, None)
                    env.sync()
                    times.append(CLOCK() - t0)
            return statistics.median(times)
        finally:
            amp.deinitialize()

    variants: dict[str, Callable[[], float]] = {
        "ampatch": lambda: timed(ampatch_unscale),
        "GradScaler": lambda: timed(gradscaler_unscale, gscaler.update),
        "ampatch_exit": ampatch_exit_round,
        "GradScaler_full": lambda: timed(gradscaler_full),
    }
    per_round: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(max(3, cfg["rounds"] // 2)):
        for k in rotated(list(variants), r):
            per_round[k].append(variants[k]())
    medians, ratios = summarise(per_round, [("ampatch", "GradScaler"), ("ampatch_exit", "GradScaler_full")])
    return {"us_per_call": {k: v * 1e6 for k, v in medians.items()}, "ratios": ratios, "grads": n,
            "grad_shape": [64, 64]}


# ----------------------------------------------------------------------------- memory

def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _storage_bytes(tensors: Sequence[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _persistent_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Exact bytes of the training state that lives across steps: params and buffers of the
    model, the params the optimizer steps (FP32 masters under O2), optimizer state, grads."""
    tensors = list(model.parameters()) + list(model.buffers()) + list(amp.master_params(opt))
    tensors += [p.grad for p in tensors if isinstance(p, torch.Tensor) and p.grad is not None]
    tensors += [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return _storage_bytes(tensors)


def memory_child(mode: str, env: Env, steps: int) -> dict:
    """One mode in a fresh process (see MEMORY_WHAT)."""
    torch.manual_seed(0)
    base, (x, y), loss_fn = cnn_workload(env)
    level = "O0" if mode == "fp32" else mode
    model, opt = amp.initialize(base, torch.optim.AdamW(base.parameters(), lr=1e-4), opt_level=level,
                                half_dtype=env.half, verbosity=0)
    saved: list[torch.Tensor] = []
    transient, live = [], 0
    cpu_rss = env.device.type == "cpu" and os.path.exists("/proc/self/clear_refs")
    for i in range(steps):
        measured = i >= 2  # two warm-up steps: lazy kernel set-up, optimizer state, allocator
        last = i == steps - 1
        opt.zero_grad()
        gc.collect()
        if measured and cpu_rss:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
            start = _status_kib("VmRSS")
        elif measured and env.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
        persistent = _persistent_bytes(model, opt)
        saved.clear()

        def pack(t: torch.Tensor) -> torch.Tensor:
            if last:
                saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = loss_fn(model(x), y)
        if last:
            state = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
            live = _storage_bytes(list(model.parameters()) + list(model.buffers()) + list(amp.master_params(opt))
                                  + state + saved)
            saved.clear()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        del loss
        if measured and cpu_rss:
            transient.append((_status_kib("VmHWM") - start) * 1024)
        elif measured and env.cuda:
            torch.cuda.synchronize()
            transient.append(torch.cuda.max_memory_allocated() - start)
    amp.deinitialize()
    peak = persistent + max(transient) if transient else None
    return {"peak_bytes": peak, "persistent_bytes": persistent, "transient_bytes": max(transient) if transient else None,
            "live_tensor_bytes": live}


MEMORY_WHAT = ("peak = persistent training state (params, buffers, FP32 masters, optimizer state: exact bytes "
               "of their storages) + the transient peak of a steady-state step (CPU: growth of the peak RSS "
               "over the step, after 2 warm-up steps, malloc set to return freed blocks to the OS; CUDA: "
               "max_memory_allocated over the step); one fresh process per run. One-time process costs "
               "(kernel code, allocator pools) are left out. live tensors: unique storages of params, masters, "
               "optimizer state and saved activations at the end of the last forward")


def bench_memory(env: Env, cfg: dict[str, int], log: Callable[[str], None]) -> dict:
    per_round: dict[str, list[dict]] = {"O0": [], "O2": []}
    for r in range(cfg["rounds"]):
        for mode in rotated(list(per_round), r):
            cmd = [sys.executable, os.path.abspath(__file__), "--_memory-child", mode, "--device", str(env.device),
                   "--dtype", str(env.half).removeprefix("torch."), "--threads", str(torch.get_num_threads())]
            proc = subprocess.run(cmd + ["--_memory-steps", str(cfg["steps"])], capture_output=True, text=True,
                                  check=False, env=dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536"))
            if proc.returncode != 0:
                raise RuntimeError(f"memory child {mode} failed:\n{proc.stderr[-2000:]}")
            per_round[mode].append(json.loads(proc.stdout.strip().splitlines()[-1]))
        log(f"  memory: round {r + 1}/{cfg['rounds']}")
    out: dict[str, Any] = {"what": MEMORY_WHAT}
    for key in ("peak_bytes", "persistent_bytes", "live_tensor_bytes"):
        vals = {m: [d[key] for d in v] for m, v in per_round.items()}
        if any(x is None for v in vals.values() for x in v):
            continue
        out[key] = {m: statistics.median(v) for m, v in vals.items()}
        out[key + "_ratio"] = out[key]["O2"] / out[key]["O0"]
    out["O2/O0"] = out.get("peak_bytes_ratio", out["live_tensor_bytes_ratio"])
    return out


# ----------------------------------------------------------------------------- FSDP2 memory (issue 14)
# `--fsdp`: peak memory per rank of a training step under FSDP2 (fully_shard, 2 gloo ranks on
# this machine), O2 against O0, and FSDP2's own MixedPrecisionPolicy(half, reduce float32) as
# the reference O2 should equal. Run alone (it starts 2 processes per mode and round).

FSDP_MODES = ("O0", "O2", "native")
FSDP_SHAPE = dict(width=1024, depth=6, batch=256)  # 6 x (Linear(1024, 1024) + GELU), one unit each
FSDP_QUICK_SHAPE = dict(width=256, depth=3, batch=32)  # --quick: the smoke test (numbers are noise)
FSDP_WHAT = ("per rank: persistent = exact bytes of the rank's local storages (parameter shards, gradient shards, "
             "optimizer state, buffers) + transient = growth of the peak RSS over a steady-state step (after 2 "
             "warm-up steps; all-gathered parameters, activations, unsharded gradients, communication buffers); "
             "the larger of the 2 ranks, median over rounds; one fresh process pair per run. JSON "
             "forward_backward_bytes: the same peak up to the end of backward (without the optimizer step)")


def _local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)  # a DTensor's shard on this rank


def fsdp_memory_child(mode: str, rank: int, rdzv: str, env: Env, steps: int, shape: dict[str, int]) -> dict:
    """One rank of one mode (see FSDP_WHAT)."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))
    torch.manual_seed(0)
    width, depth, batch = shape["width"], shape["depth"], shape["batch"]
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)])
    policy = MixedPrecisionPolicy(param_dtype=env.half, reduce_dtype=torch.float32) if mode == "native" \
        else MixedPrecisionPolicy()
    for block in model:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if mode != "native":
        model, opt = amp.initialize(model, opt, opt_level=mode, half_dtype=env.half, verbosity=0)
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch, width, generator=gen), torch.randn(batch, width, generator=gen)
    transient, backward, persistent = [], [], 0
    for i in range(steps):
        opt.zero_grad()
        gc.collect()
        dist.barrier()
        measured = i >= 2
        if measured:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
            start = _status_kib("VmRSS")
        loss = F.mse_loss(model(x), y)
        if mode == "native":
            loss.backward()
        else:
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
        if measured:
            backward.append((_status_kib("VmHWM") - start) * 1024)
        opt.step()
        del loss
        if measured:
            transient.append((_status_kib("VmHWM") - start) * 1024)
        tensors = list(model.parameters()) + list(model.buffers())
        tensors += [p.grad for p in tensors if p.grad is not None]
        tensors += [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        persistent = _storage_bytes([_local(t) for t in tensors])
    if mode != "native":
        amp.deinitialize()
    dist.destroy_process_group()
    return {"peak_bytes": persistent + max(transient), "persistent_bytes": persistent,
            "transient_bytes": max(transient), "forward_backward_bytes": persistent + max(backward)}


def bench_fsdp(env: Env, rounds: int, steps: int, quick: bool, log: Callable[[str], None]) -> dict:
    import tempfile

    per_round: dict[str, list[dict]] = {m: [] for m in FSDP_MODES}
    for r in range(rounds):
        for mode in rotated(list(FSDP_MODES), r):
            with tempfile.TemporaryDirectory(prefix="ampatch-fsdp-") as tmp:
                procs = [subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), "--_fsdp-child", mode, "--_fsdp-rank", str(rank),
                     "--_fsdp-rdzv", os.path.join(tmp, "rdzv"), "--_memory-steps", str(steps),
                     "--dtype", str(env.half).removeprefix("torch."), "--threads", str(torch.get_num_threads()),
                     *(["--quick"] if quick else [])],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                    env=dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")) for rank in range(2)]
                outs = [p.communicate(timeout=900) for p in procs]
            for p, (out, err) in zip(procs, outs):
                if p.returncode != 0:
                    raise RuntimeError(f"fsdp memory child {mode} failed:\n{err[-2000:]}")
            ranks = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
            per_round[mode].append({k: max(d[k] for d in ranks) for k in ranks[0]})
        log(f"  fsdp: round {r + 1}/{rounds}")
    res: dict[str, Any] = {"what": FSDP_WHAT, "shape": dict(FSDP_QUICK_SHAPE if quick else FSDP_SHAPE),
                           "world_size": 2}
    for key in ("peak_bytes", "persistent_bytes", "transient_bytes", "forward_backward_bytes"):
        res[key] = {m: statistics.median(d[key] for d in v) for m, v in per_round.items()}
    pb = res["peak_bytes"]
    res["ratios"] = {"O2/O0": pb["O2"] / pb["O0"], "native/O0": pb["native"] / pb["O0"],
                     "O2/native": pb["O2"] / pb["native"]}
    return res


def render_fsdp(res: dict, meta: dict) -> str:
    mib = 2 ** 20
    shape = res["shape"]
    lines = [f"ampatch bench --fsdp: torch {meta['torch']}, half {meta['half_dtype']}, {meta['cpu']}",
             f"command: {meta['command']}", "",
             f"FSDP2 peak memory per rank, {shape['depth']} x Linear({shape['width']}) units, batch {shape['batch']} "
             f"per rank, AdamW, {res['world_size']} gloo ranks (MiB)",
             f"{'mode':<8}{'peak':>10}{'persistent':>12}{'transient':>11}"]
    for m in FSDP_MODES:
        lines.append(f"{m:<8}{res['peak_bytes'][m] / mib:>10.1f}{res['persistent_bytes'][m] / mib:>12.1f}"
                     f"{res['transient_bytes'][m] / mib:>11.1f}")
    r = res["ratios"]
    lines.append(f"O2/O0 {r['O2/O0']:.3f}   native/O0 {r['native/O0']:.3f}   O2/native {r['O2/native']:.3f}   "
                 "(native: FSDP2's own MixedPrecisionPolicy(param_dtype=half, reduce_dtype=float32), no ampatch)")
    lines.append(f"  ({res['what']})")
    return "\n".join(lines)


def run_fsdp(args: argparse.Namespace, env: Env, argv: Sequence[str] | None) -> int:
    """`--fsdp`: the FSDP2 block alone, its table, and `--json`."""
    if not os.path.exists("/proc/self/clear_refs"):
        print("bench --fsdp: the CPU memory measure needs /proc/self/clear_refs (Linux)", file=sys.stderr)
        return 2
    start = time.perf_counter()
    rounds, steps = (1, 3) if args.quick else (3, 4)
    res = bench_fsdp(env, rounds, steps, args.quick, lambda msg: print(msg, file=sys.stderr, flush=True))
    meta = {"torch": torch.__version__, "half_dtype": args.dtype, "cpu": cpu_name(), "quick": args.quick,
            "command": " ".join(["python", "scripts/bench.py"] + list(sys.argv[1:] if argv is None else argv)),
            "rounds": rounds, "steps": steps, "seconds": round(time.perf_counter() - start, 1)}
    print(render_fsdp(res, meta))
    print(f"\n({meta['seconds']} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "ratios": {f"fsdp.{k}": v for k, v in res["ratios"].items()},
                       "results": {"fsdp": res}}, f, indent=1)
    return 0


# ----------------------------------------------------------------------------- compiled

COMPILED_TARGETS: dict[str, tuple[float, str]] = {
    "compiled.O1/autocast": (1.02, "compiled transformer step, O1 / autocast"),
    "compiled.O2/autocast": (1.02, "compiled transformer step, O2 / autocast"),
}


def bench_compiled(env: Env, quick: bool, log: Callable[[str], None], backend: str = "inductor") -> dict:
    """The transformer step with its forward and loss under torch.compile (compiled once per
    mode, after amp.initialize), at O1 and O2, against torch.compile + torch.autocast, plus
    the graph breaks of each (torch._dynamo.explain). Optimizer and scale_loss run eagerly.

    One phase per level: its session stays up while its rounds interleave with autocast's
    (a new session would mean a new compile). Under the O1 session the autocast steps run
    inside amp.disable_casts(): O1's patches are process-wide, and disabled they compile to
    the plain ops, so autocast has one compiled graph per phase."""
    import torch._dynamo

    rounds, warmup, steps = (2, 1, 1) if quick else (7, 2, 3)
    torch.manual_seed(0)
    base, (x, y), loss_fn = transformer_workload(env)
    modes = ("autocast", "O1", "O2")
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

    breaks = {"autocast": graph_breaks("autocast")}
    per_round: dict[str, list[float]] = {"O1": [], "O2": [], "autocast@O1": [], "autocast@O2": []}
    recompiles = 0
    for level in ("O1", "O2"):
        amp.initialize(models[level], opts[level], opt_level=level, half_dtype=env.half, verbosity=0)
        try:
            breaks[level] = graph_breaks(level)
            t0 = time.perf_counter()
            for mode in ("autocast", level):  # compile outside the timed rounds
                for _ in range(warmup):
                    step(mode)
            log(f"  compiled: {level} and autocast compiled with {backend} in {time.perf_counter() - t0:.1f} s")
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            for r in range(rounds):
                for mode in rotated(("autocast", level), r):
                    times = timed_steps(lambda: step(mode), steps, env)[0]
                    per_round[level if mode == level else f"autocast@{level}"].append(statistics.median(times))
                log(f"  compiled: {level} round {r + 1}/{rounds}")
            recompiles += torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
        finally:
            amp.deinitialize()
    ratios = {f"{level}/autocast": statistics.median(
        a / b for a, b in zip(per_round[level], per_round[f"autocast@{level}"])) for level in ("O1", "O2")}
    medians = {m: statistics.median(v) * 1e3 for m, v in per_round.items()}
    medians["autocast"] = statistics.median(per_round["autocast@O1"] + per_round["autocast@O2"]) * 1e3
    flat = {f"compiled.{k}": v for k, v in ratios.items()}
    return {"backend": backend, "median_step_ms": medians, "ratios": ratios, "graph_breaks": breaks,
            "recompiles_during_rounds": recompiles, "flat": flat,
            "per_round_ms": {m: [v * 1e3 for v in vs] for m, vs in per_round.items()}}


def render_compiled(c: dict) -> str:
    """The compiled section's lines, with its targets."""
    ms, b = c["median_step_ms"], c["graph_breaks"]
    lines = [f"torch.compile (backend {c['backend']}), transformer step, median ms; graphs / graph breaks "
             f"(torch._dynamo.explain); recompiles during the timed rounds: {c['recompiles_during_rounds']}",
             f"{'':<12}{'autocast':>10}{'O1':>10}{'O2':>10}{'O1/autocast':>13}{'O2/autocast':>13}",
             f"{'step ms':<12}{ms['autocast']:>10.2f}{ms['O1']:>10.2f}{ms['O2']:>10.2f}"
             f"{c['ratios']['O1/autocast']:>13.3f}{c['ratios']['O2/autocast']:>13.3f}",
             f"{'graphs/brk':<12}" + "".join(f"{b[m]['graphs']:>6}/{b[m]['graph_breaks']:<3}" for m in
                                            ("autocast", "O1", "O2")),
             "targets (issue 13)"]
    for key, (limit, what) in COMPILED_TARGETS.items():
        v = c["flat"][key]
        lines.append(f"  {what:<55} {v:>8.3f}  <= {limit:<5} {'met' if v <= limit else 'MISSED'}")
    same = all(b[m] == b["autocast"] for m in ("O1", "O2"))
    lines.append(f"  {'graph breaks equal to autocast':<55} {'yes' if same else 'NO':>8}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- GPU-sized (issue 13)

# Issue 13's targets on the GPU workload: key -> (limit, what). All are "measured <= limit".
GPU_TARGETS: dict[str, tuple[float, str]] = {
    "gpu.O1/autocast": (1.03, "GPU transformer step, O1 / autocast+GradScaler"),
    "gpu.O2/autocast": (0.85, "GPU transformer step, O2 / autocast+GradScaler"),
    "gpu.O2_peak/(autocast_peak+masters)": (1.0, "GPU transformer peak memory, O2 / (autocast + FP32 masters)"),
}


def gpu_config(quick: bool) -> dict[str, int]:
    """Issue 13's workload: TransformerEncoder(d_model 1024, 16 heads, 6 layers), batch 16 x 512
    tokens. ``--quick`` (the smoke test, on any device) keeps the shape of the code, not the size."""
    if quick:
        return dict(d_model=64, heads=4, layers=2, batch=2, seq=16, rounds=2, warmup=1, steps=2)
    return dict(d_model=1024, heads=16, layers=6, batch=16, seq=512, rounds=5, warmup=3, steps=5)


def gpu_transformer_workload(env: Env, c: dict[str, int]) -> tuple[nn.Module, tuple, Callable]:
    """nn.TransformerEncoder with torch's defaults otherwise (feed-forward 2048, dropout 0.1)."""
    layer = nn.TransformerEncoderLayer(c["d_model"], c["heads"], batch_first=True)
    model = nn.TransformerEncoder(layer, c["layers"], enable_nested_tensor=False)
    x = torch.randn(c["batch"], c["seq"], c["d_model"], device=env.device)
    y = torch.randn(c["batch"], c["seq"], c["d_model"], device=env.device)
    return model.to(env.device), (x, y), mse_loss


def _allocated() -> int:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() and torch.cuda.is_initialized() else 0


def bench_gpu(env: Env, c: dict[str, int], log: Callable[[str], None]) -> dict:
    """Interleaved rounds as in bench_training; on CUDA also each mode's peak memory: the most
    allocated over its block (model copy, optimizer state, masters, activations), less what
    was allocated before it (the template model and the data)."""
    torch.manual_seed(0)
    base, data, loss_fn = gpu_transformer_workload(env, c)
    per_round: dict[str, list[float]] = {m: [] for m in MODES}
    peaks: dict[str, list[int]] = {m: [] for m in MODES}
    losses: dict[str, float] = {}
    master_bytes = 0
    for r in range(c["rounds"]):
        for mode in rotated(MODES, r):
            gc.collect()
            if env.cuda:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            before = _allocated()
            step, opt = make_mode(mode, base, data, loss_fn, env)
            try:
                if mode == "O2":
                    master_bytes = sum(p.numel() * p.element_size() for p in amp.master_params(opt))
                for _ in range(c["warmup"]):
                    step()
                times, loss = timed_steps(step, c["steps"], env)
                losses[mode] = float(loss.detach().float())
                if env.cuda:  # before deinitialize, which casts the model back to FP32
                    torch.cuda.synchronize()
                    peaks[mode].append(torch.cuda.max_memory_allocated() - before)
            finally:
                amp.deinitialize()
            per_round[mode].append(statistics.median(times))
            del step, opt, loss  # the loss's graph holds the params (AccumulateGrad): free them all
        log(f"  gpu: round {r + 1}/{c['rounds']}")
    pairs = [("O1", "autocast"), ("O2", "autocast"), ("O3", "autocast"), ("O2", "O3"),
             ("autocast", "fp32"), ("O1", "fp32"), ("O2", "fp32"), ("O3", "fp32")]
    medians, ratios = summarise(per_round, pairs)
    out: dict[str, Any] = {
        "config": {k: c[k] for k in ("d_model", "heads", "layers", "batch", "seq")},
        "half_dtype": str(env.half).removeprefix("torch."),
        "grad_scaler": env.half == torch.float16,
        "median_step_ms": {m: v * 1e3 for m, v in medians.items()}, "ratios": ratios,
        "per_round_ms": {m: [v * 1e3 for v in vs] for m, vs in per_round.items()},
        "final_loss": losses, "master_bytes": master_bytes,
        "params": sum(p.numel() for p in base.parameters())}
    if env.cuda:
        peak = {m: int(statistics.median(v)) for m, v in peaks.items()}
        out["peak_bytes"] = peak
        out["ratios"]["O2_peak/(autocast_peak+masters)"] = peak["O2"] / (peak["autocast"] + master_bytes)
        out["ratios"]["O2_peak/autocast_peak"] = peak["O2"] / peak["autocast"]
    return out


def render_gpu(g: dict, flat: dict[str, float]) -> list[str]:
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
    lines.append("targets (issue 13, GPU workload)")
    for key, (limit, what) in GPU_TARGETS.items():
        if key in flat:
            v = flat[key]
            lines.append(f"  {what:<62} {v:>8.3f}  <= {limit:<5} {'met' if v <= limit else 'MISSED'}")
    lines.append("")
    return lines


# ----------------------------------------------------------------------------- report

def flatten_ratios(results: dict) -> dict[str, float]:
    flat: dict[str, float] = {}
    for name in WORKLOADS:
        for k, v in results.get(name, {}).get("ratios", {}).items():
            flat[f"{name}.{k}"] = v
    micro = results.get("micro")
    if micro:
        for key in ("linear", "add", "nocast", "nocast_method", "nocast_nested"):
            for k, v in micro[key]["ratios"].items():
                flat[f"micro.{key}.{k}"] = v
            flat[f"micro.{key}.O1-unpatched_us"] = micro[key]["O1-unpatched_us"]
            flat[f"micro.{key}.autocast-unpatched_us"] = micro[key]["autocast-unpatched_us"]
        flat["micro.unscale.ampatch/GradScaler"] = micro["unscale"]["ratios"]["ampatch/GradScaler"]
        flat["micro.unscale.ampatch_exit/GradScaler_full"] = micro["unscale"]["ratios"]["ampatch_exit/GradScaler_full"]
    for k, v in results.get("gpu", {}).get("ratios", {}).items():
        flat[f"gpu.{k}"] = v
    mem = results.get("memory")
    if mem:
        flat["memory.cnn.O2/O0"] = mem["O2/O0"]
        if "live_tensor_bytes_ratio" in mem:
            flat["memory.cnn.live_tensor_bytes.O2/O0"] = mem["live_tensor_bytes_ratio"]
    return flat


def render(results: dict, flat: dict[str, float], meta: dict) -> str:
    lines = [f"ampatch bench: torch {meta['torch']}, device {meta['device']}, half {meta['half_dtype']}, "
             f"torch threads {meta['threads']} ({meta['threads_note']}), {meta['cpu']}",
             f"machine: {meta['machine']}",
             f"clock: {meta['clock']}",
             f"command: {meta['command']}", ""]
    trained = [n for n in WORKLOADS if n in results]
    if trained:
        lines.append("training step, median ms (AdamW; ratios: median of per-round ratios, interleaved rounds)")
        head = f"{'workload':<12}" + "".join(f"{m:>9}" for m in MODES) + "".join(
            f"{k:>12}" for k in ("O1/autocast", "O2/autocast", "O2/O3", "autocast/fp32"))
        lines.append(head)
        for n in trained:
            r = results[n]
            lines.append(f"{n:<12}" + "".join(f"{r['median_step_ms'][m]:>9.2f}" for m in MODES) + "".join(
                f"{r['ratios'][k]:>12.3f}" for k in ("O1/autocast", "O2/autocast", "O2/O3", "autocast/fp32")))
        lines.append("")
    micro = results.get("micro")
    if micro:
        lines.append("micro, us per call (median of rounds)          unpatched  autocast        O1   O1/autocast  "
                     "O1-unpatched")
        labels = {"linear": "F.linear 4x16 @ 16x16 (param weight, grad on)",
                  "add": "x + y, 4x16 (not wrapped)",
                  "nocast": "torch.softmax fp32 (wrapped, nothing to cast)",
                  "nocast_method": "x.sum() fp32 (wrapped method, nothing to cast)",
                  "nocast_nested": "F.softmax fp32 (2 wrappers, nothing to cast)"}
        for key, label in labels.items():
            m = micro[key]
            u = m["us_per_call"]
            lines.append(f"{label:<47}{u['unpatched']:>8.2f}{u['autocast']:>10.2f}{u['O1']:>10.2f}"
                         f"{m['ratios']['O1/autocast']:>14.3f}{m['O1-unpatched_us']:>+13.2f}")
        un = micro["unscale"]
        u = un["us_per_call"]
        lines.append(f"unscale + inf check, 200 grads 64x64: ampatch.scaler.unscale_ {u['ampatch']:.1f} us vs "
                     f"GradScaler.unscale_ {u['GradScaler']:.1f} us -> {un['ratios']['ampatch/GradScaler']:.3f}")
        lines.append(f"  whole scale_loss exit (O1, dynamic) {u['ampatch_exit']:.1f} us vs GradScaler unscale_+"
                     f"found_inf read+update {u['GradScaler_full']:.1f} us -> "
                     f"{un['ratios']['ampatch_exit/GradScaler_full']:.3f}")
        lines.append("")
    mem = results.get("memory")
    if mem:
        if "peak_bytes" in mem:
            pb = mem["peak_bytes"]
            lines.append(f"CNN peak memory of a training step: O0 {pb['O0'] / 2**20:.1f} MiB, O2 {pb['O2'] / 2**20:.1f} MiB -> "
                         f"{mem['peak_bytes_ratio']:.3f}")
        lb = mem["live_tensor_bytes"]
        lines.append(f"CNN live tensors at end of forward: O0 {lb['O0'] / 2**20:.1f} MiB, O2 {lb['O2'] / 2**20:.1f} "
                     f"MiB -> {mem['live_tensor_bytes_ratio']:.3f}")
        lines.append(f"  (persistent O0 {mem['persistent_bytes']['O0'] / 2**20:.2f} MiB, O2 "
                     f"{mem['persistent_bytes']['O2'] / 2**20:.2f} MiB; {mem['what']})")
        lines.append("")
    if "gpu" in results:
        lines += render_gpu(results["gpu"], flat)
    lines.append("targets (issue 8)")
    for key, (limit, what) in TARGETS.items():
        if key in flat:
            v = flat[key]
            lines.append(f"  {what:<55} {v:>8.3f}  <= {limit:<5} {'met' if v <= limit else 'MISSED'}")
    return "\n".join(lines)


def cpu_name() -> str:
    """The CPU model and its core count, as ampatch.hardware detected them."""
    cpu = hardware.describe("cpu")
    return f"{cpu.name}, {cpu.cores} cores"


def machine_line(env: Env) -> str:
    """ampatch.hardware's line for the bench's device: name, flags or capability, half native?"""
    return hardware.machine_line(hardware.describe(env.device).to_dict(), [str(env.half).removeprefix("torch.")])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH", help="also write every number to PATH")
    p.add_argument("--quick", action="store_true", help="few rounds (smoke test; ratios are noisy)")
    p.add_argument("--only", default="", help=f"comma-separated sections: {', '.join(SECTIONS)}, or 'train'")
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads for reproducible ratios on a shared machine (0: torch's default)")
    p.add_argument("--clock", default="auto", choices=("auto", "thread", "wall"),
                   help="thread: CPU time of the calling thread (default on CPU with one torch thread); "
                        "wall: perf_counter (default otherwise)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float16"),
                   help="half type (default: float16 on CUDA, bfloat16 elsewhere, as ampatch's auto choice)")
    p.add_argument("--_memory-child", dest="memory_child", help=argparse.SUPPRESS)
    p.add_argument("--_memory-steps", dest="memory_steps", type=int, default=3, help=argparse.SUPPRESS)
    p.add_argument("--fsdp", action="store_true", help="only the FSDP2 peak memory per rank, O2 against O0 (issue 14)")
    p.add_argument("--_fsdp-child", dest="fsdp_child", help=argparse.SUPPRESS)
    p.add_argument("--_fsdp-rank", dest="fsdp_rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--_fsdp-rdzv", dest="fsdp_rdzv", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        device = torch.device(args.device)
    except (RuntimeError, ValueError) as exc:
        p.error(f"--device: {exc}")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: no CUDA device here (torch {torch.__version__}); the CPU sections "
                "run without --device")

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.dtype is None:
        args.dtype = "float16" if torch.device(args.device).type == "cuda" else "bfloat16"
    env = Env(args.device, getattr(torch, args.dtype))
    global CLOCK
    if args.clock == "auto":
        args.clock = "thread" if env.device.type == "cpu" and torch.get_num_threads() == 1 else "wall"
    CLOCK = time.thread_time if args.clock == "thread" else time.perf_counter
    if args.memory_child:
        print(json.dumps(memory_child(args.memory_child, env, args.memory_steps)))
        return 0
    if args.fsdp_child:  # gloo can abort in interpreter teardown: print, then leave at once
        shape = FSDP_QUICK_SHAPE if args.quick else FSDP_SHAPE
        print(json.dumps(fsdp_memory_child(args.fsdp_child, args.fsdp_rank, args.fsdp_rdzv, env, args.memory_steps,
                                           shape)), flush=True)
        os._exit(0)
    if args.fsdp:
        return run_fsdp(args, env, argv)

    wanted = set()
    for s in filter(None, (t.strip() for t in args.only.split(","))):
        if s == "train":
            wanted |= set(WORKLOADS)
        elif s in SECTIONS:
            wanted.add(s)
        else:
            p.error(f"unknown section {s!r} (choose from {', '.join(SECTIONS)}, train)")
    defaults = DEFAULT_SECTIONS["cuda" if env.cuda else "cpu"]
    sections = [s for s in SECTIONS if (s in wanted if wanted else s in defaults)]
    cfg = rounds_for(args.quick)

    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # imports torch._dynamo once, outside timing
    gc.collect()
    gc.freeze()  # the import-time heap moves out of the collector's sight: later collections are cheap

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    start = time.perf_counter()
    results: dict[str, Any] = {}
    for s in sections:
        t0 = time.perf_counter()
        if s in WORKLOADS:
            results[s] = bench_training(s, env, cfg[s], log)
        elif s == "micro":
            results[s] = bench_micro(env, cfg[s], log)
        elif s == "memory":
            results[s] = bench_memory(env, cfg[s], log)
        elif s == "compiled":
            results[s] = bench_compiled(env, args.quick, log)
        elif s == "gpu":
            results[s] = bench_gpu(env, gpu_config(args.quick), log)
        log(f"{s}: {time.perf_counter() - t0:.1f} s")
    meta = {"torch": torch.__version__, "device": str(env.device), "half_dtype": args.dtype,
            "threads": torch.get_num_threads(),
            "threads_note": "fixed by --threads" if args.threads > 0 else "torch default",
            "clock": ("thread CPU time (time.thread_time)" if args.clock == "thread" else "wall (perf_counter)"),
            "cpu": cpu_name(), "python": platform.python_version(), "machine": machine_line(env),
            "command": " ".join(["python", "scripts/bench.py"] + list(sys.argv[1:] if argv is None else argv)),
            "quick": args.quick, "sections": sections,
            "rounds": {s: cfg[s] if s in cfg else gpu_config(args.quick) if s == "gpu" else None for s in sections},
            "seconds": round(time.perf_counter() - start, 1)}
    flat = flatten_ratios(results)
    targets = {k: {"limit": lim, "value": flat[k], "met": flat[k] <= lim, "what": what}
               for k, (lim, what) in {**TARGETS, **GPU_TARGETS}.items() if k in flat}
    print(render(results, flat, meta))
    if "compiled" in results:  # torch.compile: its own block and targets (issue 13)
        flat.update(results["compiled"]["flat"])
        targets.update({k: {"limit": lim, "value": flat[k], "met": flat[k] <= lim, "what": what}
                        for k, (lim, what) in COMPILED_TARGETS.items()})
        print("\n" + render_compiled(results["compiled"]))
    print(f"\n({meta['seconds']} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "ratios": flat, "targets": targets, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
