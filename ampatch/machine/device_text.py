"""What ampatch tells people about a device: the advice logged when a session's half dtype
has no fast path (`half_advice`), the one-line description of a machine (`machine_line`,
in reports and above `ampatch compare`'s table) and the note under a table whose half levels
ran emulated (`slow_half_note`). The probing itself is `hardware`.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from ..base.dtypes import half_key

if TYPE_CHECKING:  # hardware uses this module's wording; this one only reads DeviceInfo's fields
    from .hardware import DeviceInfo

__all__ = ["half_advice", "machine_line", "slow_half_note"]


def half_advice(info: DeviceInfo, dtype: torch.dtype | str) -> str | None:
    """What to expect and what to do when `dtype` has no fast path on `info`; None when it has."""
    key = half_key(dtype)
    if key is None or info.is_native(key) is not False:
        return None
    where = f"{info.name}" + (f", compute capability {info.capability}" if info.capability else "")
    if info.type == "cpu":
        if key == "bfloat16":
            return (f"ampatch: bfloat16 has no fast path on this CPU ({where}; {info.basis[key]}), so the "
                    "half levels run SLOWER than O0 here, not faster (bfloat16 matmul is several times slower "
                    "than FP32 on such CPUs). O2/O3/O5 still save memory. For speed on this machine use O0; "
                    "bfloat16 pays off on CPUs with AVX512-BF16 or AMX (Intel Cooper Lake, Sapphire Rapids "
                    "and later; AMD Zen 4 and later) and on CUDA GPUs. verbosity=0 silences this.")
        other = ("half_dtype=torch.bfloat16, which this CPU runs natively" if info.native["bfloat16"]
                 else "O0: bfloat16 is emulated on this CPU too")
        return (f"ampatch: float16 has no fast path on this CPU ({where}; {info.basis[key]}): float16 matmul "
                f"runs tens of times slower than FP32 here. Use {other}. verbosity=0 silences this.")
    if info.type == "cuda":
        if key == "bfloat16":
            return (f"ampatch: bfloat16 has no tensor-core path on {where} ({info.basis[key]}): expect it to be "
                    "slower than float16. Use half_dtype=torch.float16 (the default on CUDA; O1/O2 with dynamic "
                    "loss scaling) instead of O4/O5. verbosity=0 silences this.")
        return (f"ampatch: float16 has no tensor cores on {where} ({info.basis[key]}): expect little or no "
                "speed-up over O0; O2/O3 still save memory. verbosity=0 silences this.")
    return None



def _cpu_flags_text(info: DeviceInfo) -> str:
    has = " ".join(info.features) or "none of note"
    return f"flags: {has}" + (f"; no {', '.join(info.lacks)}" if info.lacks else "")


def machine_line(info: DeviceInfo, dtypes: Iterable[str] = ()) -> str:
    """One line: device name, cores or capability, CPU flags, torch, and for each half dtype
    of `dtypes` whether it is native."""
    if info.type == "cpu":
        what = f"{info.name}, {info.cores} cores ({_cpu_flags_text(info)})"
    elif info.type == "cuda":
        what = f"{info.name} (compute capability {info.capability})"
    else:
        what = str(info.name or info.type)
    halves = []
    for n in dtypes:
        state = {True: "native", False: "not native", None: "native: unknown"}[info.native.get(n)]
        halves.append(f"{n} {state}" + (f" ({info.basis[n]})" if n in info.basis else ""))
    return f"{info.type}: {what}; torch {info.torch}" + (f"; {', '.join(halves)}" if halves else "")


def slow_half_note(info: DeviceInfo, dtypes: Iterable[str]) -> str | None:
    """The note under a comparison table when a half dtype it used is emulated on the device."""
    slow = [n for n in dtypes if info.native.get(n) is False]
    if not slow:
        return None
    what = " and ".join(slow)
    verb = "is" if len(slow) == 1 else "are"
    if info.type == "cpu":
        need = " / ".join(("AVX512-BF16 or AMX" if n == "bfloat16" else "AVX512-FP16 or AMX-FP16") for n in slow)
        return (f"note: {what} {verb} emulated on this CPU (no {need} instructions), so the half levels are "
                "expected to be slower than O0 here: their speed-up shows the cost of emulation, not what mixed "
                f"precision gives where {what} {verb} native (CPUs with those instructions, CUDA GPUs). The loss "
                "columns and the memory of O2/O3/O5 still hold. For speed on this machine, use O0.")
    basis = "; ".join(info.basis.get(n, "") for n in slow)
    return (f"note: {what} {verb} not native on {info.name} ({basis}), so the half levels are expected "
            "to be no faster than O0 here.")
