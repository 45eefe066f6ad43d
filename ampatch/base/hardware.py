"""Know the hardware: is the half dtype native (fast) on the models' device?

Mixed precision pays off only where the half dtype has a fast path: bfloat16 on CPUs with
AVX512-BF16 or AMX and on CUDA GPUs of compute capability 8.0+ (Ampere and later), float16
on GPUs with tensor cores (7.0+) and on CPUs with AVX512-FP16 or AMX-FP16. Elsewhere torch
emulates it, and every half level runs *slower* than FP32 (bfloat16 matmul measured 4-5x
slower than FP32 on an AVX-512 CPU without BF16; float16 on CPU is 75x slower and worse).

- `describe(device)`: what the device is and which half dtypes are native (cached: the
  detection reads /proc/cpuinfo or the CUDA device properties once per device).
- `check_half(models, properties, verbosity)`: used by `initialize`; logs once per process
  and device when the session's half dtype has no fast path there, with what to expect and
  what to do instead, and returns the JSON-ready dict `report()` carries as ``device``.
- `machine_line(device_dict)` and `slow_half_note(device_dict, dtypes)`: the lines
  `ampatch compare` prints above and under its table.
"""
from __future__ import annotations

import functools
import logging
import os
import platform
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

logger = logging.getLogger("ampatch")

__all__ = ["DeviceInfo", "describe", "model_device", "check_half", "half_advice", "machine_line",
           "slow_half_note"]

HALF_NAMES = ("bfloat16", "float16")
# CPU flags (as /proc/cpuinfo spells them) that decide the half-precision paths on x86 / Arm.
_X86_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
              "amx_fp16")
_ARM_FLAGS = ("asimd", "asimdhp", "fphp", "bf16", "sve", "sve2")


@dataclass(frozen=True)
class DeviceInfo:
    """One device, as far as mixed precision cares."""

    type: str                    # "cpu", "cuda", ...
    name: str                    # CPU model or GPU name
    cores: int | None            # logical CPUs (CPU) or streaming multiprocessors (CUDA)
    capability: str | None       # CUDA compute capability, e.g. "8.0"
    features: tuple[str, ...]    # the relevant flags this CPU has
    lacks: tuple[str, ...]       # the relevant flags it lacks (what a fast path would need)
    native: dict[str, bool | None]  # "bfloat16"/"float16" -> fast path? None: unknown
    basis: dict[str, str]        # why, per dtype, in a few words
    torch: str

    def is_native(self, dtype: torch.dtype | str | None) -> bool | None:
        """True/False for a half dtype on this device; None for FP32, None or unknown."""
        key = _name(dtype)
        return self.native.get(key) if key else None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["features"], d["lacks"] = list(self.features), list(self.lacks)
        return d


def _name(dtype: torch.dtype | str | None) -> str | None:
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.")
    return name if name in HALF_NAMES else None


def _cpuinfo() -> tuple[str, set[str]]:
    """Model name and flags of the first CPU in /proc/cpuinfo ("", {} where there is none)."""
    name, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model", "Hardware") and not name:
                    name = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
                elif not line.strip() and name and flags:
                    break  # the first processor's block is enough
    except OSError:
        pass
    return name, flags


def _torch_cpu_flag(fn: str) -> bool:
    check = getattr(torch.cpu, fn, None)
    try:
        return bool(check()) if check is not None else False
    except Exception:  # noqa: BLE001 - a private torch probe: absent or failing means "no"
        return False


def _describe_cpu() -> DeviceInfo:
    name, flags = _cpuinfo()
    name = name or platform.processor() or platform.machine() or "unknown CPU"
    arm = platform.machine().lower() in ("aarch64", "arm64")
    # torch's own probes (cpuinfo-based) agree with the kernels it dispatches to
    if _torch_cpu_flag("_is_avx512_bf16_supported"):
        flags.add("avx512_bf16")
    if _torch_cpu_flag("_is_amx_tile_supported"):
        flags.update(("amx_tile", "amx_bf16"))
    if _torch_cpu_flag("_is_amx_fp16_supported"):
        flags.add("amx_fp16")
    if _torch_cpu_flag("_is_avx512_supported"):
        flags.add("avx512f")
    if _torch_cpu_flag("_is_avx2_supported"):
        flags.add("avx2")
    relevant = _ARM_FLAGS if arm else _X86_FLAGS
    features = tuple(f for f in relevant if f in flags)
    if arm:
        known = bool(flags)  # macOS has no /proc/cpuinfo: unknown rather than "emulated"
        bf16 = ("bf16" in flags) if known else None
        fp16 = bool({"asimdhp", "fphp"} & flags) if known else None
        basis = {"bfloat16": "Arm BF16 extension" if bf16 else "no Arm BF16 extension",
                 "float16": "Arm FP16 arithmetic" if fp16 else "no Arm FP16 arithmetic"}
        lacks = tuple(f for f in ("bf16", "asimdhp") if f not in flags)
    else:
        bf16 = bool({"avx512_bf16", "amx_bf16"} & flags)
        fp16 = bool({"avx512_fp16", "amx_fp16"} & flags)
        basis = {"bfloat16": "AVX512-BF16/AMX" if bf16 else "no AVX512-BF16 or AMX",
                 "float16": "AVX512-FP16/AMX-FP16" if fp16 else "no AVX512-FP16 or AMX-FP16"}
        lacks = tuple(f for f in ("avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16") if f not in flags)
    native: dict[str, bool | None] = {"bfloat16": bf16, "float16": fp16}
    return DeviceInfo("cpu", name, os.cpu_count(), None, features, lacks, native, basis, torch.__version__)


def _describe_cuda(index: int) -> DeviceInfo:
    props = torch.cuda.get_device_properties(index)
    major, minor = props.major, props.minor
    if getattr(torch.version, "hip", None):  # ROCm: matrix cores take both on the GPUs it supports
        native = {"bfloat16": True, "float16": True}
        basis = {"bfloat16": "ROCm matrix cores", "float16": "ROCm matrix cores"}
    else:
        native = {"bfloat16": major >= 8, "float16": major >= 7}
        basis = {"bfloat16": "tensor cores (8.0+)" if major >= 8 else "bfloat16 tensor cores need compute capability 8.0+",
                 "float16": "tensor cores (7.0+)" if major >= 7 else "no tensor cores before compute capability 7.0"}
    return DeviceInfo("cuda", props.name, props.multi_processor_count, f"{major}.{minor}", (), (),
                      native, basis, torch.__version__)


@functools.lru_cache(maxsize=None)
def _describe(kind: str, index: int) -> DeviceInfo:
    if kind == "cpu":
        return _describe_cpu()
    if kind == "cuda":
        return _describe_cuda(index)
    return DeviceInfo(kind, kind, None, None, (), (), {"bfloat16": None, "float16": None},
                      {"bfloat16": "unknown device", "float16": "unknown device"}, torch.__version__)


def describe(device: torch.device | str = "cpu") -> DeviceInfo:
    """What `device` is and which half dtypes run natively there (detected once per device)."""
    device = torch.device(device)
    index = device.index
    if device.type == "cuda" and index is None:
        index = torch.cuda.current_device()
    return _describe(device.type, index or 0)


def model_device(models: Iterable[nn.Module]) -> torch.device:
    """The device of the first parameter (or buffer) of the models; CPU for empty models."""
    for m in models:
        for t in (*m.parameters(), *m.buffers()):
            return t.device
    return torch.device("cpu")


def half_advice(info: DeviceInfo, dtype: torch.dtype | str) -> str | None:
    """What to expect and what to do when `dtype` has no fast path on `info`; None when it has."""
    key = _name(dtype)
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


_logged: set[tuple[str, str, str]] = set()


def check_half(models: Iterable[nn.Module], properties: Any, verbosity: int = 1) -> dict[str, Any]:
    """The device dict for `report()`; logs `half_advice` once per process, device and dtype
    (a warning, at verbosity >= 1, for enabled sessions at a level that uses a half type)."""
    device = model_device(models)
    info = describe(device)
    uses_half = properties.enabled and properties.opt_level != "O0"
    half = _name(properties.half_dtype) if uses_half else None
    out = {**info.to_dict(), "half_dtype": half, "half_native": info.is_native(half)}
    out["summary"] = machine_line(out)
    if half and verbosity >= 1:
        key = (info.type, info.name, half)
        advice = half_advice(info, half)
        if advice and key not in _logged:
            _logged.add(key)
            logger.warning(advice)
    return out


def _cpu_flags_text(d: dict[str, Any]) -> str:
    has = " ".join(d.get("features") or []) or "none of note"
    lacks = d.get("lacks") or []
    return f"flags: {has}" + (f"; no {', '.join(lacks)}" if lacks else "")


def machine_line(d: dict[str, Any], dtypes: Iterable[str] | None = None) -> str:
    """One line: device name, cores or capability, CPU flags, torch, and for each half dtype
    (default: the session's) whether it is native. `d` is `DeviceInfo.to_dict()`-shaped."""
    if d.get("type") == "cpu":
        what = f"{d.get('name')}, {d.get('cores')} cores ({_cpu_flags_text(d)})"
    elif d.get("type") == "cuda":
        what = f"{d.get('name')} (compute capability {d.get('capability')})"
    else:
        what = str(d.get("name") or d.get("type"))
    names = list(dtypes) if dtypes is not None else [n for n in [d.get("half_dtype")] if n]
    native, basis = d.get("native") or {}, d.get("basis") or {}
    halves = []
    for n in names:
        state = {True: "native", False: "not native", None: "native: unknown"}[native.get(n)]
        halves.append(f"{n} {state}" + (f" ({basis[n]})" if n in basis else ""))
    return f"{d.get('type', '?')}: {what}; torch {d.get('torch')}" + (f"; {', '.join(halves)}" if halves else "")


def slow_half_note(d: dict[str, Any], dtypes: Iterable[str]) -> str | None:
    """The note under a comparison table when a half dtype it used is emulated on the device."""
    slow = [n for n in dtypes if (d.get("native") or {}).get(n) is False]
    if not slow:
        return None
    what = " and ".join(slow)
    verb = "is" if len(slow) == 1 else "are"
    if d.get("type") == "cpu":
        need = " / ".join(("AVX512-BF16 or AMX" if n == "bfloat16" else "AVX512-FP16 or AMX-FP16") for n in slow)
        return (f"note: {what} {verb} emulated on this CPU (no {need} instructions), so the half levels are "
                "expected to be slower than O0 here: their speed-up shows the cost of emulation, not what mixed "
                f"precision gives where {what} {verb} native (CPUs with those instructions, CUDA GPUs). The loss "
                "columns and the memory of O2/O3/O5 still hold. For speed on this machine, use O0.")
    basis = "; ".join((d.get("basis") or {}).get(n, "") for n in slow)
    return (f"note: {what} {verb} not native on {d.get('name')} ({basis}), so the half levels are expected "
            "to be no faster than O0 here.")
