"""Calling a user's optimizer as it declares itself.

Optimizers outside torch declare their methods their own way: Apex's Fused* and DeepSpeed's
FusedAdam have `zero_grad(self)` with no `set_to_none`, Apex-era ones
`step(closure=None, grads=None, output_params=None, scale=None, grad_norms=None)`. ampatch
forwards a user's call exactly as it was made (an argument the method cannot take raises
the method's own error: nothing is dropped), reads what it needs from it by the method's own
signature (`argument`), and, where it calls on its own behalf, passes only what the method
takes (`zero_grad`).
"""
from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["signature", "declare_as", "argument", "first_argument", "set_to_none", "closure", "takes", "zero_grad",
           "forwarding_method"]

_MISSING = object()  # "no such argument in the call"
# a function (a bound method's __func__: the same for every instance) -> its signature
_SIGNATURES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def signature(fn: Callable) -> inspect.Signature | None:
    """The signature a call of `fn` must fit (None: unknown, a builtin). It follows
    `__wrapped__`; a wrapper set on the instance over a method of its class (torch's LR
    schedulers wrap `optimizer.step` so) reports that method's unbound signature, `self`
    included, which the call does not pass: it is left out. Read once per function (every
    step and zero_grad asks): kept while the function lives."""
    key = fn.__func__ if inspect.ismethod(fn) else fn
    try:
        return _SIGNATURES[key]
    except (KeyError, TypeError):  # not read yet, or not weakly referable
        pass
    sig = _read_signature(fn)
    try:
        _SIGNATURES[key] = sig
    except TypeError:
        pass
    return sig


def _read_signature(fn: Callable) -> inspect.Signature | None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    if not inspect.ismethod(fn):
        target = inspect.unwrap(fn)
        first = next(iter(sig.parameters.values()), None)
        if (target is not fn and inspect.isfunction(target) and "." in target.__qualname__
                and first is not None and first.name == "self"):
            sig = sig.replace(parameters=list(sig.parameters.values())[1:])
    return sig


def declare_as(method: Callable, inner: Callable) -> None:
    """Give `method`, a function whose first parameter is the optimizer (a patched method before
    it is bound), the signature of the bound method `inner` it calls, so that the patched
    method declares what the optimizer's own does."""
    sig = signature(inner)
    if sig is None:
        return
    own = "self"
    while own in sig.parameters:  # a wrapper's own signature may name one `self` already
        own = "_" + own
    method.__signature__ = sig.replace(  # type: ignore[attr-defined]
        parameters=[inspect.Parameter(own, inspect.Parameter.POSITIONAL_ONLY), *sig.parameters.values()])


def argument(fn: Callable, args: tuple, kwargs: dict, name: str, default: Any = None) -> Any:
    """What the call `fn(*args, **kwargs)` gives `fn`'s parameter `name` (its declared default
    when the call leaves it out); `default` where `fn` has no such parameter, or where the
    call does not fit `fn`'s signature (calling `fn` raises its own error then)."""
    sig = signature(fn)
    if sig is None or name not in sig.parameters:
        return kwargs.get(name, default)
    if not args and not kwargs:  # the usual call, `step()`, `zero_grad()`: the declared default
        declared = sig.parameters[name].default
        return default if declared is inspect.Parameter.empty else declared
    if not args and name in kwargs and sig.parameters[name].kind is not inspect.Parameter.POSITIONAL_ONLY and all(
            k in sig.parameters for k in kwargs):  # `zero_grad(set_to_none=False)`: no binding needed
        return kwargs[name]
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError:
        return default
    bound.apply_defaults()
    return bound.arguments.get(name, default)


def first_argument(fn: Callable, args: tuple, kwargs: dict, name: str) -> tuple[Any, Callable[[Any], Any]]:
    """The call's first argument (positional, or by keyword under `fn`'s own name for its first
    parameter, else `name`) and a function that calls `fn` with a value in its place and the
    rest of the call as it was. A call with no first argument gives None, and the function
    then calls `fn` as it was called (which raises `fn`'s own error)."""
    if args:
        rest = args[1:]
        return args[0], lambda value: fn(value, *rest, **kwargs)
    sig = signature(fn)
    first = next(iter(sig.parameters.values()), None) if sig is not None else None
    key = first.name if first is not None and first.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                             inspect.Parameter.KEYWORD_ONLY) else name
    if key not in kwargs:
        return None, lambda value: fn(*args, **kwargs)
    rest_kw = {k: v for k, v in kwargs.items() if k != key}
    return kwargs[key], lambda value: fn(value, **rest_kw)


def set_to_none(fn: Callable, args: tuple, kwargs: dict) -> bool:
    """Whether the call `zero_grad(*args, **kwargs)` sets grads to None: False only where the
    call (or zero_grad's declared default) says False; True for a zero_grad that takes no
    `set_to_none` (torch's default), and for None (the optimizer's own default, e.g. Apex's
    `set_grad_none`)."""
    if signature(fn) is None:  # a builtin: torch's convention, set_to_none first
        value = args[0] if args else kwargs.get("set_to_none", True)
    else:
        value = argument(fn, args, kwargs, "set_to_none", True)
    return value is not False


def closure(fn: Callable, args: tuple, kwargs: dict) -> Callable | None:
    """The closure in the call `step(*args, **kwargs)`: the argument of step's `closure`
    parameter (an Apex-era `step(None, grads)` has none); for a step without one, a callable
    first argument."""
    value = argument(fn, args, kwargs, "closure", _MISSING)
    if value is _MISSING:
        value = args[0] if args and callable(args[0]) else kwargs.get("closure")
    return value if callable(value) else None


def takes(fn: Callable, name: str) -> bool:
    """Whether `fn` takes an argument `name` (a parameter of that name, or **kwargs); True
    where its signature is unknown."""
    sig = signature(fn)
    if sig is None:
        return True
    return name in sig.parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())


def zero_grad(optimizer: Any, set_to_none: bool, params: Iterable[torch.Tensor]) -> None:
    """`optimizer.zero_grad(set_to_none=...)` on ampatch's behalf (Apex's FP16_Optimizer
    wrappers): passed where zero_grad takes it; to a zero_grad that does not (Apex's Fused*,
    DeepSpeed's FusedAdam), nothing is passed, and `params`' grads are then set to None, or
    (`set_to_none=False`) the grad tensors they held are zeroed in place and kept."""
    method = optimizer.zero_grad
    if takes(method, "set_to_none"):
        method(set_to_none=set_to_none)
        return
    params = list(params)
    held = [] if set_to_none else [(p, p.grad) for p in params if p.grad is not None]
    method()
    with torch.no_grad():
        for p in params:
            p.grad = None
        for p, g in held:
            g.detach_()
            g.zero_()
            p.grad = g


def forwarding_method(func: Callable, inner: Callable, name: str, cls: type) -> Callable:
    """A plain function (so LR schedulers can take `step.__func__`) calling func(inner, ...),
    with `inner`'s signature (what this module reads: the patched method declares what the
    optimizer's own does)."""
    def method(_optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        return func(inner, *args, **kwargs)

    method.__name__ = name
    method.__qualname__ = f"{cls.__name__}.{name}"
    method.__doc__ = getattr(inner, "__doc__", None)
    declare_as(method, inner)
    return method
