"""The bench's harness: the device and clock every section times with, the interleaved
timing loop (rounds, each running every mode once in a rotating order), and the summaries
(per-mode medians, medians of per-round ratios).

Why interleaved rounds: on a shared machine absolute times drift; a ratio of two modes
timed inside one round barely does, so every ratio is the median over rounds of that
round's ratio.
"""
from __future__ import annotations

import contextlib
import enum
import gc
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from ampatch.base.dtypes import short_name
from ampatch.machine import hardware
from ampatch.machine.device_text import machine_line as describe_machine

# The modes every training section compares: plain FP32, torch.autocast, ampatch's levels.
MODES = ("fp32", "autocast", "O1", "O2", "O3")

Log = Callable[[str], None]
T = TypeVar("T")


class Clock(enum.Enum):
    """What a timed block reads.

    THREAD: CPU time of the calling thread. With one torch thread on CPU all the work of a
    step runs on the calling thread (autograd runs a CPU backward on the caller), so this is
    the step time without the time other processes held the core: ratios stay stable on a
    shared machine. WALL: perf_counter, for every other case (synchronized on CUDA)."""

    THREAD = "thread"
    WALL = "wall"

    @classmethod
    def choose(cls, name: str, device: torch.device) -> Clock:
        """`name` ("thread", "wall" or "auto": thread on CPU with one torch thread, else wall)."""
        if name == "auto":
            return cls.THREAD if device.type == "cpu" and torch.get_num_threads() == 1 else cls.WALL
        return cls(name)

    @property
    def read(self) -> Callable[[], float]:
        return time.thread_time if self is Clock.THREAD else time.perf_counter

    @property
    def label(self) -> str:
        return "thread CPU time (time.thread_time)" if self is Clock.THREAD else "wall (perf_counter)"


@dataclass(frozen=True)
class Env:
    """The device, half dtype and clock of a run, and the helpers that depend on them."""

    device: torch.device
    half: torch.dtype
    clock: Clock = Clock.WALL

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def half_name(self) -> str:
        """"bfloat16" or "float16" (the form the command line and the reports use)."""
        return short_name(self.half)

    def now(self) -> float:
        return self.clock.read()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device.type, dtype=self.half)


@contextlib.contextmanager
def quiet_gc() -> Iterator[None]:
    """No garbage collection inside a timed block (it would land on a random mode)."""
    gc.collect()  # cheap: the command froze the import-time heap (gc.freeze)
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
            t0 = env.now()
            out = step()
            env.sync()
            times.append(env.now() - t0)
    return times, out


def time_calls(fn: Callable[[], Any], calls: int, env: Env) -> float:
    """Seconds per call of fn over `calls` calls (loop overhead included, same for every variant)."""
    with quiet_gc():
        t0 = env.now()
        for _ in range(calls):
            fn()
        return (env.now() - t0) / calls


def rotated(items: Sequence[str], r: int) -> list[str]:
    """`items` rotated left by r: round r starts with a different mode."""
    k = r % len(items)
    return list(items[k:]) + list(items[:k])


def interleaved(modes: Sequence[str], rounds: int, measure: Callable[[str], T],
                log: Log | None = None, label: str = "") -> dict[str, list[T]]:
    """measure(mode) for every mode in every round, each round in a rotated order: per mode,
    the list of its rounds' results. Logs "  {label}: round r/rounds" after each round."""
    per_round: dict[str, list[T]] = {m: [] for m in modes}
    for r in range(rounds):
        for mode in rotated(modes, r):
            per_round[mode].append(measure(mode))
        if log is not None:
            log(f"  {label}: round {r + 1}/{rounds}")
    return per_round


def summarise(per_round: dict[str, list[float]], pairs: Sequence[tuple[str, str]]) -> tuple[dict, dict]:
    """Per-mode medians of round medians, and for each pair "a/b" the median of per-round ratios."""
    medians = {m: statistics.median(v) for m, v in per_round.items()}
    ratios = {}
    for a, b in pairs:
        if a in per_round and b in per_round:
            ratios[f"{a}/{b}"] = statistics.median(x / y for x, y in zip(per_round[a], per_round[b]))
    return medians, ratios


def median_difference(a: Sequence[float], b: Sequence[float]) -> float:
    """The median over rounds of a - b (per-call overheads: a difference, not a ratio)."""
    return statistics.median(x - y for x, y in zip(a, b))


def scaled(values: dict[str, float], factor: float) -> dict[str, float]:
    """Every value times `factor` (seconds to ms: 1e3, to us: 1e6)."""
    return {k: v * factor for k, v in values.items()}


def cpu_name() -> str:
    """The CPU model and its core count, as ampatch.machine.hardware detected them."""
    cpu = hardware.describe("cpu")
    return f"{cpu.name}, {cpu.cores} cores"


def machine_line(env: Env) -> str:
    """ampatch.machine.hardware's line for the bench's device: name, flags or capability, half native?"""
    return describe_machine(hardware.describe(env.device), [env.half_name])
