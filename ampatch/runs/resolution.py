"""What a loss can witness: a fall within a few of its dtype's units in the last place (ulps)
at its level is rounding, not progress the loss resolves.

A deterministic run (full-batch, on a CPU) has no batch noise: a fall of 3 float32 ulps over
20 steps would be "18.8 standard errors" of a noise that is only the rounding itself. And a
loss computed in bfloat16 (a model that computes its own loss inside its half forward) moves
in steps of 0.008 at 1.0: it cannot say whether a run made a fall of 3e-7.

The dtype a curve's values are computed in is read from the values themselves (`dtype_of`):
the coarsest of bfloat16, float16 and float32 in which every one of them is exact (a
float32-valued loss of a few dozen steps is exact in bfloat16 with probability 2^-16 per
value; a bfloat16 loss cast to float32 for the report stays exact in bfloat16). A fall
*resolves* (`resolves`) when it exceeds `RESOLUTION_ULPS` ulps of that dtype at the curve's
level: the final rounding of each end (half an ulp each) and the rounding inside the loss's own
reduction (at least as much again) leave the last two bits of a computed loss to chance.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch

__all__ = ["RESOLUTION_ULPS", "dtype_of", "ulp", "floor", "resolves"]

RESOLUTION_ULPS = 4   # the last two bits of a computed loss are rounding
_COARSE_FIRST = (torch.bfloat16, torch.float16, torch.float32)


MIN_DISTINCT = 2   # one value repeated says nothing of the dtype it was computed in (a flat curve at 10.0)


def dtype_of(values: Iterable[float]) -> torch.dtype:
    """The coarsest dtype in which every finite value is exact (float64 when none is: not a
    float32 computation); float32 for fewer than `MIN_DISTINCT` distinct finite values."""
    finite = [v for v in values if math.isfinite(v)]
    if len(set(finite)) < MIN_DISTINCT:
        return torch.float32
    data = torch.tensor(finite, dtype=torch.float64)
    for dtype in _COARSE_FIRST:
        if float(data.abs().max()) > torch.finfo(dtype).max:
            continue
        if bool((data.to(dtype).to(torch.float64) == data).all()):
            return dtype
    return torch.float64


def ulp(level: float, dtype: torch.dtype) -> float:
    """The spacing of `dtype`'s numbers at `level` (its smallest normal's spacing near 0)."""
    info = torch.finfo(dtype)
    a = max(abs(level), info.tiny)
    return info.eps * 2.0 ** math.floor(math.log2(a))


def floor(level: float, dtype: torch.dtype) -> float:
    """The smallest fall a loss of `dtype` at `level` resolves: `RESOLUTION_ULPS` ulps."""
    return RESOLUTION_ULPS * ulp(level, dtype)


def resolves(fall: float, level: float, dtype: torch.dtype) -> bool:
    """Whether a fall of `fall` at `level` is beyond the loss's own rounding (module docstring)."""
    return fall > floor(level, dtype)
