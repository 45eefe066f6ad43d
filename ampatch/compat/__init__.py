"""Apex compatibility, apart from the core, shaped like Apex itself: `apex.X.Y` is
`ampatch.compat.X.Y` (file `ampatch/compat/X/Y.py`), and `apex.amp` is ampatch.

- `alias`: `install_apex_alias()` makes `from apex import amp` load ampatch and every other
  `apex.X.Y` of Apex's `amp`, `optimizers`, `fp16_utils`, `parallel`, `normalization`,
  `multi_tensor_apply` packages the module here, by that rule; `missing` says what ampatch
  does not provide (`apex.contrib`, ...) and what replaces it.
- `amp/`: Apex's amp modules (`_amp_state`, `handle`, `opt`, `amp`, `frontend`, `scaler`,
  `lists/`, `utils`, `wrap`, ...); `amp.stash` gives each optimizer a session patches
  Apex's `_amp_stash`. The core never imports this package: `ampatch.frameworks.apex` lends
  `amp._amp_state`, `amp.init`, the hints of `legacy_attribute` and the optimizers'
  attributes to it by name, and loads this package when a script first uses one.
- `optimizers/`, `fp16_utils/`, `parallel/`, `normalization/`, `multi_tensor_apply/`: thin
  layers over PyTorch with Apex's names and keyword arguments, one module per Apex module.
- `extensions/`: the one place of Apex's compiled modules, `amp_C` (the multi-tensor kernels
  of `kernels` and `optim_kernels`, on torch's foreach ops) and `apex_C`.
- `testing/`: what Apex's own tests import.
"""
from __future__ import annotations

import sys
from typing import Any

from .alias import apex_alias_installed, install_apex_alias, uninstall_apex_alias
from .amp._amp_state import AmpState
from .amp.amp import init
from .amp.handle import Handle
from .amp.opt import OptimWrapper
from .missing import NotProvidedError

__all__ = ["install_apex_alias", "uninstall_apex_alias", "apex_alias_installed", "legacy_attribute",
           "AmpState", "Handle", "OptimWrapper", "init", "NotProvidedError"]

# Names of Apex's amp internals that scripts reach for, and the ampatch way.
_LEGACY = {
    "AmpHandle": "Apex's handle class is not public here; amp.init() returns a handle, and "
                 "amp._amp_state.handle is the live session's.",
    "wrap_optimizer": "wrap_optimizer is a method of the handle: amp.init().wrap_optimizer(optimizer), or pass "
                      "the optimizer to amp.initialize.",
    "LossScaler": "loss scalers belong to the session: amp._amp_state.loss_scalers[i] (amp.loss_scale(i) for "
                  "the value), configured through amp.initialize(loss_scale=..., min_loss_scale=..., ...).",
    "opt_properties": "it is an attribute of amp._amp_state: amp._amp_state.opt_properties.",
    "loss_scalers": "it is an attribute of amp._amp_state: amp._amp_state.loss_scalers.",
}


def legacy_attribute(name: str) -> Any:
    """For `ampatch.__getattr__`: under the alias, Apex's amp submodule `name` (`from apex.amp
    import lists` reads an attribute of ampatch, which is `apex.amp`); otherwise raise
    AttributeError, with the ampatch way when `name` is an Apex `amp` name ampatch does not have."""
    if apex_alias_installed() and not name.startswith("__"):
        module = sys.modules.get(f"apex.amp.{name}")
        if module is not None:
            return module
    hint = _LEGACY.get(name)
    if hint is None:
        raise AttributeError(f"module 'ampatch' has no attribute {name!r}")
    raise AttributeError(f"ampatch has no {name!r}: {hint}")
