"""Know the hardware: is the half dtype native (fast) on the models' device?

Mixed precision pays off only where the half dtype has a fast path: bfloat16 on CPUs with
AVX512-BF16 or AMX and on CUDA GPUs of compute capability 8.0+ (Ampere and later), float16
on GPUs with tensor cores (7.0+) and on CPUs with AVX512-FP16 or AMX-FP16. Elsewhere torch
emulates it, and every half level runs *slower* than FP32 (bfloat16 matmul measured 4-5x
slower than FP32 on an AVX-512 CPU without BF16; float16 on CPU is 75x slower and worse).

- `describe(device)` -> `DeviceInfo`: what the device is and which half dtypes are native
  (cached: the detection reads /proc/cpuinfo or the CUDA device properties once per device);
- `SessionDevice`: that, with the half dtype a session runs in (what `report()` carries as
  ``device``, and what crosses to the `ampatch` command in a run's report);
- `Machine`: what a policy's speed depends on (`DeviceInfo.machine()`, in policy files);
- `check_half(models, half_dtype, verbosity)`: used by `initialize`; logs once per process
  and device when the session's half dtype has no fast path there (`device_text.half_advice`).

The other advice `initialize` gives about the models on this hardware:
- `dims_not_multiple_of_8(models)`: Linear and convolution layers whose feature or channel
  counts are not multiples of 8, which half-precision matmul units (Tensor Cores) prefer;
  `log_dims_tip` logs that list once.
- `eps_lost_in_float16(optimizers)`: optimizer groups that step float16 parameters in
  float16 with an `eps` that float16 rounds to 0 (Adam's 1e-8): every weight whose
  gradient is 0 becomes 0/0 = NaN at the first step (`eps_lost_warning`).

The wording for people (advice, the machine line, the note under a table) is `device_text`.
"""
from __future__ import annotations

import functools
import itertools
import logging
import os
import platform
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from ..base.dtypes import HALF_NAMES, half_key
from ..base.notices import warn
from ..errors import ConfigError, reason
from .device_text import half_advice, machine_line

__all__ = ["DeviceInfo", "SessionDevice", "Machine", "describe", "model_device", "check_half", "dims_not_multiple_of_8",
           "log_dims_tip", "eps_lost_in_float16", "eps_lost_warning"]

logger = logging.getLogger("ampatch")

# CPU flags (as /proc/cpuinfo spells them) that decide the half-precision paths on x86 / Arm.
_X86_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
              "amx_fp16")
_ARM_FLAGS = ("asimd", "asimdhp", "fphp", "bf16", "sve", "sve2")

Dtype = torch.dtype  # for annotations inside DeviceInfo, whose field `torch` hides the module there


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

    def is_native(self, dtype: Dtype | str | None) -> bool | None:
        """True/False for a half dtype on this device; None for FP32, None or unknown."""
        key = half_key(dtype)
        return self.native.get(key) if key else None

    def machine(self) -> "Machine":
        """What a policy measured here depends on."""
        return Machine(self.type, self.name, dict(self.native))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["features"], d["lacks"] = list(self.features), list(self.lacks)
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "DeviceInfo":
        """`to_dict`'s JSON read back; a missing or mistyped field raises ValueError naming it."""
        try:
            return cls(str(data["type"]), str(data["name"]), _opt_int(data.get("cores")),
                       None if data.get("capability") is None else str(data["capability"]),
                       tuple(data.get("features") or ()), tuple(data.get("lacks") or ()),
                       {k: _opt_bool(v) for k, v in dict(data.get("native") or {}).items()},
                       {k: str(v) for k, v in dict(data.get("basis") or {}).items()}, str(data.get("torch", "")))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"a device description needs type and name ({reason(exc)})") from None


def _opt_int(value: Any) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"not a count: {value!r}")
    return value


def _opt_bool(value: Any) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise ConfigError(f"not true/false/null: {value!r}")
    return value


@dataclass(frozen=True)
class Machine:
    """What a precision policy's speed depends on: the device type and name, and which half
    dtypes are native there (a policy file's ``measured.machine``)."""

    type: str
    name: str
    native: dict[str, bool | None]

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "name": self.name, "native": dict(self.native)}

    @classmethod
    def from_dict(cls, data: Any) -> "Machine | None":
        """A policy's ``machine`` read back; None when it has none (written by hand)."""
        if not isinstance(data, Mapping) or not data.get("type"):
            return None
        native = data.get("native")
        return cls(str(data["type"]), str(data.get("name") or ""),
                   dict(native) if isinstance(native, Mapping) else {})


@dataclass(frozen=True)
class SessionDevice:
    """The device a session's models are on and the half dtype it runs in there (None at O0
    or when disabled): `report()`'s ``device``."""

    info: DeviceInfo
    half_dtype: str | None = None

    @property
    def half_native(self) -> bool | None:
        return self.info.is_native(self.half_dtype)

    def to_dict(self) -> dict[str, Any]:
        """The JSON of a report: the device's fields, the half dtype, whether it is native."""
        return {**self.info.to_dict(), "half_dtype": self.half_dtype, "half_native": self.half_native,
                "summary": machine_line(self.info, [self.half_dtype] if self.half_dtype else [])}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SessionDevice":
        half = data.get("half_dtype")
        if half is not None and half not in HALF_NAMES:
            raise ConfigError(f"half_dtype {half!r} is not one of {', '.join(HALF_NAMES)}")
        return cls(DeviceInfo.from_dict(data), half)


def _cpuinfo() -> tuple[str, set[str]]:
    """Model name and flags of the first CPU in /proc/cpuinfo ("", {} where there is none)."""
    name, flags = "", set[str]()
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
    native: dict[str, bool | None]
    if getattr(torch.version, "hip", None):  # ROCm: matrix cores take both on the GPUs it supports
        native = {"bfloat16": True, "float16": True}
        basis = {"bfloat16": "ROCm matrix cores", "float16": "ROCm matrix cores"}
    else:
        native = {"bfloat16": major >= 8, "float16": major >= 7}
        basis = {"bfloat16": ("tensor cores (8.0+)" if major >= 8
                              else "bfloat16 tensor cores need compute capability 8.0+"),
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


_logged: set[tuple[str, str, str]] = set()


def check_half(models: Iterable[nn.Module], half_dtype: torch.dtype | None, verbosity: int = 1) -> SessionDevice:
    """The device of `models` and the session's half dtype there (`half_dtype`: None where the
    session runs nothing in half: O0, or disabled); warns with `device_text.half_advice` once per
    process, device and dtype (at verbosity >= 1) when it has no fast path there: logged and
    raised as a Python warning at the user's line (`notices.warn`), so that a script without a
    logging configuration sees it too (float16 on a CPU without it: an epoch of 1.5 s takes 120)."""
    info = describe(model_device(models))
    half = half_key(half_dtype)
    key = (info.type, info.name, half or "")
    if half and verbosity >= 1 and info.is_native(half) is False and key not in _logged:  # advice only then
        advice = half_advice(info, half)
        if advice:
            _logged.add(key)
            warn(advice, verbosity)
    return SessionDevice(info, half)


def fingerprint(device: str = "cpu") -> Machine:
    """What a policy's speed depends on, on `device`: its type and name, and which half dtypes
    are native there (written as a policy file's ``measured.machine``)."""
    return describe(device).machine()


def policy_warning(measured: Mapping[str, Any] | None, half: str | None, here: Machine | None = None) -> str | None:
    """Why a policy measured as `measured` (its ``measured`` field) in `half` (the half dtype's
    name; None at O0) may not keep its speed on this machine (`here`: its `fingerprint`,
    default: of the device type the policy was measured on), or None."""
    there = Machine.from_dict((measured or {}).get("machine"))
    if there is None:
        return None
    if here is None:
        if there.type == "cuda" and not torch.cuda.is_available():
            return (f"the policy was measured on {there.name or 'a CUDA GPU'}; this machine has no CUDA: "
                    "its speed-up will not hold here (run `ampatch tune` here).")
        here = fingerprint("cuda" if there.type == "cuda" else "cpu")
    if here.type != there.type:
        return (f"the policy was measured on {there.type}, this run is on {here.type}: its speed-up "
                "will not hold here (run `ampatch tune` here).")
    native_there = there.native.get(half) if half else None
    native_here = here.native.get(half) if half else None
    if half and native_there is not None and native_here is not None and native_there != native_here:
        how = {True: "native", False: "emulated"}
        return (f"the policy was measured on {there.name}, where {half} is {how[native_there]}; here "
                f"({here.name}) it is {how[native_here]}: its speed-up will not hold here (run "
                "`ampatch tune` here).")
    return None


_MULTIPLE = 8


def _as_models(models: Any) -> list[nn.Module]:
    return list(models) if isinstance(models, (list, tuple)) else [models]


def _uninitialized(module: nn.Module) -> bool:
    """Whether `module` is a lazy layer still waiting for its first input (its own parameters or
    buffers are uninitialized): what `LazyModuleMixin.has_uninitialized_params` asks, without its
    protocol-typed `self` that a plain module does not satisfy for mypy."""
    own = itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False))
    return isinstance(module, nn.modules.lazy.LazyModuleMixin) and any(is_lazy(t) for t in own)


def dims_not_multiple_of_8(models: nn.Module | Iterable[nn.Module]) -> list[str]:
    """One line per Linear/Conv layer with an in/out feature or channel count that is not a
    multiple of 8, e.g. ``"fc (Linear): in_features=30"``; names are prefixed ``model1.``
    and so on when several models are given. Uninitialized lazy layers are skipped."""
    models = _as_models(models)
    out = []
    for i, model in enumerate(models):
        prefix = f"model{i}." if len(models) > 1 else ""
        for name, m in model.named_modules():
            if isinstance(m, nn.Linear):
                dims = (("in_features", m.in_features), ("out_features", m.out_features))
            elif isinstance(m, nn.modules.conv._ConvNd):
                dims = (("in_channels", m.in_channels), ("out_channels", m.out_channels))
            else:
                continue
            if _uninitialized(m):
                continue
            bad = [f"{k}={v}" for k, v in dims if v % _MULTIPLE]
            if bad:
                out.append(f"{prefix}{name or '<model>'} ({type(m).__name__}): {', '.join(bad)}")
    return out


_dims_logged: set[tuple[str, ...]] = set()  # the layer lists log_dims_tip logged


def log_dims_tip(models: nn.Module | Iterable[nn.Module], verbosity: int = 1, limit: int = 10) -> list[str]:
    """Log (info, once per process for a given list) the layers `dims_not_multiple_of_8`
    finds; nothing at verbosity 0 (the session asks only at the levels that run in half).
    Returns what it found."""
    if verbosity < 1:
        return []
    found = dims_not_multiple_of_8(models)
    key = tuple(found)
    if found and key not in _dims_logged:
        _dims_logged.add(key)
        more = f"; and {len(found) - limit} more" if len(found) > limit else ""
        logger.info("ampatch: tip: half-precision matmul units are fastest when feature and channel counts "
                    "are multiples of 8; these layers are not (pad or resize them where you can; an input "
                    "layer with 3 colour channels is expected): %s%s", "; ".join(found[:limit]), more)
    return found


def eps_lost_in_float16(optimizers: Iterable[torch.optim.Optimizer]) -> list[str]:
    """One line per optimizer param group that holds float16 parameters (stepped in float16:
    no FP32 master weights, as at O3) and an `eps` that is 0 in float16, unless the group is
    `fused` (a fused kernel adds eps in FP32). torch's Adam, AdamW, RMSprop, Adagrad, ...
    then divide by sqrt(0) + 0 for any weight whose gradient is 0, and the weights turn NaN
    at the first step (plain `model.half()` training does the same)."""
    out = []
    for i, opt in enumerate(optimizers):
        for j, group in enumerate(opt.param_groups):
            eps = group.get("eps")
            if (not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps > 0
                    or torch.tensor(eps, dtype=torch.float16).item() != 0 or group.get("fused")):
                continue
            if any(isinstance(p, torch.Tensor) and p.dtype == torch.float16 for p in group["params"]):
                out.append(f"optimizers[{i}] ({type(opt).__name__}) param group {j}: eps={eps:g}")
    return out


def eps_lost_warning(lost: Iterable[str], opt_level: str) -> str:
    """The warning `initialize` gives for the groups `eps_lost_in_float16` found."""
    return (f"ampatch: {'; '.join(lost)}: float16 rounds that eps to 0, and at {opt_level} these float16 "
            "parameters are stepped in float16 (no FP32 master weights), so every weight whose gradient is 0 "
            "(an embedding row missing from the batch) becomes 0/0 = NaN at the first step. Use O2 (FP32 master "
            "weights), bfloat16, or an eps float16 can hold (1e-4 is usual for float16 Adam).")
