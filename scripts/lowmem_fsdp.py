#!/usr/bin/env python3
"""master_weights "stochastic" and "kahan" under FSDP2 against sharded O5, on 2 gloo ranks
launched by torchrun (`--world`; issue 37): per-rank peak memory, step time, and learning where
sharded O3 stalls.

- memory: the peak RSS of each rank's fresh process (VmHWM: torchrun's agent would lend
  `ru_maxrss` its own peak), no allocator tuning (on CUDA, `max_memory_allocated`): `--layers`
  x Linear(`--width`) (25.2M parameters by default), each a fully_shard unit, AdamW, three
  steps of batch `--batch` per rank; the modes interleaved, `--repeats` rounds, medians. Bytes
  per parameter are per parameter the rank holds (its shard: half of them on 2 ranks).
- speed: the median step time (zero_grad, forward, scale_loss, step) of the same model, the
  modes interleaved in rotating order, each round's ratio to that round's O5 run; medians.
- resume: the worker's resume scenarios: bit for bit on the same world size, within tune's
  tolerance from 2 ranks to 1 and from 1 to 2 (torch.distributed.checkpoint).
- learning: tests/_fsdp_lowmem_worker.py's fine-tuning case (updates of ~0.1 bfloat16 ulp)
  for AdamW and SGD with momentum: O0, sharded O3, O5 and both modes; the distance of each
  final loss from O0's over O0's progress, and whether the ranks hold the same full model.

Targets: "stochastic" at least 3 B/param below sharded O5 and "kahan" 1.5; step time at most
15% above O5's; both modes within O5's distance of O0, or within 10% of O0's progress.

    python scripts/lowmem_fsdp.py memory            # 3 rounds of O5, stochastic, kahan
    python scripts/lowmem_fsdp.py speed --repeats 5
    python scripts/lowmem_fsdp.py learning
    python scripts/lowmem_fsdp.py resume
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
MODES = ("O5", "stochastic", "kahan")
TARGETS = {"stochastic": 3.0, "kahan": 1.5}  # bytes per (held) parameter below sharded O5's peak
TIME_TOL = 0.15


def child(a: argparse.Namespace) -> None:
    """One rank of one run (under torchrun): writes its figures to a.out/rank{RANK}.json."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    import ampatch as amp
    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    result: dict = {"rank": rank}
    if a.child == "resume":
        sys.path.insert(0, str(ROOT / "tests"))
        import _fsdp_lowmem_worker as worker
        done = worker.run_all(rank, dist.get_world_size(), set(a.scenarios.split(",")), a.where)
        result.update({name: {k: v for k, v in r.items() if k in ("same", "losses", "rounds", "error")}
                       for name, r in done.items()})
    elif a.child == "learning":
        sys.path.insert(0, str(ROOT / "tests"))
        import _fsdp_lowmem_worker as worker
        for opt in ("adamw", "sgd"):
            out = worker.finetune(rank, dist.get_world_size(), opt)
            result[opt] = {k: ({kk: vv for kk, vv in v.items() if kk != "weights"} if isinstance(v, dict) else v)
                           for k, v in out.items()}
    else:
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(a.width, a.width) for _ in range(a.layers))).to(device)
        params = sum(p.numel() for p in model.parameters())
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        kw = {} if a.mode == "O5" else {"master_weights": a.mode}
        model, opt = amp.initialize(model, opt, opt_level="O5", verbosity=0, **kw)
        held = sum(p.to_local().numel() for p in model.parameters())
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(a.batch, a.width, generator=gen).to(device)
        y = torch.randn(a.batch, a.width, generator=gen).to(device)
        times = []
        for _ in range(a.steps):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(x), y)
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            del loss
        from ampatch.session.telemetry import peak_memory_bytes
        peak = peak_memory_bytes()  # max_memory_allocated on CUDA; the peak RSS (VmHWM) on a CPU
        report = amp.report()
        result.update(params=params, held=held, peak=peak, step_s=statistics.median(times[a.steps // 5:]),
                      bytes_per_param=report.training_bytes_per_param, cuda=cuda)
    Path(a.out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo can abort in interpreter teardown (DESIGN's pitfalls)


def launch(what: str, a: argparse.Namespace, mode: str = "O5", world: int | None = None,
           extra: tuple[str, ...] = ()) -> list[dict]:
    """A fresh torchrun of WORLD ranks (no allocator tuning in their environment); each rank's figures."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "AMPATCH_"))}
    env.update(OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory(prefix="ampatch-lowmem-fsdp-") as out:
        world = world or a.world
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
               os.path.abspath(__file__), "--child", what, "--mode", mode, "--out", out, f"--width={a.width}",
               f"--world={world}", *extra,
               f"--layers={a.layers}", f"--batch={a.batch}", f"--steps={a.steps}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        files = sorted(Path(out).glob("rank*.json"))
        if len(files) != world:
            raise RuntimeError(f"{what} {mode}: {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        return [json.loads(f.read_text()) for f in files]


def interleaved(what: str, a: argparse.Namespace) -> dict[str, list[list[dict]]]:
    runs: dict[str, list[list[dict]]] = {m: [] for m in MODES}
    for r in range(a.repeats):
        for mode in MODES[r % len(MODES):] + MODES[:r % len(MODES)]:
            runs[mode].append(launch(what, a, mode))
    return runs


def memory(a: argparse.Namespace) -> bool:
    runs = interleaved("memory", a)
    first = runs["O5"][0][0]
    unit = "max_memory_allocated" if first["cuda"] else "peak RSS (VmHWM)"
    per_rank = {m: [statistics.median(run[r]["peak"] for run in rs) for r in range(a.world)] for m, rs in runs.items()}
    mib, ok = 2 ** 20, True
    print(f"per-rank {unit} of fresh processes, no allocator tuning: {a.layers} x Linear({a.width}) = "
          f"{first['params'] / 1e6:.1f}M params, fully_shard per layer, {a.world} rank(s) "
          f"({first['held'] / 1e6:.1f}M held per rank), AdamW, batch {a.batch} per rank, {a.steps} steps; "
          f"median of {a.repeats} runs per mode, modes interleaved")
    print(f"  {'mode':<11} " + " ".join(f"{f'rank {r} MiB':>11}" for r in range(a.world))
          + f" {'below O5':>10} {'(per param)':>12} {'report B/param':>15}  runs (MiB, by rank)")
    for mode, peaks in per_rank.items():
        saved = min((o - p) for o, p in zip(per_rank["O5"], peaks)) / first["held"]
        print(f"  {mode:<11} " + " ".join(f"{p / mib:11.1f}" for p in peaks)
              + f" {saved:6.2f} B/p {saved * first['held'] / first['params']:8.2f} B/p "
              f"{runs[mode][0][0]['bytes_per_param']:15.2f}  "
              + ", ".join("/".join(f"{rk['peak'] / mib:.0f}" for rk in run) for run in runs[mode]))
        if mode in TARGETS:
            ok &= saved >= TARGETS[mode]
    print("  below O5: the smaller saving of the two ranks, per parameter the rank holds (per parameter of the "
          "model in brackets); report B/param: report().training_bytes_per_param on rank 0 (weight, masters or "
          "compensation, optimizer state)")
    print("  targets: " + ", ".join(f"{m} >= {t} B/param below sharded O5" for m, t in TARGETS.items())
          + f": {'met' if ok else 'NOT met'}")
    return ok


def speed(a: argparse.Namespace) -> bool:
    runs = interleaved("speed", a)
    step = {m: [max(r["step_s"] for r in run) for run in rs] for m, rs in runs.items()}  # the slower rank paces a step
    print(f"step time (zero_grad, forward, scale_loss, step; the slower rank), {a.layers} x Linear({a.width}), "
          f"fully_shard per layer, {a.world} rank(s), AdamW, batch {a.batch} per rank, median of {a.steps} steps "
          f"after warm-up; {a.repeats} rounds, modes interleaved in rotating order, each a fresh torchrun")
    print(f"  {'mode':<11} {'ms':>8} {'vs O5':>8}  runs (ms)")
    ok = True
    for mode, times in step.items():
        ratio = statistics.median(t / o for t, o in zip(times, step["O5"])) - 1
        print(f"  {mode:<11} {statistics.median(times) * 1e3:8.1f} {ratio:+8.1%}  "
              + ", ".join(f"{t * 1e3:.1f}" for t in times))
        if mode != "O5":
            ok &= ratio <= TIME_TOL
    print(f"  vs O5: the median over rounds of each round's ratio; target: at most {TIME_TOL:.0%} slower: "
          f"{'met' if ok else 'NOT met'}")
    return ok


def learning(a: argparse.Namespace) -> bool:
    ranks = launch("learning", a)
    ok = True
    print(f"the fine-tuning case of tests/_fsdp_lowmem_worker.py (finetune), {a.world} rank(s): distance of the final "
          "FP32 loss from O0's over O0's progress | of the curve's end (mean of the last 40 losses); weights "
          "left unchanged; the same full model on every rank")
    for opt in ("adamw", "sgd"):
        r = ranks[0][opt]
        o0 = r["O0"]
        progress = r["start"] - o0["final"]
        o5 = abs(r["O5"]["final"] - o0["final"]) / progress
        print(f"{opt}: O0 loss {r['start']:.6f} -> {o0['final']:.6f}")
        for run in ("O3", "O5", "stochastic", "kahan"):
            x = r[run]
            final, curve = abs(x["final"] - o0["final"]) / progress, abs(x["curve"] - o0["curve"]) / progress
            same = all(rk[opt][run]["checksum"] == x["checksum"] for rk in ranks)
            print(f"  {'sharded ' + run if run == 'O3' else run:<11} final {final:.4f}   curve {curve:.4f}   "
                  f"unchanged {x['unchanged']:.1%}   ranks agree: {'yes' if same else 'NO'}")
            if run in ("stochastic", "kahan"):
                ok &= same and (final <= o5 or final <= 0.1)
    print("  target: both modes within O5's distance of O0 or within 10% of O0's progress: "
          f"{'met' if ok else 'NOT met'}")
    return ok


def resume(a: argparse.Namespace) -> bool:
    """tests/_fsdp_lowmem_worker.py's resume scenarios under torchrun: on 2 ranks, per-rank state
    dicts, full state dicts and dcp.save/dcp.load, bit for bit; across world sizes (2 -> 1,
    1 -> 2, dcp), the loss curve's largest gap from the straight run over its progress."""
    from ampatch.runs.deviation import TOLERANCE
    modes = ("stochastic", "kahan")
    same = [f"resume/{m}/{how}" for m in modes for how in ("plain", "dcp_full", "dcp")]
    saves, loads = [f"reshard_save/{m}" for m in modes], [f"reshard_load/{m}" for m in modes]
    ok = True
    with tempfile.TemporaryDirectory(prefix="ampatch-reshard-") as where:
        def run(world: int, names: list[str]) -> dict:
            return launch("resume", a, world=world, extra=("--scenarios", ",".join(names), "--where", where))[0]
        bits = run(2, same + saves)
        one = run(1, saves + loads)
        two = run(2, loads)
    print("resume of the worker's 6-step runs (tests/_fsdp_lowmem_worker.py), AdamW, torchrun")
    for name in same:
        ok &= bool(bits[name].get("same"))
        print(f"  {name:<28} same world size (2): {'bit for bit' if bits[name].get('same') else 'DIFFERS'}")
    for mode in modes:
        for label, straight, resumed in (("2 -> 1", bits, one), ("1 -> 2", one, two)):
            s_losses, r_losses = straight[f"reshard_save/{mode}"]["losses"], resumed[f"reshard_load/{mode}"]["losses"]
            half = len(s_losses) // 2
            gap = max(abs(x - y) for x, y in zip(r_losses, s_losses[half:])) / (s_losses[0] - s_losses[-1])
            ok &= gap <= TOLERANCE
            print(f"  {mode:<10} {label}: largest gap from the straight run {gap:.3%} of its progress "
                  f"(tune's tolerance {TOLERANCE:.0%})")
    print("  targets: bit for bit on the same world size, within tune's tolerance across: "
          f"{'met' if ok else 'NOT met'}")
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", nargs="?", choices=("memory", "speed", "learning", "resume"), default="memory")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--batch", type=int, default=None, help="per rank (default: memory 8, speed 64)")
    p.add_argument("--steps", type=int, default=None, help="(default: memory 3, speed 20)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--world", type=int, default=2, help="ranks (one GPU each where CUDA is available; default 2)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="O5", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--scenarios", help=argparse.SUPPRESS)
    p.add_argument("--where", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        child(a)
        return 0
    a.batch = a.batch or (64 if a.what == "speed" else 8)
    a.steps = a.steps or (20 if a.what == "speed" else 3)
    from ampatch.machine import hardware
    from ampatch.machine.device_text import machine_line
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"machine: {machine_line(hardware.describe(device), ['bfloat16'])}; {datetime.date.today()}")
    print(f"command: python scripts/lowmem_fsdp.py {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip())
    return 0 if {"memory": memory, "speed": speed, "learning": learning, "resume": resume}[a.what](a) else 1


if __name__ == "__main__":
    raise SystemExit(main())
