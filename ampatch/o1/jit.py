"""TorchScript under O1/O4: `torch.jit.script` and `torch.jit.trace` while torch is patched.

- Scripting resolves each torch function a scripted body calls. A patched function is a
  Python object TorchScript does not know, so it would compile a call back into Python:
  the scripted code would keep casting after `deinitialize`, and TorchScript caches the
  compiled types of `nn` modules for the whole process. Each patch is registered with
  TorchScript as the builtin op of its original, so scripted code calls the op itself:
  it runs without O1 casts (in FP32, as it would without ampatch), it can be saved, and
  nothing of the session stays in it. Scripting under O1 logs that once per session.
  (`torch.compile` keeps the casts: see `ampatch.o1.dynamo`.)
- Tracing records the ops that run, casts included, but a cast served from the cache
  was made outside the trace, and TorchScript refuses it as a constant ("Cannot insert a
  Tensor that requires grad as a constant"). `torch.jit.trace` and `trace_module` clear
  the cache before and after, so every cast of a traced call is made inside it: the traced
  module records the mixed-precision forward, as tracing under `torch.autocast` does.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
import wrapt

from ..base.patcher import Patcher
from .cache import ParamCastCache

logger = logging.getLogger("ampatch")


def install(patcher: Patcher, cache: ParamCastCache) -> None:
    """Register the session's patches with TorchScript and wrap the tracing entry points."""
    from torch.jit import _builtins

    table = _builtins._get_builtin_table()
    registered = []
    for _owner, _name, original, replacement in patcher.patched():
        op = table.get(id(original))
        if op is not None and id(replacement) not in table:
            table[id(replacement)] = op
            registered.append(id(replacement))

    def unregister() -> None:
        for key in registered:
            table.pop(key, None)

    patcher.on_restore(unregister)

    warned: list[bool] = []

    def script(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        if not warned:
            warned.append(True)
            logger.warning("ampatch: torch.jit.script under O1: scripted code calls torch's ops directly and "
                           "runs without O1 casts (in FP32). torch.compile keeps them; so does tracing.")
        return wrapped(*args, **kwargs)

    def trace(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        cache.clear()  # every cast the trace sees is made inside it
        try:
            return wrapped(*args, **kwargs)
        finally:
            cache.clear()  # and none made inside it is served afterwards

    patcher.patch(torch.jit, "script", wrapt.FunctionWrapper(torch.jit.script, script))
    for name in ("trace", "trace_module"):
        patcher.patch(torch.jit, name, wrapt.FunctionWrapper(getattr(torch.jit, name), trace))
