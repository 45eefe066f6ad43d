"""Memory measurement, written once for every script that measures training memory
(bench's memory, fsdp and gpu sections, scripts/o2_memory.py), so their figures compare.

Two parts: the exact bytes of the tensors that live across steps (unique storages), and
the growth of the peak over a stretch of work: on CPU the peak RSS (Linux: VmHWM, reset
through /proc/self/clear_refs), on CUDA torch's max_memory_allocated.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterable

import torch
from torch import nn

import ampatch as amp

CLEAR_REFS = "/proc/self/clear_refs"
# Child processes that measure the RSS run with this environment: malloc returns freed
# blocks of 64 KiB and more to the OS, so the RSS follows the tensors alive.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def measure_each_fresh(script: str, args: list[str], modes: Iterable[str]) -> dict[str, dict]:
    """Run `script ARGS --one MODE` for each mode, each in a fresh process with `MALLOC_ENV`,
    and return the JSON each printed last: peaks that earlier modes cannot raise."""
    out = {}
    for mode in modes:
        proc = subprocess.run([sys.executable, os.path.abspath(script), *args, "--one", mode],
                              capture_output=True, text=True, check=True, env=dict(os.environ, **MALLOC_ENV))
        out[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def rss_measurable() -> bool:
    """Whether this system can reset and read the peak RSS (Linux's /proc/self/clear_refs)."""
    return os.path.exists(CLEAR_REFS)


def status_kib(field: str) -> int:
    """A kB field of /proc/self/status (VmRSS: resident now, VmHWM: peak resident)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank; any other tensor as it is."""
    to_local = getattr(t, "to_local", None)  # torch.distributed.tensor.DTensor
    return to_local() if callable(to_local) else t


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the unique storages under `tensors` (a DTensor counts its local shard)."""
    seen: dict[int, int] = {}
    with torch.no_grad():
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                s = _local(t).untyped_storage()
                seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def optimizer_state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors of the optimizer's state (AdamW: step, exp_avg, exp_avg_sq)."""
    return [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


def persistent_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Exact bytes of the training state that lives across steps: params and buffers of the
    model, the params the optimizer steps (FP32 masters under O2), their grads, optimizer state."""
    tensors = list(model.parameters()) + list(model.buffers()) + list(amp.master_params(opt))
    tensors += [p.grad for p in tensors if isinstance(p, torch.Tensor) and p.grad is not None]
    return storage_bytes(tensors + optimizer_state(opt))


class PeakMeter:
    """Growth of the peak memory since `start()`: of the peak RSS on CPU, of
    max_memory_allocated on CUDA. `growth()` may be read several times (after each phase).
    On a CPU without /proc/self/clear_refs (not Linux) it measures nothing: `available` is
    False and the caller reports no peak."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.available = self.cuda or (device.type == "cpu" and rss_measurable())
        self._start = 0

    def start(self) -> None:
        """Reset the peak to what is in use now, and remember that."""
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._start = torch.cuda.memory_allocated()
        elif self.available:
            with open(CLEAR_REFS, "w") as f:
                f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
            self._start = status_kib("VmRSS") * 1024

    def growth(self) -> int:
        """Bytes the peak rose above the start."""
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self._start
        if not self.available:
            raise RuntimeError("PeakMeter.growth: no peak memory measure on this system (needs "
                               f"{CLEAR_REFS} on CPU)")
        return status_kib("VmHWM") * 1024 - self._start
