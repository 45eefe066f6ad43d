"""The layers FP8 hurts, read from a diagnosed run's FP8 records (`record.fp8_probe`).

Each layer run in FP8 was measured against the same GEMMs in bfloat16 on its own inputs
(`Fp8Entry`: the relative error of its output and of its weight gradient, worst call; per
FP8 cast, the share of values that saturate, flush to zero or land among the subnormals).
FP8 *hurts* a layer (`judge`) when, by the run's own figures:

- **values are lost**: in one of the recipe's casts, the share of the non-zero values that
  flush to zero (or saturate) exceeds the largest relative rounding error of that cast's
  format (e4m3: 2^-4, e5m2: 2^-3): each lost value is off by all of itself, so more of them
  than that weigh more than FP8's rounding of all the others (a tensor whose values span more
  orders of magnitude than the format, under one scale);
- or **its error is more than rounding explains, and stands out**: its output's (or weight
  gradient's) relative error exceeds the sum of the largest relative rounding errors of the
  two operands' formats (the first-order bound of the product of two rounded numbers), and
  lies above the other converted layers' errors beyond their own scatter (log scale: their
  median plus the one-sided normal quantile at `CONFIDENCE`, Bonferroni over the layers, times
  1.4826 median absolute deviations). With fewer than `MIN_LAYERS` other layers there is no
  scatter to read, and the bound alone decides. When every layer strays beyond the bound
  and none stands out, FP8 hurts the model as a whole: a note says so, and no layer is named.

The remedy is to leave the named layers out of FP8 (`fp8_modules`: the converted layers but
them; FP8 off when none is left), which `diagnose` verifies by a rerun.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from ..model.fp8 import EMULATED
from ..record.records import Fp8LayerRecord
from ..runs.deviation import CONFIDENCE

__all__ = ["Fp8Entry", "entries", "judge", "rounding", "MIN_LAYERS", "OUTPUT_CASTS", "WGRAD_CASTS"]

MIN_LAYERS = 3   # other converted layers needed to read their scatter (a median and its deviation)
MAD_SIGMA = 1.4826  # a normal distribution's standard deviation in median absolute deviations
OUTPUT_CASTS = ("input@output", "weight@output")                      # the forward GEMM's operands
WGRAD_CASTS = ("grad_output@grad_weight", "input@grad_weight")        # the weight gradient's


def rounding(dtype: str | None) -> float:
    """The largest relative rounding error of an FP8 format by name ("float8_e4m3fn": 2^-4);
    0 for a cast kept in high precision (None)."""
    if dtype is None:
        return 0.0
    return float(torch.finfo(getattr(torch, dtype)).eps) / 2


@dataclass(frozen=True)
class Fp8Entry:
    """One layer run in FP8 (see the module docstring); `hurts` and `why` once judged."""

    name: str
    kind: str
    recipe: str
    emulated: bool
    calls: int
    out_rel_err: float | None           # worst call
    wgrad_rel_err: float | None         # worst call
    saturated: float | None             # the largest share over its casts
    flushed: float | None               # the largest share of non-zero values flushed to zero, over its casts
    subnormal: float | None             # the largest share among FP8's subnormals, over its casts
    flushed_in: str | None              # the cast where the most values flush
    casts: dict[str, dict[str, Any]]    # per cast: dtype, n, saturated, underflow, subnormal (counts)
    hurts: bool = False
    why: str | None = None
    failure: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _share(cast: dict[str, Any], key: str) -> float:
    return cast[key] / cast["n"] if cast.get("n") else 0.0


def _entry(r: Fp8LayerRecord) -> Fp8Entry:
    casts = r.casts
    worst = max(casts, key=lambda c: _share(casts[c], "underflow"), default=None)

    def largest(key: str) -> float | None:
        """The largest share of `key` over the layer's casts (None: no cast recorded)."""
        return max((_share(c, key) for c in casts.values()), default=None)

    return Fp8Entry(r.name, r.kind, r.recipe, r.emulated, r.calls, max(r.out_rel_err, default=None),
                    max(r.wgrad_rel_err, default=None), largest("saturated"), largest("underflow"),
                    largest("subnormal"), worst if worst is not None and _share(casts[worst], "underflow") else None,
                    dict(casts), failure=r.failure)


def entries(records: Sequence[Fp8LayerRecord]) -> list[Fp8Entry]:
    """The FP8 records as entries, unjudged, in module order."""
    return [_entry(r) for r in records]


def _bound(e: Fp8Entry, casts: Sequence[str]) -> float:
    """What FP8's rounding of a GEMM's two operands explains: their formats' largest relative
    rounding errors, summed (a cast the recipe keeps in high precision adds none)."""
    return sum(rounding(e.casts[c]["dtype"]) if c in e.casts else 0.0 for c in casts)


def _fence(others: Sequence[float], layers: int) -> float | None:
    """The error above which a layer stands out of `others` (the other layers' errors, log
    scale): median + q * 1.4826 MAD, q at CONFIDENCE over `layers` (Bonferroni); None without
    enough of them."""
    logs = [math.log(x) for x in others if x and x > 0]
    if len(logs) < MIN_LAYERS:
        return None
    mid = statistics.median(logs)
    mad = statistics.median(abs(x - mid) for x in logs)
    q = statistics.NormalDist().inv_cdf(1 - (1 - CONFIDENCE) / max(layers, 1))
    return math.exp(mid + q * MAD_SIGMA * mad)


def _lost(e: Fp8Entry) -> str | None:
    """Values lost in a cast beyond its format's rounding (see the module docstring)."""
    for label, cast in e.casts.items():
        bound = rounding(cast["dtype"])
        for key, verb in (("underflow", "flush to zero"), ("saturated", "saturate")):
            share = _share(cast, key)
            if share > bound:
                fmt = cast["dtype"].replace("float8_", "")
                return (f"{share:.0%} of the non-zero values of its {label} cast {verb} in FP8 ({fmt}, one "
                        f"{e.recipe} scale): more than the {bound:.2%} that {fmt}'s rounding costs each of the others "
                        "(a range wider than FP8's under one scale)")
    return None


def judge(found: Sequence[Fp8Entry]) -> tuple[list[Fp8Entry], list[str]]:
    """The entries with `hurts`/`why` set (see the module docstring), and notes in words."""
    notes: list[str] = []
    judged = []
    beyond_all = True
    for i, e in enumerate(found):
        why = _lost(e)
        strays = False
        for what, err, casts in (("output", e.out_rel_err, OUTPUT_CASTS), ("weight gradient", e.wgrad_rel_err,
                                                                            WGRAD_CASTS)):
            bound = _bound(e, casts)
            if why is not None or err is None or err <= bound:
                continue
            strays = True
            others = [getattr(o, "out_rel_err" if what == "output" else "wgrad_rel_err") for j, o in enumerate(found)
                      if j != i]
            fence = _fence([x for x in others if x is not None], len(found))
            if fence is None or err > fence:
                scatter = ("" if fence is None else f", and above the other FP8 layers' errors beyond their scatter "
                           f"({fence:.3g} at {CONFIDENCE:.0%})")
                why = (f"its {what}'s error against bfloat16, {err:.3g}, is more than FP8's rounding of its two "
                       f"operands explains ({bound:.3g}){scatter}")
        beyond_all = beyond_all and strays
        judged.append(replace(e, hurts=why is not None, why=why))
    if len(found) > 1 and beyond_all and not any(e.hurts for e in judged):
        notes.append("every FP8 layer's error is more than FP8's rounding explains, and none stands out: FP8 hurts "
                     "this model as a whole rather than a layer of it; compare a per-row recipe (rowwise) or leave "
                     "fp8 off (ampatch compare --levels O5,O5+fp8,O5+fp8:rowwise).")
    for e in judged:
        if e.hurts:
            notes.append(f"fp8: {e.name} ({e.kind}, {e.recipe}): {e.why}. Leave it out of FP8.")
    if judged and judged[0].emulated:
        notes.append(f"fp8: {EMULATED}: these errors are FP8's rounding and scaling as torchao's kernels make them "
                     "(up to the last bits of their accumulation); the run's speed is emulation's.")
    return judged, notes
