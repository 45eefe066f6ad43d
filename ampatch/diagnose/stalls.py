"""Stalled updates, read from the recorded per-parameter unchanged shares (`ampatch.record.stalls`).

Per module: the share of its own weights each of the later recorded steps left unchanged (the
mean over the later half of the steps each parameter has figures for, weighted by elements;
the first steps are left out, where a learning-rate warm-up may still be near 0). Only weights
held in a half dtype with nothing else keeping their updates (`master_weights` none: O3, or a
model passed in half) can stall; FP32 masters keep every update, and the low-memory modes
(`stochastic`, `kahan`) keep them in expectation by design, so neither is judged here.

A *finding*, with FP32 masters recommended, when on average at least `MODEL_SHARE` of the
model's weights are left unchanged by each step: the run learns little or nothing. A smaller
stall (a norm's gain at 1.0, an embedding initialised at N(0, 1): Adam's steps of 1e-3 are
below half of bfloat16's spacing of 0.0078 around 1) is a note: those weights barely learn,
the rest trains.
"""
from __future__ import annotations

from collections.abc import Sequence

from ..base.dtypes import HALF_NAMES
from ..record.records import ParamRecord
from .result import Stall, StalledModule

__all__ = ["STALL_SHARE", "MODEL_SHARE", "ModuleStall", "by_module", "stall", "note"]

STALL_SHARE = 0.5   # a module whose weights are this share unchanged by each step has stalled
MODEL_SHARE = 0.5   # a finding when this share of the model's weights is unchanged by each step
SHOWN = 4           # stalled modules named in a note


class ModuleStall:
    """One module's weights: elements, the dtype holding them, the mean unchanged share."""

    def __init__(self) -> None:
        self.weights = 0
        self.held_in: str | None = None
        self._sum = 0.0
        self._counted = 0
        self.steps = 0

    def add(self, p: ParamRecord) -> None:
        self.weights += p.numel
        self.held_in = self.held_in or p.dtype
        seen = [u for u in p.unchanged if u is not None]
        late = seen[len(seen) // 2:]
        if late:
            self._sum += p.numel * sum(late) / len(late)
            self._counted += p.numel
            self.steps = max(self.steps, len(late))

    @property
    def unchanged(self) -> float | None:
        return self._sum / self._counted if self._counted else None

    @property
    def counted(self) -> int:
        return self._counted


def by_module(params: Sequence[ParamRecord]) -> dict[str, ModuleStall]:
    """Each module's own weights, summed over its parameter tensors."""
    out: dict[str, ModuleStall] = {}
    for p in params:
        out.setdefault(p.module, ModuleStall()).add(p)
    return out


def stall(params: Sequence[ParamRecord], master_weights: str) -> Stall | None:
    """The stall of a recorded run's half-held weights (None: none stall, or nothing can:
    FP32-held weights, FP32 masters or a low-memory master mode)."""
    if master_weights != "none":
        return None
    modules: dict[str, tuple[ModuleStall, float]] = {}  # half-held modules with figures: (module, unchanged share)
    for k, m in by_module(params).items():
        share = m.unchanged
        if m.held_in in HALF_NAMES and share is not None:
            modules[k] = (m, share)
    total = sum(m.counted for m, _ in modules.values())
    if not total:
        return None
    unchanged = sum(share * m.counted for m, share in modules.values()) / total
    stalled = sorted(((k, m, share) for k, (m, share) in modules.items() if share >= STALL_SHARE),
                     key=lambda kms: (-kms[1].weights, kms[0]))
    if not stalled:
        return None
    held = next(m.held_in for m, _ in modules.values() if m.held_in)
    return Stall(tuple(StalledModule(k, share) for k, _, share in stalled), unchanged,
                 max(m.steps for _, m, _ in stalled), held or "", unchanged >= MODEL_SHARE)


def _names(s: Stall) -> str:
    shown = ", ".join(f"{m.name or '(model)'}: {m.unchanged:.0%}" for m in s.modules[:SHOWN])
    return shown + (f", and {len(s.modules) - SHOWN} more" if len(s.modules) > SHOWN else "")


def note(s: Stall, level: str | None) -> str:
    """The stall in words: where, why, and what keeps the updates."""
    low_memory = (" (or, without the FP32 copy, master_weights='stochastic': no extra memory, or 'kahan': 2 bytes "
                  "per parameter)") if s.held_in == "bfloat16" else ""
    where = f"{s.held_in} with no FP32 master copy" + (f" ({level})" if level else "")
    if s.finding:
        return (f"stalled updates: on average {s.unchanged:.0%} of the model's weights were left unchanged by each of "
                f"the last {s.steps} optimizer steps ({_names(s)}): each update is below {s.held_in}'s resolution "
                f"around its weight and rounds away, because the weights are {where}. The run learns little or "
                f"nothing. Keep FP32 master weights: opt_level O2/O5, or master_weights=True{low_memory}.")
    return (f"some weights barely learn: {_names(s)} of their weights were left unchanged by each of the last "
            f"{s.steps} optimizer steps (updates below {s.held_in}'s resolution; the weights are {where}); "
            f"{s.unchanged:.0%} of the whole model's. FP32 master weights (O2/O5) would keep their updates.")
