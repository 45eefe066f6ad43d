"""The policies `ampatch tune` tries: each opt level with each half dtype worth trying here,
and, when memory is the objective, the low-memory master modes of a bfloat16-cast level and
the optimizer state's lower precisions."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from ampatch.base.dtypes import HALF_NAMES, short_name
from ampatch.config.levels import CASTING_LEVELS, fixed_half_dtype, half_dtype_conflict, uses_half
from ampatch.config.policy_file import Policy
from ampatch.config.values import LOW_MEMORY_MODES, StatePrecision
from ampatch.errors import ConfigError
from ampatch.machine import hardware

__all__ = ["Candidate", "REFERENCE", "initial", "SIMPLICITY", "OBJECTIVES", "low_memory_variants"]

OBJECTIVES = ("speed", "memory")  # what tune minimises among the policies that train like FP32

# ties between half policies go to the simpler one: fewer kept modules, then O1 over O2 over O3 (O4/O5 are O1/O2
# in bfloat16), then no loss scale or master weights set over one set (a tie with O0: see search.Search.choose)
SIMPLICITY = {"O0": 0, "O1": 1, "O4": 2, "O2": 3, "O5": 4, "O3": 5}


@dataclass(frozen=True)
class Candidate:
    """One policy to measure; `repairs`: the label of the candidate it is a repair of."""

    opt_level: str
    half_dtype: str | None = None
    keep_fp32: tuple[str, ...] = ()
    loss_scale: float | str | None = None
    master_weights: bool | str | None = None   # None: the level's own
    repairs: str | None = None
    fp8: str | None = None                     # a torchao recipe: the Linear layers in FP8 (tune.fp8)
    fp8_modules: tuple[str, ...] | None = None  # the layers left in FP8 (None: the default choice)
    fp8_exclude: tuple[str, ...] = ()          # the layers diagnose left out of FP8 (what the label says)
    optimizer_states: str | None = None        # None: the script's own; "bfloat16", "int8"

    def policy(self, measured: dict[str, Any] | None = None) -> Policy:
        return Policy(self.opt_level, self.half_dtype, self.keep_fp32, self.loss_scale, self.master_weights,
                      self.fp8, self.fp8_modules, self.optimizer_states, measured=measured)

    @property
    def label(self) -> str:
        if not self.fp8_exclude:
            return self.policy().describe()
        return f"{replace(self, fp8_modules=None).policy().describe()} without {list(self.fp8_exclude)}"

    def simplicity(self) -> tuple[int, int, int, int, int, int]:
        """Smaller is simpler (see `SIMPLICITY`; FP8 is not simpler than its level without it)."""
        return (len(self.keep_fp32) + len(self.fp8_exclude), SIMPLICITY[self.opt_level], int(self.fp8 is not None),
                int(self.loss_scale is not None), int(self.master_weights is not None),
                int(self.optimizer_states is not None))

    def repaired(self, keep: Sequence[str], loss_scale: float | str | None,
                 master_weights: bool | str | None = None, fp8_exclude: Sequence[str] = (),
                 fp8_modules: Sequence[str] | None = None) -> Candidate:
        """This candidate with `keep` added to its kept modules, `loss_scale` and `master_weights`
        (None: its own), and `fp8_exclude` left out of FP8 (`fp8_modules`: the layers then left)."""
        kept = tuple(dict.fromkeys([*self.keep_fp32, *keep]))
        exclude, modules = self.fp8_exclude, self.fp8_modules
        if fp8_exclude:
            exclude = tuple(dict.fromkeys([*self.fp8_exclude, *fp8_exclude]))
            modules = tuple(fp8_modules) if fp8_modules is not None else self.fp8_modules
        return replace(self, keep_fp32=kept, loss_scale=loss_scale if loss_scale is not None else self.loss_scale,
                       master_weights=master_weights if master_weights is not None else self.master_weights,
                       repairs=self.repairs or self.label, fp8_exclude=exclude, fp8_modules=modules)


REFERENCE = Candidate("O0")


def initial(levels: Sequence[str], device: str, half_dtype: str | None, objective: str = "speed") -> list[Candidate]:
    """Each level of `levels` (O0 aside) with each half dtype worth trying on `device`:
    `half_dtype` when given; else bfloat16, and float16 too where it is native (on a CPU
    without native float16, only when asked). O4/O5 are bfloat16 by definition. With the
    "memory" objective, the low-memory master modes too (`low_memory_variants`)."""
    if objective not in OBJECTIVES:
        raise ConfigError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    native = hardware.describe(device).native
    if half_dtype in HALF_NAMES:
        dtypes = [half_dtype]
    else:
        dtypes = ["bfloat16"] + (["float16"] if native.get("float16") else [])
    out = []
    for level in levels:
        if not uses_half(level):
            continue
        if half_dtype_conflict(level, half_dtype):  # --half-dtype float16 asks nothing of O4/O5
            continue
        fixed = fixed_half_dtype(level)
        for d in ([short_name(fixed)] if fixed is not None else dtypes):
            out.append(Candidate(level, d))
    if objective == "memory":
        out += low_memory_variants(out)
    return list(dict.fromkeys(out))


def low_memory_variants(cands: Sequence[Candidate]) -> list[Candidate]:
    """On one bfloat16-cast level among `cands` (O5 when tried, else O2, else O3 in bfloat16: on
    the others they train alike, and one level shows what each costs and saves):
    `master_weights="stochastic"` and `"kahan"` (no FP32 master copies), the optimizer state in
    each lower precision (`optimizer_states`), and the leanest of all, "stochastic" with int8
    state. Each is judged by the same learning test as any candidate."""
    cast = [c for c in cands if c.opt_level in CASTING_LEVELS and c.half_dtype == "bfloat16"]
    base = min(cast, key=lambda c: ("O5", "O2", "O3").index(c.opt_level), default=None)
    if base is None:
        return []
    lower = [p.value for p in StatePrecision if p.stored]
    return ([replace(base, master_weights=mode) for mode in LOW_MEMORY_MODES]
            + [replace(base, optimizer_states=states) for states in lower]
            + [replace(base, master_weights=LOW_MEMORY_MODES[0], optimizer_states=lower[-1])])
