"""What the rooms above the core add to it, registered by them; the core only asks.

The core names no other library: `ampatch.frameworks` registers here what the public API and
the session must honour of others (Apex's names, through `frameworks.apex`; the checks an
`initialize` call runs on what another library prepared, through `frameworks.hf_conventions`).
- `lend_module_attribute(name, make)`: `ampatch.<name>` is `make()`, made on first use and kept;
  `lend_fallback(attribute)` answers (or refuses, with a hint) any other unknown name.
- `lend_optimizer_attribute(name, make, method)`: each optimizer a session patches carries
  `name`, a lazy proxy of `make(handle)` (made on first use: its lender's code is loaded only
  by a script that reads it), taken off again when the session ends.
- `add_check(check)`: `check(models, optimizers)` runs in `prepare`, before anything changes.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import wrapt

__all__ = ["lend_module_attribute", "lend_fallback", "lend_optimizer_attribute", "add_check", "module_attribute",
           "optimizer_attributes", "run_checks"]

Check = Callable[[Sequence[Any], Sequence[Any]], None]

_module_makers: dict[str, Callable[[], Any]] = {}
_module_values: dict[str, Any] = {}
_fallbacks: list[Callable[[str], Any]] = []
_optimizer_makers: dict[str, tuple[Callable[[Any], Any], bool]] = {}
_checks: list[Check] = []


def lend_module_attribute(name: str, make: Callable[[], Any]) -> None:
    """`ampatch.<name>` is `make()`, made on first use and kept (the same object after)."""
    _module_makers[name] = make


def lend_fallback(attribute: Callable[[str], Any]) -> None:
    """`attribute(name)` answers a name nothing lends, or raises AttributeError (with a hint)."""
    if attribute not in _fallbacks:
        _fallbacks.append(attribute)


def lend_optimizer_attribute(name: str, make: Callable[[Any], Any], method: bool = False) -> None:
    """Each optimizer a session patches carries `name`: `make(handle)`, made on first use;
    `method`: the value is called (its proxy is then callable)."""
    _optimizer_makers[name] = (make, method)


def add_check(check: Check) -> None:
    """Run `check(models, optimizers)` on every `initialize` call before it changes anything
    (it raises to refuse the call)."""
    if check not in _checks:
        _checks.append(check)


def module_attribute(name: str) -> Any:
    """For `ampatch.__getattr__`: what a lender gives `ampatch.<name>`, else what a fallback
    answers, else AttributeError."""
    if name in _module_values:
        return _module_values[name]
    if name in _module_makers:
        value = _module_values[name] = _module_makers[name]()
        return value
    error = AttributeError(f"module 'ampatch' has no attribute {name!r}")
    for attribute in _fallbacks:
        try:
            return attribute(name)
        except AttributeError as exc:  # the last fallback's word (a hint) is the one raised
            error = exc
    raise error


def optimizer_attributes(handle: Any) -> dict[str, Any]:
    """The attributes for `handle`'s optimizer (the session's `attributes` callback), each a
    lazy proxy: nothing of its lender runs until a script uses it."""
    def lazy(make: Callable[[Any], Any], method: bool) -> Any:
        return wrapt.LazyObjectProxy(lambda: make(handle), **({"interface": Callable} if method else {}))
    return {name: lazy(make, method) for name, (make, method) in _optimizer_makers.items()}


def run_checks(models: Sequence[Any], optimizers: Sequence[Any]) -> None:
    """Every registered check on an `initialize` call's models and optimizers."""
    for check in _checks:
        check(models, optimizers)
