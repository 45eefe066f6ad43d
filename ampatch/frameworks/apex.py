"""Apex's names on the public API and on the optimizers, lent to the core by name.

Scripts written for Apex read `amp._amp_state`, call `amp.init(...)`, and read what Apex hung
on each optimizer it patched (`optimizer._amp_stash`, ...); `ampatch.compat` implements them.
compat sits above the public API (it imports it), so the core never imports compat: this
module registers each name with `session.addons`, and compat is loaded, by its module name,
the first time a script uses one of them (`import ampatch; ampatch._amp_state` works with
nothing else imported first).
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from ..session import addons
from ..session.session import current

__all__ = ["COMPAT", "OPTIMIZER_ATTRIBUTES"]

COMPAT = "ampatch.compat"  # Apex's face (above the public API: loaded by name, on first use)
# What Apex hung on each optimizer it patched (`ampatch.compat.amp.stash`); True: a method.
OPTIMIZER_ATTRIBUTES = {"_amp_stash": False, "_lazy_init_maybe_master_weights": True, "_amp_lazy_init": True,
                        "_master_params_to_model_params": True}


def _compat(module: str = "") -> ModuleType:
    return importlib.import_module(f"{COMPAT}.{module}" if module else COMPAT)


def _optimizer_attribute(name: str) -> Any:
    def make(handle: Any) -> Any:
        return _compat("amp.stash").ATTRIBUTES[name](handle)
    return make


def _register() -> None:
    addons.lend_module_attribute("_amp_state", lambda: _compat().AmpState(current))  # Apex's global state: a view
    addons.lend_module_attribute("init", lambda: _compat().init)  # Apex's older O1-only entry point
    addons.lend_fallback(lambda name: _compat().legacy_attribute(name))  # Apex amp names ampatch lacks: the hint
    for name, method in OPTIMIZER_ATTRIBUTES.items():
        addons.lend_optimizer_attribute(name, _optimizer_attribute(name), method)


_register()
