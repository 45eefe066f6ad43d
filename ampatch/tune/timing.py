"""The timing rule: re-time the fastest qualifying candidates against O0, interleaved, and
call one policy faster than another only beyond the spread between repeats of the same run.

A shared machine drifts: a candidate timed in a quiet minute beats one timed in a busy one.
So the `RETIME` fastest qualifying candidates and O0 run again in turn (O0, A, B, C, O0, A, B, C,
... `ROUNDS` times), each policy's step time is the median of all its runs, and the spread is
the largest relative difference between two runs of the same policy (max - min over median).
`faster(a, b)`: a's step time is below b's by more than that spread.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence

__all__ = ["RETIME", "ROUNDS", "MIN_SPREAD", "order", "spread", "step_ms", "faster", "simplest_of_fastest"]

RETIME = 3        # the fastest qualifying candidates re-timed against O0 (3: a simpler policy just behind the
                  # two fastest still competes)
ROUNDS = 2        # interleaved rounds
MIN_SPREAD = 0.03 # never trust a difference below 3%, even if the repeats happened to agree


def order(reference: str, labels: Sequence[str], rounds: int = ROUNDS) -> list[str]:
    """The interleaved order of the re-timing runs: reference, each candidate, again."""
    return [x for _ in range(rounds) for x in (reference, *labels)]


def step_ms(times: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """Each policy's step time: the median of its runs' median step times."""
    return {k: statistics.median(v) for k, v in times.items() if v}


def spread(times: Mapping[str, Sequence[float]]) -> float:
    """The largest relative spread between runs of the same policy (at least `MIN_SPREAD`)."""
    found = [(max(v) - min(v)) / statistics.median(v) for v in times.values() if len(v) > 1]
    return max([MIN_SPREAD, *found])


def faster(a: float, b: float, noise: float) -> bool:
    """A step time of `a` ms beats `b` ms beyond the relative `noise`."""
    return a < b * (1.0 - noise)


def simplest_of_fastest(labels: Sequence[str], ms: Mapping[str, float], noise: float,
                        simplicity: Callable[[str], tuple]) -> str:
    """The simplest of the policies no other beats beyond the noise."""
    best = min(labels, key=lambda x: ms[x])
    tied = [x for x in labels if not faster(ms[best], ms[x], noise)]
    return min(tied, key=simplicity)
