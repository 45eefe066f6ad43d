"""`tune`'s FP8 candidates (torchao's float8 training, `initialize(fp8=...)`), and the rule that
keeps an emulated one from being chosen for speed.

- `--levels O5+fp8`: O5 with each of torchao's recipes (tensorwise, rowwise,
  rowwise_with_gw_hp), as a plain level is tried with each half dtype worth trying;
  `O5+fp8:rowwise`: that recipe only; `O4+fp8` (O1 in bfloat16) likewise. A master mode may
  come with it (`O5+kahan+fp8`). They are judged by the same learning test as every level.
- By default (no '+fp8' asked for), each recipe at O5 joins the candidates where FP8 runs on
  tensor cores (CUDA capability 8.9+, torchao installed) and O5 is tried. A machine that can
  only emulate FP8 (every CPU) tries them only when asked.
- A failing FP8 candidate is repaired like any other (`repair`): its recorded run measures
  each FP8 layer against bfloat16 and names those FP8 hurts (`diagnose.fp8`); the repair is
  the same recipe without them (`fp8_modules`).
- `emulated(report)`: the run's FP8 was emulated (its report says so): it is listed with its
  fidelity (deviation, learning) and never chosen, nor re-timed, for speed: emulation's step
  times say nothing of FP8's. FP8 does not change the bytes per parameter ampatch counts
  (weights, masters and optimizer state stay as at its level), so `--objective memory` has
  nothing to gain from it either.
"""
from __future__ import annotations

import importlib.util
from collections.abc import Sequence

from ampatch.base.dtypes import short_name
from ampatch.config import levels as level_table
from ampatch.config.options import fp8_conflict
from ampatch.config.values import FP8_RECIPES
from ampatch.errors import ConfigError
from ampatch.model.fp8 import EMULATED, has_fp8_kernels
from ampatch.session.report import Report
from ampatch.tune.candidates import Candidate

__all__ = ["split", "candidates", "by_default", "emulated", "NOT_CHOSEN"]

NOT_CHOSEN = f"{EMULATED}: listed for its fidelity, never chosen for speed"


def split(labels: Sequence[str]) -> tuple[list[str], list[level_table.Variant]]:
    """`--levels` as given: the plain levels (normalized), and the variants with a '+' part."""
    plain: list[str] = []
    variants: list[level_table.Variant] = []
    for label in labels:
        v = level_table.variant(label, "opt_level")
        if v.fp8 is None and v.master_weights is None:
            plain.append(v.level)
        else:
            variants.append(v)
    return plain, variants


def candidates(variants: Sequence[level_table.Variant], device: str, half_dtype: str | None) -> list[Candidate]:
    """The candidates of the '+' levels (see the module docstring). FP8 that would compute in
    float16 raises ValueError with `initialize`'s own message."""
    out = []
    for v in variants:
        recipes = FP8_RECIPES if v.fp8 is True else (v.fp8,) if v.fp8 else (None,)
        if v.fp8 is not None:
            why = fp8_conflict(v.level, v.fp8, half_dtype, device)
            if why:
                raise ConfigError(f"{v.label}: {why}")
        half = None
        if level_table.uses_half(v.level):  # FP8 computes in bfloat16 where the level has a half dtype
            half = short_name(level_table.half_dtype_for(v.level, device, "bfloat16" if v.fp8 else half_dtype))
        for recipe in recipes:
            out.append(Candidate(v.level, half, master_weights=v.master_weights, fp8=recipe))
    return out


def by_default(levels: Sequence[str], device: str) -> list[Candidate]:
    """Each recipe at O5 when O5 is tried, where FP8 runs on tensor cores here and torchao is
    installed; none elsewhere (see the module docstring)."""
    if "O5" not in levels or not has_fp8_kernels(device) or importlib.util.find_spec("torchao") is None:
        return []
    return [Candidate("O5", "bfloat16", fp8=recipe) for recipe in FP8_RECIPES]


def emulated(report: Report | None) -> bool:
    """Whether a run (its report) ran FP8 emulated (torchao had no FP8 tensor cores to run on)."""
    return report is not None and bool(report.fp8) and report.fp8_emulated
