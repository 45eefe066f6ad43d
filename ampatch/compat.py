"""A drop-in path for scripts written for NVIDIA Apex's `amp`.

`install_apex_alias()` makes `from apex import amp`, `import apex.amp as amp` and
`from apex.amp import scale_loss` load ampatch, for scripts that cannot be edited (the
`ampatch run --apex-alias` command calls it from a `sitecustomize`). It does nothing when a
real `apex` is importable: that one wins, and a warning says so.

Other Apex packages (`apex.parallel`, `apex.optimizers`, ...) are not provided; importing
one through the alias fails with the PyTorch replacement in the message. `legacy_attribute`
gives the same kind of message for Apex `amp` names that ampatch does not have (the old
`amp.init()` API, `_amp_state`).
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys
import types
import warnings
from typing import Any

logger = logging.getLogger("ampatch")

__all__ = ["install_apex_alias", "uninstall_apex_alias", "apex_alias_installed", "legacy_attribute"]

_ALIAS_FLAG = "__ampatch_alias__"

# Apex subpackages other than amp, and what replaces them in PyTorch.
_REPLACEMENTS = {
    "apex.parallel": "use torch.nn.parallel.DistributedDataParallel (wrap the model amp.initialize returns) "
                     "and torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)",
    "apex.optimizers": "use torch.optim (Adam/AdamW/SGD accept fused=True or foreach=True)",
    "apex.normalization": "use torch.nn.LayerNorm or torch.nn.RMSNorm",
    "apex.fp16_utils": "use amp.initialize(model, optimizer, opt_level='O2'): FP32 master weights and "
                       "loss scaling",
    "apex.multi_tensor_apply": "use torch._foreach_* ops, or let torch.optim's foreach=True do it",
}

# Apex `amp` names that ampatch has no object for, and what to write instead.
_LEGACY = {
    "init": "amp.init() is Apex's old API (amp_handle = amp.init(); amp_handle.wrap_optimizer(...)). "
            "Use `model, optimizer = amp.initialize(model, optimizer, opt_level='O1')` and "
            "`with amp.scale_loss(loss, optimizer) as scaled_loss: scaled_loss.backward()`.",
    "_amp_state": "amp._amp_state is Apex's internal state. Use amp.loss_scale(loss_id) for the current "
                  "loss scale, amp.master_params(optimizer) for the params the optimizer steps, "
                  "amp.state_dict() for the scaler state, amp.deinitialize() to undo the session.",
    "AmpHandle": "Apex's old handle API is not provided; use amp.initialize and amp.scale_loss.",
    "wrap_optimizer": "Apex's old handle API is not provided: pass the optimizer to amp.initialize.",
}


def legacy_attribute(name: str) -> Any:
    """For `ampatch.__getattr__`: raise AttributeError, with the ampatch way when `name` is
    an Apex `amp` name that ampatch does not provide."""
    hint = _LEGACY.get(name)
    if hint is None:
        raise AttributeError(f"module 'ampatch' has no attribute {name!r}")
    raise AttributeError(f"ampatch has no {name!r}: {hint}")


class _ApexFinder(importlib.abc.MetaPathFinder):
    """Answers `import apex.<anything but amp>` under the alias with a clear error."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        if not fullname.startswith("apex.") or fullname == "apex.amp":
            return None
        top = ".".join(fullname.split(".")[:2])
        if top == "apex.amp":
            hint = "Apex's amp internals are not provided; use the public amp API (see 'Coming from Apex' in the README)"
        else:
            hint = _REPLACEMENTS.get(top, "only apex.amp is provided (by ampatch)")
        raise ModuleNotFoundError(f"No module named {fullname!r}: 'apex' here is ampatch's alias for "
                                  f"apex.amp (ampatch.compat.install_apex_alias); {hint}.", name=fullname)


_finder = _ApexFinder()


def apex_alias_installed() -> bool:
    """Whether `apex` currently resolves to ampatch's alias."""
    return getattr(sys.modules.get("apex"), _ALIAS_FLAG, False) is True


def install_apex_alias() -> bool:
    """Make `import apex.amp` / `from apex import amp` load ampatch.

    Returns True when the alias is in place (idempotent), False when a real `apex` is
    importable: then nothing changes and a warning says that the real one will be used.
    """
    if apex_alias_installed():
        return True
    real = sys.modules.get("apex")  # already imported, so importable
    try:
        spec = importlib.util.find_spec("apex") if real is None else (real.__spec__ or True)
    except (ImportError, ValueError):  # a broken apex on the path: still not ours to shadow
        spec = True
    if spec is not None:
        where = getattr(spec, "origin", None) or getattr(real, "__file__", None) or "on sys.path"
        message = (f"ampatch: a real 'apex' package is importable ({where}); not aliasing apex.amp to "
                   "ampatch, so `from apex import amp` loads Apex. Uninstall apex, or import ampatch "
                   "directly (`import ampatch as amp`).")
        logger.warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        return False

    import ampatch

    apex = types.ModuleType("apex", "ampatch's alias for NVIDIA Apex: only apex.amp, which is ampatch.")
    apex.__path__ = []  # a package, so `import apex.amp` is a submodule import
    apex.amp = ampatch
    setattr(apex, _ALIAS_FLAG, True)
    sys.modules["apex"] = apex
    sys.modules["apex.amp"] = ampatch
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    logger.info("ampatch: `apex.amp` now loads ampatch")
    return True


def uninstall_apex_alias() -> bool:
    """Remove the alias; returns whether there was one. A real apex is never touched."""
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    if not apex_alias_installed():
        return False
    del sys.modules["apex"]
    if sys.modules.get("apex.amp") is sys.modules["ampatch"]:
        del sys.modules["apex.amp"]
    return True
