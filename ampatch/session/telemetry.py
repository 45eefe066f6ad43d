"""Counters and `report()`: what a session did.

Counting is cheap and always on (atomic counters per op). Per-step wall times and the loss
curve cost a clock read and a host sync per step, so they are recorded only when asked for
(`record=True`, which `AMPATCH_REPORT` turns on for the `ampatch` command). Timing every
wrapper costs two clock reads per patched call, so it has its own switch
(`time_wrappers=True`, `AMPATCH_TIME_WRAPPERS=1`); otherwise the report says "not measured".
While recording, `AMPATCH_PROGRESS=PATH` appends "step loss" per optimizer step to PATH: the
live progress `ampatch compare` shows inside each level.
"""
from __future__ import annotations

import atexit
import dataclasses
import itertools
import json
import logging
import os
import resource
import threading
import time
import types
import typing
from dataclasses import dataclass, field
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..base.dtypes import short_name

logger = logging.getLogger("ampatch")


def count_value(counter: itertools.count) -> int:
    """The next value an itertools.count would return, without advancing it."""
    return counter.__reduce__()[1][0]


class Counters:
    """Thread-safe call counters: `next()` on an itertools.count is atomic under the GIL."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str], itertools.count] = {}
        self._lock = threading.Lock()

    def counter(self, op: str, dtype: str) -> itertools.count:
        """The counter of (op, dtype), made once: later calls read it without the lock."""
        found = self._counts.get((op, dtype))
        if found is not None:
            return found
        with self._lock:
            return self._counts.setdefault((op, dtype), itertools.count())

    def snapshot(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for (op, dtype), c in list(self._counts.items()):
            n = count_value(c)
            if n:
                out.setdefault(op, {})[dtype] = n
        return out


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
        self.counters = Counters()
        self.steps = 0
        self.skipped: list[int] = []
        self.losses = Series()
        self.step_times = Series()
        self.wrapper_time = 0.0
        self.scale_loss_time = 0.0
        self._last_step: float | None = None
        self._lock = threading.Lock()
        self._progress = progress if record else None  # a path: "step loss" lines appended while recording

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


    def report(self, properties: Any, cache: dict[str, int], scalers: Sequence[Any], device: dict[str, Any],
               kept: Sequence[str]) -> "Report":
        """The `Report` of a session: these counters with its `properties` (levels.Properties),
        cast-cache `{"hits", "misses"}`, loss scalers, device (hardware.check_half) and the
        labels of the modules kept in FP32."""
        return Report(
            opt_level=properties.opt_level,
            half_dtype=short_name(properties.half_dtype) if properties.opt_level != "O0" else None,
            enabled=properties.enabled,
            casts=self.counters.snapshot(),
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
            device=dict(device),
            keep_fp32=list(kept),
        )


def peak_memory_bytes() -> int:
    """CUDA peak allocation when CUDA was used, else the process's peak RSS."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _seconds(value: float | None) -> str:
    return "not measured (AMPATCH_TIME_WRAPPERS=1)" if value is None else f"{value:.3f}s"


@dataclass
class Report:
    """A snapshot of a session's telemetry; `str()` is a table, `to_dict()` is JSON-ready."""

    opt_level: str
    half_dtype: str | None
    enabled: bool
    casts: dict[str, dict[str, int]]
    cache: dict[str, int]
    steps: int
    skipped_steps: list[int]
    loss_scale: dict[str, float]
    loss_scale_history: dict[str, list[list[float]]]
    time_s: dict[str, float | None]  # "wrappers" is None unless AMPATCH_TIME_WRAPPERS=1
    step_times_s: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    # a long run's series are thinned (at most SERIES_POINTS each): losses[i] is the loss of
    # the (i * losses_every)-th scale_loss, step_times_s[i] the (i * step_times_every)-th step
    losses_every: int = 1
    step_times_every: int = 1
    peak_memory_bytes: int = 0
    device: dict[str, Any] = field(default_factory=dict)  # hardware.check_half: device, half native?
    keep_fp32: list[str] = field(default_factory=list)  # the modules kept in FP32 (keep_fp32, AMPATCH_KEEP_FP32)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, data: Any) -> Report:
        """The report `to_dict` gave, read back (a child run's ``AMPATCH_REPORT`` JSON): the one
        reading of it. A field with a default may be missing (a report of an older ampatch);
        a missing required field, an unknown field or a value of the wrong type raises
        ValueError naming it, instead of a wrong figure later."""
        def fits(value: Any, hint: Any) -> bool:
            origin = typing.get_origin(hint)
            if origin in (typing.Union, types.UnionType):
                return any(fits(value, arg) for arg in typing.get_args(hint))
            if hint is Any:
                return True
            if hint is type(None):
                return value is None
            if hint is float:
                return isinstance(value, (int, float)) and not isinstance(value, bool)
            if hint is int:
                return isinstance(value, int) and not isinstance(value, bool)
            return isinstance(value, origin or hint)

        if not isinstance(data, dict):
            raise ValueError(f"a report is a JSON object, not {type(data).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ValueError(f"unknown report field(s) {', '.join(map(repr, unknown))}: written by another ampatch?")
        missing = [name for name, f in fields.items() if name not in data
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ValueError(f"the report lacks {', '.join(map(repr, missing))}")
        hints = typing.get_type_hints(cls)
        for name, value in data.items():
            if not fits(value, hints[name]):
                expected = hints[name].__name__ if isinstance(hints[name], type) else hints[name]
                raise ValueError(f"report field {name!r} is a {type(value).__name__}, not {expected}")
        return cls(**data)

    def __str__(self) -> str:
        lines = [f"ampatch report: opt_level={self.opt_level} half_dtype={self.half_dtype} "
                 f"enabled={self.enabled}",
                 *([f"  device: {self.device['summary']}"] if self.device.get("summary") else []),
                 *([f"  kept in FP32: {', '.join(n or '(the whole model)' for n in self.keep_fp32)}"] if self.keep_fp32 else []),
                 f"  steps {self.steps}, skipped {len(self.skipped_steps)}"
                 + (f" at {self.skipped_steps[:10]}" if self.skipped_steps else ""),
                 f"  cast cache: {self.cache['hits']} hits, {self.cache['misses']} misses",
                 f"  time in ampatch: wrappers {_seconds(self.time_s['wrappers'])}, "
                 f"scale_loss {_seconds(self.time_s['scale_loss'])}"]
        for name, scale in self.loss_scale.items():
            changes = len(self.loss_scale_history.get(name, [])) - 1
            lines.append(f"  {name}: scale {scale:g} ({changes} changes)")
        if self.casts:
            width = max(len(op) for op in self.casts)
            lines.append(f"  {'op'.ljust(width)}  casts")
            for op, per_dtype in sorted(self.casts.items(), key=lambda kv: -sum(kv[1].values())):
                detail = ", ".join(f"{d}: {n}" for d, n in sorted(per_dtype.items()))
                lines.append(f"  {op.ljust(width)}  {detail}")
        return "\n".join(lines)


class ExitJson:
    """Writes JSON about the newest tracked source to its path at interpreter exit, or
    earlier through `write(source)`; at most once per tracking.

    One hook per process and kind: a script that calls `initialize` several times writes
    about its last session (one exit hook per session would run newest-first and leave the
    oldest). Under torchrun every rank inherits the same path: only rank 0 writes it.
    """

    def __init__(self, produce: Callable[[Any], dict[str, Any]], what: str) -> None:
        self.produce, self.what = produce, what
        self.source: Any = None
        self.final: dict[str, Any] | None = None  # what a released source would have written
        self.path = ""
        self.written = False
        self.registered = False

    def track(self, source: Any, path: str) -> None:
        self.source, self.final, self.path, self.written = source, None, path, False
        if not self.registered:
            atexit.register(self.write)
            self.registered = True

    def release(self, source: Any) -> None:
        """`source` is closing: keep what it would write (small, bounded), not the source with
        its models and optimizers."""
        if self.source is source:
            try:
                self.final = self.produce(source)
            except Exception:
                logger.exception("ampatch: could not take the %s of the closing session", self.what)
            self.source = None

    def write(self, source: Any = None) -> None:
        """Write the tracked source's JSON now (given `source`: only if it is the tracked one)."""
        if self.written or (source is not None and source is not self.source) or process_rank() != 0:
            return
        try:
            data = self.produce(self.source) if self.source is not None else self.final
            if data is not None:
                with open(self.path, "w") as f:
                    json.dump(data, f)
                self.written = True
        except Exception:  # at exit or inside a step: say why, never fail the run for it
            logger.exception("ampatch: could not write the %s to %s", self.what, self.path)


exit_report = ExitJson(lambda session: session.report().to_dict(), "report")


def process_rank() -> int:
    """This process's rank: torchrun's RANK, else torch.distributed's (0 outside distributed runs).
    Read at exit, when the process group may be gone already."""
    if os.environ.get("RANK", "").isdigit():
        return int(os.environ["RANK"])
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
