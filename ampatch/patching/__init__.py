"""The O1 mechanism: wrapt proxies that cast an op's arguments, and a registry that puts
every patched attribute back exactly as it was.

Policy (which op gets which kind of wrapper) lives in `ampatch.o1.lists`; what to patch and
when is `ampatch.o1.install`. Here, by job:

- `plans`: a kind and an op become a `CastPlan`, the one place each cast rule is decided;
- `wrappers`: the eager wrapper of a plan (the hot path, casts through the cast cache);
- `twins`: the plain-Python twin of a plan that `torch.compile` traces;
- `proxies`: the wrapt objects holding both, and `wrap`, which builds them;
- `switch`: whether casts run, per thread (`disable_casts`);
- `registry`: `Patcher`, which sets attributes and restores them.

Arguments are walked by `ampatch.base.tree.map_tensors`, as the model wrapper's are.
"""
from __future__ import annotations

from .plans import BANNED, BFLOAT16, CPU_FLOAT, FLOAT, HALF, PROMOTE, SEQUENCE_PROMOTE, Action, CastPlan, Kind, plan
from .proxies import CastFunctionWrapper, ModuleFunctionWrapper, wrap
from .registry import Patcher, resolve_owner
from .switch import cast_switch, disable_casts
from .twins import is_traced, traced
from .wrappers import WrapContext

__all__ = ["BANNED", "BFLOAT16", "CPU_FLOAT", "FLOAT", "HALF", "PROMOTE", "SEQUENCE_PROMOTE", "Action", "CastPlan",
           "Kind", "plan", "CastFunctionWrapper", "ModuleFunctionWrapper", "wrap", "Patcher", "resolve_owner",
           "disable_casts", "cast_switch", "is_traced", "traced", "WrapContext"]
