"""A session's counters while it runs, assembled into its `Report` on demand.

Counting is cheap and always on (atomic counters per op). Per-step wall times and the loss
curve cost a clock read and a host sync per step, so they are recorded only when asked for
(`record=True`, which `AMPATCH_REPORT` turns on for the `ampatch` command). Timing every
wrapper costs two clock reads per patched call, so it has its own switch
(`time_wrappers=True`, `AMPATCH_TIME_WRAPPERS=1`); otherwise the report says "not measured".
While recording, `AMPATCH_PROGRESS=PATH` appends "step loss" per optimizer step to PATH: the
live progress `ampatch compare` shows inside each level.
"""
from __future__ import annotations

import functools
import resource
import threading
import time
from collections.abc import Sequence

import torch

from ..base.counters import Counters
from ..config.options import Properties
from ..machine.hardware import SessionDevice
from ..model.fp8 import Fp8Layers
from ..optim.scaler import LossScaler
from .report import Report

__all__ = ["Telemetry", "Series", "SERIES_POINTS", "peak_memory_bytes"]


SERIES_POINTS = 2048  # the most points a per-step series (losses, step times) keeps


class Series:
    """A per-step series of at most `limit` points, so a long run's report stays small: when
    full, every other point is dropped and the stride doubles. `values[i]` is the value at
    call `i * stride`."""

    def __init__(self, limit: int | None = None) -> None:
        limit = SERIES_POINTS if limit is None else limit
        self.values: list[float] = []
        self.stride = 1
        self.count = 0
        self.last: float | None = None  # the newest value, kept or thinned out
        self.limit = max(2, limit - limit % 2)

    def append(self, value: float) -> None:
        self.last = value
        if self.count % self.stride == 0:
            self.values.append(value)
            if len(self.values) >= self.limit:
                del self.values[1::2]
                self.stride *= 2
        self.count += 1

    def __iter__(self):
        return iter(self.values)

    def __len__(self) -> int:
        return len(self.values)


class Telemetry:
    """Mutable counters of one session."""

    def __init__(self, record: bool = False, time_wrappers: bool = False, progress: str | None = None) -> None:
        self.record = record
        self.time_wrappers = time_wrappers
        self.steps = 0
        self.skipped: list[int] = []
        self.losses = Series()
        self.step_times = Series()
        self.wrapper_time = 0.0
        self.scale_loss_time = 0.0
        self._last_step: float | None = None
        self._lock = threading.Lock()
        self._progress = progress if record else None  # a path: "step loss" lines appended while recording

    @functools.cached_property
    def counters(self) -> Counters:
        """Casts per op (made with the O1 patches: a cast model counts none)."""
        return Counters()

    def add_wrapper_time(self, seconds: float) -> None:
        with self._lock:
            self.wrapper_time += seconds

    def on_loss(self, loss: torch.Tensor) -> None:
        if self.record:
            self.losses.append(float(loss.detach().float().mean()))

    def on_step(self, iteration: int, skipped: bool) -> None:
        self.steps += 1
        if skipped:
            self.skipped.append(iteration)
        if self.record:
            now = time.perf_counter()
            if self._last_step is not None:
                self.step_times.append(now - self._last_step)
            self._last_step = now
            if self._progress:
                try:
                    with open(self._progress, "a") as f:
                        last = self.losses.last
                        f.write(f"{self.steps} {float('nan') if last is None else last}\n")
                except OSError:  # the command that asked for it went away: never fail a step for it
                    self._progress = None

    def report(self, properties: Properties, cache: dict[str, int], scalers: Sequence[LossScaler],
               device: SessionDevice | None, kept: Sequence[str], footprints: Sequence[tuple[int, int]] = (),
               state_bytes: int = 0, fp8: Fp8Layers | None = None, underflow: tuple[int, int] = (0, 0)) -> Report:
        """The `Report` of a session: these counters with its `properties`, cast-cache
        `{"hits", "misses"}`, loss scalers, device (`hardware.check_half`), the labels of
        the modules kept in FP32, and the optimizers' `(params, bytes)` footprints (weights
        plus masters or compensations, `Masters.footprint`) and the bytes of their state (kept
        state included, `optim.states`; `underflow`: its int8 elements at the bottom of their
        block's range, of those in blocks that hold something), and
        the layers run in FP8 (`model.fp8.Fp8Layers`)."""
        params = sum(n for n, _ in footprints)
        size = sum(b for _, b in footprints)
        return Report(
            opt_level=properties.opt_level,
            half_dtype=properties.half_name,
            enabled=properties.enabled,
            casts=self.counters.snapshot() if "counters" in self.__dict__ else {},
            cache=dict(cache),
            steps=self.steps,
            skipped_steps=list(self.skipped),
            loss_scale={f"loss_scaler{i}": s.scale for i, s in enumerate(scalers)},
            loss_scale_history={f"loss_scaler{i}": [list(h) for h in s.history] for i, s in enumerate(scalers)},
            time_s={"wrappers": self.wrapper_time if self.time_wrappers else None, "scale_loss": self.scale_loss_time},
            step_times_s=list(self.step_times),
            losses=list(self.losses),
            losses_every=self.losses.stride,
            step_times_every=self.step_times.stride,
            peak_memory_bytes=peak_memory_bytes(),
            device=device,
            keep_fp32=list(kept),
            master_weights=properties.master_mode.value if properties.enabled else "",
            trained_params=params,
            bytes_per_param=size / params if params else 0.0,
            optimizer_state_bytes=state_bytes,
            optimizer_states=properties.optimizer_states.value if properties.enabled else "",
            optimizer_state_underflow=underflow[0] / underflow[1] if underflow[1] else 0.0,
            fp8=fp8.recipe if fp8 is not None else "",
            fp8_emulated=fp8 is not None and fp8.emulated,
            fp8_layers=[c.to_dict() for c in fp8.choices] if fp8 is not None else [],
        )


def peak_memory_bytes() -> int:
    """CUDA peak allocation when CUDA was used, else the process's peak RSS: on Linux its
    VmHWM, since `ru_maxrss` there carries over the peak of the process that exec'd this one
    (a run launched by `ampatch compare`, torchrun or pytest would report at least their
    peak); `ru_maxrss` elsewhere."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
