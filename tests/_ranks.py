"""Running a test worker on several real gloo ranks, shared by the distributed tests.

`run_ranks` (the test side) starts one process per rank, each `python WORKER rank world
rdzv out_file` (a worker run by hand may take more arguments), waits with a timeout so that
a hung collective cannot hang the suite, and returns what each rank saved. `worker_main` (the
worker side) joins the group through a `file://` rendezvous, saves the results (or the
traceback) and leaves with `os._exit`, since gloo can abort in interpreter teardown (DESIGN
pitfalls).
"""
from __future__ import annotations

import datetime
import os
import subprocess
import sys
import traceback
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without AMPATCH_* variables, one torch thread per rank."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AMPATCH_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def run_ranks(worker: str | Path, tmp: Path, world: int, timeout_s: float, args: Sequence[str] = ()) -> list[dict]:
    """Run `worker` on `world` ranks (`args` after the protocol's own); the results each rank
    saved (pytest.fail if one has none)."""
    import pytest
    import torch

    procs, logs = [], []
    for rank in range(world):
        log = open(tmp / f"rank{rank}.log", "w+")
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, str(worker), str(rank), str(world), str(tmp / "rdzv"), str(tmp / f"rank{rank}.pt"),
             *args],
            stdout=log, stderr=subprocess.STDOUT, env=clean_env()))
    try:
        for p in procs:
            p.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read()[-4000:])
        log.close()
    results = []
    for rank, p in enumerate(procs):
        path = tmp / f"rank{rank}.pt"
        if not path.exists():
            pytest.fail(f"rank {rank} exited with {p.returncode} and no results:\n{outputs[rank]}")
        r = torch.load(path, weights_only=False)
        if "error" in r:
            pytest.fail(f"rank {rank} failed:\n{r['error']}\n{outputs[rank]}")
        results.append(r)
    return results


def worker_main(argv: Sequence[str], run_all: Callable[[int, int, Sequence[str]], dict[str, Any]]) -> None:
    """The worker's entry point: `run_all(rank, world, extra_args)` inside the gloo group."""
    import torch
    import torch.distributed as dist

    rank, world, rdzv, out_file = int(argv[1]), int(argv[2]), argv[3], argv[4]
    torch.set_num_threads(1)  # the ranks share a small machine
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    status = 0
    try:
        results = run_all(rank, world, list(argv[5:]))
    except BaseException:
        results, status = {"error": traceback.format_exc()}, 1
    torch.save(results, out_file + ".part")
    os.replace(out_file + ".part", out_file)
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def same(a: Any, b: Any) -> bool:
    """Bit-for-bit equality of nested results (dicts, lists, tensors of the same dtype and shape,
    plain values): what a resumed run is compared with the run it resumes."""
    import torch  # here: the rank launcher itself needs no torch

    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


def run_scenarios(scenarios: Sequence[tuple[str, Callable, tuple]], needs_dir: Collection[Callable], rank: int,
                  world: int, args: Sequence[str], on_error: Callable[[], None]) -> dict[str, Any]:
    """A worker's named scenarios, each `fn(rank, world, *its args)`, those in `needs_dir` with the
    folder `args[1]` (where given) last; `args[0]`: the names to run, comma-separated (none: all).
    A scenario that raises gives its traceback and `on_error()` cleans up for the next."""
    only = set(args[0].split(",")) if args and args[0] else None
    where = args[1] if len(args) > 1 else None
    results: dict[str, Any] = {}
    for name, fn, fn_args in scenarios:
        if only and name not in only:
            continue
        try:
            results[name] = fn(rank, world, *fn_args, *((where,) if fn in needs_dir and where else ()))
        except Exception:
            results[name] = {"error": traceback.format_exc()}
            on_error()
    return results
