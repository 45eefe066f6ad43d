"""What O1 sets on torch: each op's generated function (`wrappers.make_function`), carrying
its `torch.compile` twin (`twins`) behind a wrapt proxy; `wrap` makes both from one plan.

The function is a plain Python function: called from Python it costs one frame, and on a
class it binds like any method (`x.softmax(-1)` reaches it with `x` first, as the unbound
original takes it). It keeps the original's name, docs, module and `__wrapped__`.

Dynamo traces an object that carries `_torchdynamo_inline` through that attribute (the
convention `torch.jit.script` and `torch.compile` wrappers use). The function's attribute is
a `TwinProxy`: a wrapt proxy of the original op whose own `_torchdynamo_inline` is a
property that gives the twin while casts are on in the tracing thread, or the original op
while they are off. Dynamo guards on what it read, so a compiled graph is reused only under
the same choice (a call inside `disable_casts()`, or after `deinitialize`, recompiles without
the casts). wrapt earns its place here: Dynamo takes an object for a function only if it
looks like one (`isinstance(obj, types.FunctionType)`, which a wrapt proxy answers as its
wrapped op does), and only a proxy's class can hold the per-thread property. It is never on
the eager path. (The RNN modules' forward is such a proxy too, `ModuleTwinProxy`.)

wrapt labels how a wrapper binds when it is looked up on an object. A module's Python
function gets the label wrapt gives C functions, "builtin": it never binds, and its calls
skip a per-call `__self__` lookup that fails. wrapt has no public way to choose the label,
so `_init_builtin` calls the constructor that `wrapt.FunctionWrapper` itself calls with it,
and `check_builtin_binding` (run at import) fails loudly if an installed wrapt no longer
behaves that way.
"""
from __future__ import annotations

import importlib.metadata
import inspect
import types
from collections.abc import Callable
from typing import Any

import wrapt

from ..base.patcher import cast_switch
from ..errors import MissingDependencyError
from .plans import plan
from .twins import make_traceable
from .wrappers import WrapContext, make_function, with_dtype_hint


class TwinProxy(wrapt.FunctionWrapper):
    """A `wrapt.FunctionWrapper` whose calls `torch.compile` traces through `traceable`
    (the plain-Python twin) while casts are on, and through the original op while off."""

    def __init__(self, wrapped: Any, wrapper: Callable, traceable: Callable | None = None) -> None:
        super(TwinProxy, self).__init__(wrapped, wrapper)  # explicit: proxies override __class__
        self._self_traceable = traceable

    @property
    def _torchdynamo_inline(self) -> Any:
        if cast_switch.enabled and self._self_traceable is not None:
            return self._self_traceable
        return self.__wrapped__


def _init_builtin(proxy: TwinProxy, wrapped: Any, wrapper: Callable, traceable: Callable | None) -> None:
    """Initialise `proxy` as wrapt initialises a wrapper of a C function (see the module doc)."""
    # wrapt's stubs declare only the public constructor, not its base's that takes the binding
    super(wrapt.FunctionWrapper, proxy).__init__(wrapped, None, wrapper, None, "builtin")  # type: ignore[call-arg]
    proxy._self_traceable = traceable


class ModuleTwinProxy(TwinProxy):
    """A `TwinProxy` for a plain Python function that is a module attribute: a
    module attribute is never bound, so the "builtin" binding behaves the same, faster."""

    def __init__(self, wrapped: Any, wrapper: Callable, traceable: Callable | None = None) -> None:
        _init_builtin(self, wrapped, wrapper, traceable)


def check_builtin_binding(*classes: type[TwinProxy]) -> None:
    """Raise ImportError unless each class (by default `ModuleTwinProxy`) builds a wrapper with
    wrapt's "builtin" binding that passes its calls to the wrapper function unbound."""
    def probe(a: Any, k: Any = None) -> Any:
        return a, k

    def record(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        return wrapped, instance, args, kwargs

    seen: tuple[str, Any] | TypeError
    for cls in classes or (ModuleTwinProxy,):
        try:
            proxy = cls(probe, record)
            seen = (proxy._self_binding, proxy(1, k=2))
        except TypeError as exc:
            seen = exc
        if seen != ("builtin", (probe, None, (1,), {"k": 2})):
            raise MissingDependencyError(
                f"ampatch: wrapt {importlib.metadata.version('wrapt')} no longer builds a wrapper with the "
                f"\"builtin\" binding the way ampatch.o1.proxies relies on ({cls.__name__} gave {seen!r}). Install "
                "a wrapt release this ampatch supports (pip install 'wrapt>=2.0,<3'), or report the wrapt version.")


check_builtin_binding()


def twin_proxy(original: Any, traceable: Callable) -> TwinProxy:
    """The proxy an O1 function carries as `_torchdynamo_inline` (see the module doc). Called
    itself, it runs what Dynamo would trace: the twin while casts are on, else the original."""
    def call(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        return (traceable if cast_switch.enabled else wrapped)(*args, **kwargs)
    return ModuleTwinProxy(original, call, traceable)


def is_patch(obj: Any) -> bool:
    """Whether `obj` is an O1 function made by `wrap`."""
    return isinstance(obj, types.FunctionType) and isinstance(vars(obj).get(_TWIN), TwinProxy)


_TWIN = "_torchdynamo_inline"


def wrap(kind: str, op: str, original: Any, ctx: WrapContext, banned_message: str = "",
         owner: Any = None, hint_name: str | None = None) -> Callable:
    """The O1 function of the `kind` plan around `original`, carrying its twin; both are
    built from one plan. It keeps the original's name, docs and `__wrapped__`.

    `owner` is where it will be set (as attribute `op`): on a class, a static or class method
    is set as a static method (the function calls the original as the class lookup gave it).
    `hint_name` adds the registration hint to dtype errors (user functions)."""
    p = plan(kind, op, ctx.half_dtype, ctx.allow_banned, banned_message)
    fn = make_function(p, original, ctx)
    if hint_name is not None:
        fn = with_dtype_hint(fn, hint_name)
    setattr(fn, _TWIN, twin_proxy(original, make_traceable(p, original)))
    if isinstance(owner, type):
        try:
            raw = inspect.getattr_static(owner, op)
        except AttributeError:
            raw = None
        if isinstance(raw, (staticmethod, classmethod)):
            return staticmethod(fn)
    return fn
