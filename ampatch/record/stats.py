"""Numbers about tensors, computed without keeping them: largest finite magnitude, inf/NaN
counts, the relative error of a half result against its FP32 shadow, and the share of a
gradient that underflows a half dtype.

Every function here reduces tensors to Python numbers at once, so a diagnosed run holds
no activations, gradients or copies past the call that measured them.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from ..base.tree import map_tensors

__all__ = ["floating_tensors", "magnitude", "relative_error", "underflow_fraction", "headroom"]


def floating_tensors(x: Any) -> list[torch.Tensor]:
    """Every floating tensor in `x` (nested lists, tuples, namedtuples and dicts, as the
    wrappers see arguments: `tree.map_tensors`), in order; a sparse one by its values."""
    found: list[torch.Tensor] = []

    def visit(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            found.append(t._values() if t.is_sparse else t)
        return t

    map_tensors(x, visit)
    return found


def magnitude(tensors: list[torch.Tensor]) -> tuple[float, int]:
    """(largest finite |value|, number of inf/NaN elements) over `tensors`."""
    amax, nonfinite = 0.0, 0
    for t in tensors:
        if t.numel() == 0:
            continue
        t = t.detach()
        finite = torch.isfinite(t)
        bad = t.numel() - int(finite.sum())
        nonfinite += bad
        a = t.abs()
        if bad:
            a = torch.where(finite, a, torch.zeros((), dtype=a.dtype, device=a.device))
        amax = max(amax, float(a.max()))
    return amax, nonfinite


def relative_error(out: list[torch.Tensor], shadow: list[torch.Tensor]) -> float | None:
    """``||out - shadow||_2 / ||shadow||_2`` over all elements of the paired tensors, in
    float64: the local error of a half computation against its FP32 shadow. None where the
    two do not pair up (different counts or shapes) or the shadow itself is not finite;
    inf where `out` is not finite but the shadow is."""
    if len(out) != len(shadow) or not shadow:
        return None
    num = den = 0.0
    for o, s in zip(out, shadow):
        if o.shape != s.shape:
            return None
        s64 = s.detach().to(torch.float64)
        if not bool(torch.isfinite(s64).all()):
            return None
        o64 = o.detach().to(device=s64.device, dtype=torch.float64)
        if not bool(torch.isfinite(o64).all()):
            return math.inf
        num += float(((o64 - s64) ** 2).sum())
        den += float((s64 ** 2).sum())
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return math.sqrt(num / den)


def underflow_fraction(grad: torch.Tensor, half: torch.dtype) -> float:
    """The share of `grad`'s elements that are zero or below the smallest normal number of
    `half` (float16: 6.1e-5): in that dtype they are lost or kept with few bits."""
    g = grad._values() if grad.is_sparse else grad
    if g.numel() == 0:
        return 0.0
    tiny = torch.finfo(half).tiny
    return float((g.detach().abs() < tiny).sum()) / g.numel()


def headroom(amax: float, half: torch.dtype) -> float | None:
    """How many times `amax` fits under `half`'s largest finite value (float16: 65504);
    below 1 the value overflows. None for an all-zero output."""
    if amax <= 0.0:
        return None
    return torch.finfo(half).max / amax
