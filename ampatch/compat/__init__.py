"""Apex compatibility, apart from the core.

- `alias`: `install_apex_alias()` makes `from apex import amp` load ampatch (and `apex.parallel`,
  `apex.optimizers`, ... the adapters below); what ampatch does not provide fails to import
  with the PyTorch replacement in the message.
- `state`: `amp._amp_state`, a view of the live session with the attributes real scripts touch;
  its loss scalers are `scaler_view.LossScalerView`s, and `stash` gives each optimizer an amp
  session patches Apex's `_amp_stash` (registered when this package is imported).
- `handle`: `amp.init()`, Apex's older O1-only entry point, and its handle.
- one module per Apex package it stands in for, each a thin layer over PyTorch with Apex's
  names and keyword arguments: `parallel` (+ `larc`, `flat_dist`), `optimizers` (+ `adam`,
  `lamb`, `optim_base`, `fused_fp16_optimizer`), `normalization`, `fp16_utils` (+
  `fp16_optimizer`, `master_wrapper`, `loss_scalers`), `multi_tensor_apply`, and `testing`
  (what Apex's own tests import).
- Apex's compiled modules: `amp_c` (`amp_C`: the multi-tensor kernels of `kernels` and
  `optim_kernels`, on torch's foreach ops), `apex_c` (`apex_C`), `extensions`
  (`apex.extensions`).
"""
from __future__ import annotations

from typing import Any

from .alias import NotProvidedError, apex_alias_installed, install_apex_alias, uninstall_apex_alias
from .handle import Handle, OptimWrapper, init
from .state import AmpState
from . import stash

stash.install()

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
    """For `ampatch.__getattr__`: raise AttributeError, with the ampatch way when `name` is
    an Apex `amp` name that ampatch does not have."""
    hint = _LEGACY.get(name)
    if hint is None:
        raise AttributeError(f"module 'ampatch' has no attribute {name!r}")
    raise AttributeError(f"ampatch has no {name!r}: {hint}")
