"""The wrapt proxies set on torch: each holds an eager wrapper (`wrappers`) and its
`torch.compile` twin (`twins`), built from one `CastPlan`; `wrap` makes them.

Dynamo takes a wrapt proxy of a torch builtin for that builtin (the proxy compares and
hashes equal to it), so it would capture the original op and no cast. An object that
carries `_torchdynamo_inline` is instead traced through that attribute (the convention
`torch.jit.script` and `torch.compile` wrappers use): here, the twin while casts are on in
the tracing thread, or the original op while they are off. Dynamo guards on the attribute,
so a compiled graph is reused only under the same choice (a call inside `disable_casts()`,
or after `deinitialize`, recompiles without the casts).

wrapt labels how a wrapper binds when it is looked up on an object. A module's Python
function and a class's instance method get the label wrapt gives C functions, "builtin":
it never binds, and its calls skip a per-call `__self__` lookup that fails (an
AttributeError raised and cleared per call, about half of wrapt's cost). wrapt has no
public way to choose the label, so `_init_builtin` calls the constructor that
`wrapt.FunctionWrapper` itself calls with it, and `check_builtin_binding` (run at import)
fails loudly if an installed wrapt no longer behaves that way.
"""
from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from typing import Any

import wrapt

from .plans import plan
from ..base.patcher import cast_switch
from .twins import make_traceable
from .wrappers import WrapContext, make_wrapper, with_dtype_hint


class CastFunctionWrapper(wrapt.FunctionWrapper):
    """A `wrapt.FunctionWrapper` whose calls `torch.compile` traces through `traceable`
    (the plain-Python twin) while casts are on, and through the original op while off."""

    def __init__(self, wrapped: Any, wrapper: Callable, traceable: Callable | None = None) -> None:
        super(CastFunctionWrapper, self).__init__(wrapped, wrapper)  # explicit: proxies override __class__
        self._self_traceable = traceable

    @property
    def _torchdynamo_inline(self) -> Any:
        if cast_switch.enabled and self._self_traceable is not None:
            return self._self_traceable
        return self.__wrapped__


def _init_builtin(proxy: CastFunctionWrapper, wrapped: Any, wrapper: Callable, traceable: Callable | None) -> None:
    """Initialise `proxy` as wrapt initialises a wrapper of a C function (see the module doc)."""
    super(wrapt.FunctionWrapper, proxy).__init__(wrapped, None, wrapper, None, "builtin")
    proxy._self_traceable = traceable


class ModuleFunctionWrapper(CastFunctionWrapper):
    """A `CastFunctionWrapper` for a plain Python function that is a module attribute: a
    module attribute is never bound, so the "builtin" binding behaves the same, faster."""

    def __init__(self, wrapped: Any, wrapper: Callable, traceable: Callable | None = None) -> None:
        _init_builtin(self, wrapped, wrapper, traceable)


class MethodWrapper(CastFunctionWrapper):
    """A `CastFunctionWrapper` for an instance method of a class (`torch.Tensor.softmax`).

    wrapt binds on every attribute access (`x.softmax` builds a bound method and a
    BoundFunctionWrapper); here the wrapper has the "builtin" binding and `__get__` returns a
    plain bound method of the wrapper, so `x.softmax(-1)` calls the wrapper with `instance`
    None and `x` as the first argument, exactly how the unbound original takes it (and how
    `torch.Tensor.softmax(x, -1)` calls it). Only for plain functions and method descriptors
    found in the class itself or its bases: never for static or class methods.
    """

    def __init__(self, wrapped: Any, wrapper: Callable, traceable: Callable | None = None) -> None:
        _init_builtin(self, wrapped, wrapper, traceable)

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None:
            return self
        return types.MethodType(self, instance)


def check_builtin_binding(*classes: type[CastFunctionWrapper]) -> None:
    """Raise ImportError unless each class (by default the two above) builds a wrapper with
    wrapt's "builtin" binding that passes its calls to the wrapper function unbound."""
    def probe(a: Any, k: Any = None) -> Any:
        return a, k

    def record(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        return wrapped, instance, args, kwargs

    for cls in classes or (ModuleFunctionWrapper, MethodWrapper):
        try:
            proxy = cls(probe, record)
            seen = (proxy._self_binding, proxy(1, k=2))
        except TypeError as exc:
            seen = exc
        if seen != ("builtin", (probe, None, (1,), {"k": 2})):
            raise ImportError(
                f"ampatch: wrapt {wrapt.__version__} no longer builds a wrapper with the \"builtin\" binding the "
                f"way ampatch.o1.proxies relies on ({cls.__name__} gave {seen!r}). Install a wrapt release "
                "this ampatch supports (pip install 'wrapt>=2.0,<3'), or report the wrapt version.")


check_builtin_binding()


def wrap(kind: str, op: str, original: Any, ctx: WrapContext, banned_message: str = "",
         owner: Any = None, hint_name: str | None = None) -> CastFunctionWrapper:
    """The proxy of the `kind` wrapper around `original` (keeps its name, docs and identity
    checks), with its twin; both are built from one plan.

    `owner` is where it will be set (as attribute `op`): a Python function in a module, or an
    instance method of a class, gets a proxy that skips wrapt's per-call binding work.
    `hint_name` adds the registration hint to dtype errors (user functions)."""
    p = plan(kind, op, ctx.half_dtype, ctx.allow_banned, banned_message)
    wrapper = make_wrapper(p, original, ctx)
    if hint_name is not None:
        wrapper = with_dtype_hint(wrapper, hint_name)
    cls: type[CastFunctionWrapper] = CastFunctionWrapper
    if isinstance(owner, types.ModuleType) and inspect.isfunction(original):
        cls = ModuleFunctionWrapper
    elif isinstance(owner, type):
        try:
            raw = inspect.getattr_static(owner, op)
        except AttributeError:
            raw = None
        if raw is original and (inspect.isfunction(raw) or inspect.ismethoddescriptor(raw)) \
                and not isinstance(raw, (staticmethod, classmethod)):
            cls = MethodWrapper
    return cls(original, wrapper, make_traceable(p, original))
