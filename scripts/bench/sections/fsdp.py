"""`--fsdp` (issue 14): peak memory per rank of a training step under FSDP2 (fully_shard, 2
gloo ranks), O2 against O0, and FSDP2's own MixedPrecisionPolicy(half, reduce float32) as
the reference O2 should equal. Run alone: it starts 2 processes (`python -m bench.child
fsdp`) per mode and round."""
from __future__ import annotations

import datetime
import gc
import os
import statistics
import subprocess
import tempfile
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import ampatch as amp

from ..harness import Env, Log, interleaved
from ..meter import PeakMeter, persistent_bytes
from ..spawn import child_command, child_environment, child_result

MODES = ("O0", "O2", "native")
WORLD_SIZE = 2
# 6 x (Linear(1024, 1024) + GELU), one unit each; --quick: the smoke test (its numbers are noise)
SETTINGS = (dict(rounds=1, steps=3, width=256, depth=3, batch=32), dict(rounds=3, steps=4, width=1024, depth=6,
                                                                          batch=256))
WARMUP = 2
WHAT = ("per rank: persistent = exact bytes of the rank's local storages (parameter shards, gradient shards, "
        "optimizer state, buffers) + transient = growth of the peak RSS over a steady-state step (after 2 "
        "warm-up steps; all-gathered parameters, activations, unsharded gradients, communication buffers); "
        "the larger of the 2 ranks, median over rounds; one fresh process pair per run. JSON "
        "forward_backward_bytes: the same peak up to the end of backward (without the optimizer step)")


def settings(quick: bool) -> dict[str, int]:
    return SETTINGS[0 if quick else 1]


def measure_in_child(mode: str, rank: int, rdzv: str, env: Env, steps: int, width: int, depth: int,
                     batch: int) -> dict[str, Any]:
    """One rank of one mode, in its child process (see WHAT)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=WORLD_SIZE,
                            timeout=datetime.timedelta(seconds=300))
    torch.manual_seed(0)
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
    meter = PeakMeter(torch.device("cpu"))
    transient, backward, persistent = [], [], 0
    for i in range(steps):
        opt.zero_grad()
        gc.collect()
        dist.barrier()
        measured = i >= WARMUP
        if measured:
            meter.start()
        loss = F.mse_loss(model(x), y)
        if mode == "native":
            loss.backward()
        else:
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
        if measured:
            backward.append(meter.growth())
        opt.step()
        del loss
        if measured:
            transient.append(meter.growth())
        persistent = persistent_bytes(model, opt)  # the masters under O2 are the sharded params
    if mode != "native":
        amp.deinitialize()
    dist.destroy_process_group()
    return {"peak_bytes": persistent + max(transient), "persistent_bytes": persistent,
            "transient_bytes": max(transient), "forward_backward_bytes": persistent + max(backward)}


def run(env: Env, quick: bool, log: Log) -> dict[str, Any]:
    """Every mode in interleaved rounds, a fresh pair of rank processes each; per mode the
    larger rank's figures, median over rounds; the ratios of the peaks."""
    cfg = settings(quick)
    shape = {k: cfg[k] for k in ("width", "depth", "batch")}

    def measure(mode: str) -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="ampatch-fsdp-") as tmp:
            procs = [subprocess.Popen(child_command("fsdp", env, mode=mode, rank=rank, rdzv=os.path.join(tmp, "rdzv"),
                                                    steps=cfg["steps"], **shape),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env=child_environment()) for rank in range(WORLD_SIZE)]
            outs = [p.communicate(timeout=900) for p in procs]
        ranks = [child_result(f"fsdp {mode}", p.returncode, out, err) for p, (out, err) in zip(procs, outs)]
        return {k: max(d[k] for d in ranks) for k in ranks[0]}

    per_round = interleaved(MODES, cfg["rounds"], measure, log, "fsdp")
    res: dict[str, Any] = {"what": WHAT, "shape": shape, "world_size": WORLD_SIZE}
    for key in ("peak_bytes", "persistent_bytes", "transient_bytes", "forward_backward_bytes"):
        res[key] = {m: statistics.median(d[key] for d in v) for m, v in per_round.items()}
    pb = res["peak_bytes"]
    res["ratios"] = {"O2/O0": pb["O2"] / pb["O0"], "native/O0": pb["native"] / pb["O0"],
                     "O2/native": pb["O2"] / pb["native"]}
    return res


def ratios(result: dict[str, Any]) -> dict[str, float]:
    return {f"fsdp.{k}": v for k, v in result["ratios"].items()}


def render(res: dict[str, Any]) -> list[str]:
    mib, shape = 2 ** 20, res["shape"]
    lines = [f"FSDP2 peak memory per rank (a decomposition: training state + a step's transient, malloc tuned; "
             f"not the process peak, see scripts/lowmem_fsdp.py), {shape['depth']} x Linear({shape['width']}) units, "
             f"batch {shape['batch']} "
             f"per rank, AdamW, {res['world_size']} gloo ranks (MiB)",
             f"{'mode':<8}{'peak':>10}{'persistent':>12}{'transient':>11}"]
    for m in MODES:
        lines.append(f"{m:<8}{res['peak_bytes'][m] / mib:>10.1f}{res['persistent_bytes'][m] / mib:>12.1f}"
                     f"{res['transient_bytes'][m] / mib:>11.1f}")
    r = res["ratios"]
    lines.append(f"O2/O0 {r['O2/O0']:.3f}   native/O0 {r['native/O0']:.3f}   O2/native {r['O2/native']:.3f}   "
                 "(native: FSDP2's own MixedPrecisionPolicy(param_dtype=half, reduce_dtype=float32), no ampatch)")
    lines.append(f"  ({res['what']})")
    return lines
