"""Writing an op's O1 function: Python source made from its action and `signatures.Layout`.

Each patched op gets one plain function, set on torch in the op's place. It reads the
per-thread switch, looks at the arguments that can hold a tensor one by one (inline, in one
pass), converts those that need it (a parameter through the cast cache, inline:
`cache.Inline`), counts the call once if it converted anything, and calls the op with the
arguments as they came: no tuple, list or dict is built, no second call is made. A call this
shape cannot serve (keywords or extra positional arguments to a builtin, a promotion that
changes something, a refused dtype, a container) goes to the op's general path, which walks
everything (`wrappers.general_path`). docs/internals.md shows a generated function.

The source depends only on the layout, the action and a few flags, never on the op: each
distinct source is compiled once, as a factory that takes one op's `Values` and returns its
function. `codes()` lists the compiled code, which `torch.compile` must never compile on its
own (`o1.dynamo`).
"""
from __future__ import annotations

import builtins
import dataclasses
import functools
import inspect
import textwrap
import threading
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .cache import Inline
from .plans import Action
from .signatures import Layout

__all__ = ["Shape", "Values", "RESERVED", "source", "build", "codes", "on_new_code"]


@dataclass(frozen=True)
class Shape:
    """What a generated source depends on."""

    action: Action           # what the plan does with the tensors it finds
    layout: Layout
    in_place: bool = False   # PROMOTE: the first argument's dtype decides
    cpu_only: bool = False   # CAST: only when the first argument is on the CPU
    timed: bool = False      # report the seconds spent converting


@dataclass(frozen=True)
class Values:
    """What one op's function closes over; in the source, each field is `_<name>`."""

    op: Callable                     # the original
    switch: Any                      # base.patcher.cast_switch
    M: Any                           # the "not given" default of a builtin's positional arguments
    atoms: frozenset                 # argument types that never hold a tensor ("not given"'s too)
    Tensor: type
    Parameter: type
    needs: frozenset                 # CAST/REFUSE: the dtypes converted / refused
    general: Callable                # (args, kwargs) -> the op's result: the general path
    convert: Callable | None = None  # CAST: a plain tensor or parameter -> the target dtype
    walk: Callable | None = None     # CAST: anything else -> itself, or a copy with its tensors converted
    tick: Any = None                 # CAST: the op's counter (itertools.count)
    cache: Inline | None = None      # CAST: the cast cache's casts to the target dtype
    clock: Callable | None = None    # timed: time.perf_counter
    timer: Callable | None = None    # timed: given the seconds spent converting
    off_cpu: Callable | None = None  # cpu_only: whether the first argument is a tensor off the CPU

    def closure(self) -> dict[str, Any]:
        """The factory's arguments (`_CLOSURE`): the fields, the cache's parts, the builtins."""
        out = {f"_{f.name}": getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "cache"}
        out.update(zip(_CACHE_NAMES, self.cache if self.cache is not None else (None,) * len(_CACHE_NAMES)))
        out.update(_grad=torch.is_grad_enabled, _type=type, _next=next, _id=id)
        return out


_CACHE_NAMES = tuple(f"_{name}" for name in Inline._fields)  # _entries, _get, _hits, _stale, ...
_CLOSURE = tuple(f"_{f.name}" for f in dataclasses.fields(Values) if f.name != "cache") + _CACHE_NAMES + (
    "_grad", "_type", "_next", "_id")
# The names the generated code uses (its closure, its locals): a Python signature using one
# of them gets the generic layout (`signatures.layout_of`).
RESERVED = frozenset(_CLOSURE + ("_n", "_t", "_b", "_d", "_e", "_g", "_k", "_t0", "rest", "kw"))

# ------------------------------------------------------------------------------ the source
# One argument `{a}` of a CAST function; `_n = 1` once something was converted.
_CAST_ARGUMENT = """\
_t = _type({a})
if _t is _Tensor:
    if {a}.dtype in _needs:
        {a} = _convert({a})
        _n = 1
elif _t is _Parameter:
    if {a}.requires_grad:
        _k = _id({a})
        _e = _get(_k)
        if _e is not None and _e[0] == {a}._version:  # cached with gradients, still current
            {a} = _e[1]
            _next(_hits)
            _n = 1
        elif {a}.dtype in _needs:  # a miss (without gradients: the no-grad casts first)
            _g = _grad()
            _b = None if _g else _no_grad_get({a}, _k)
            if _b is None:
                _b = _convert({a})
                if not _g:
                    _no_grad_put({a}, _k, _b)
                else:
                    if _e is not None:
                        _next(_stale)
                    _entries[_k] = ({a}._version, _b)
            {a} = _b
            _n = 1
    elif {a}.dtype in _needs:
        {a} = _convert({a})
        _n = 1
elif _t not in _atoms:
    _b = _walk({a})
    if _b is not {a}:
        {a} = _b
        _n = 1
"""

# One argument of a PROMOTE function: every floating tensor so far has the dtype `_d`, or
# the general path promotes (in place: `_d` is the first argument's dtype, floating or not).
_PROMOTE_FIRST = """\
_t = _type({a})
if _t is _Tensor or _t is _Parameter:
    _d = {a}.dtype
elif _t not in _atoms:
    return {general}
"""
_PROMOTE_ARGUMENT = """\
_t = _type({a})
if _t is _Tensor or _t is _Parameter:
    _e = {a}.dtype
    if _e.is_floating_point:
        if _d is None:
            _d = _e
        elif _e is not _d:
            return {general}
elif _t not in _atoms:
    return {general}
"""

# One argument of a REFUSE function: the general path raises on a refused dtype.
_REFUSE_ARGUMENT = """\
_t = _type({a})
if _t is _Tensor or _t is _Parameter:
    if {a}.dtype in _needs:
        return {general}
elif _t not in _atoms:
    return {general}
"""


class _Default:
    """A default, printed as the closure variable that holds it (`_d3`)."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"_d{self.index}"


def _params(layout: Layout) -> tuple[str, list[str], str, str, list[str]]:
    """(the def's parameters, the names checked in order, the general path's arguments, the
    first argument's name, the lines that call the op with the arguments as given)."""
    if layout.signature is None:  # a builtin: its positions, "not given" by default
        names = [f"a{i}" for i in range(layout.positions)]
        params = ", ".join([f"{n}=_M" for n in names] + (["/"] if names else []) + ["*rest", "**kw"])
        calls = []
        for k in range(len(names), 0, -1):
            calls += [f"if {names[k - 1]} is not _M:", f"    return _op({', '.join(names[:k])})"]
        handoff = _tuple(names + ["*rest"]) + ", kw"
        checked = [n for i, n in enumerate(names) if i in layout.checked]
        return params, checked, handoff, names[0] if names else "None", calls + ["return _op()"]
    prms = list(layout.signature.parameters.values())
    bare = layout.signature.replace(parameters=[
        p.replace(annotation=p.empty, default=p.empty if p.default is p.empty else _Default(i))
        for i, p in enumerate(prms)], return_annotation=inspect.Signature.empty)
    call, positional, keywords = [], [], []
    for p in prms:
        if p.kind is p.VAR_POSITIONAL:
            call.append(f"*{p.name}")
            positional.append(f"*{p.name}")
        elif p.kind is p.VAR_KEYWORD:
            call.append(f"**{p.name}")
            keywords.append(f"**{p.name}")
        elif p.kind is p.KEYWORD_ONLY:
            call.append(f"{p.name}={p.name}")
            keywords.append(f"{p.name!r}: {p.name}")
        else:
            call.append(p.name)
            positional.append(p.name)
    first = next((p.name for p in prms if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)), "None")
    handoff = _tuple(positional) + ", {" + ", ".join(keywords) + "}"
    checked = [p.name for p in prms if p.name in layout.checked]
    return str(bare)[1:-1], checked, handoff, first, [f"return _op({', '.join(call)})"]


def _tuple(items: list[str]) -> str:
    """The source of a tuple of `items` (expressions, starred ones too)."""
    return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"


def _condition(shape: Shape, first: str) -> str:
    """When the function converts: casts on in this thread, no `out=` (plans.OUT), and for a
    CPU-only plan, the first argument not a tensor off the CPU."""
    condition = "_switch.enabled"
    sig = shape.layout.signature
    if sig is not None:
        if "out" in sig.parameters and sig.parameters["out"].kind is not inspect.Parameter.VAR_KEYWORD:
            condition += " and out is None"
        var_kw = next((n for n, p in sig.parameters.items() if p.kind is p.VAR_KEYWORD), None)
        if var_kw is not None:
            condition += f" and 'out' not in {var_kw}"
    if shape.cpu_only:
        condition += f" and not _off_cpu({first})"
    return condition


def source(shape: Shape) -> str:
    """The source of the factory of `shape`'s functions (see the module doc)."""
    try:
        return _cached_source(shape)
    except TypeError:  # a signature with an unhashable default
        return _source(shape)


@functools.lru_cache(maxsize=4096)
def _cached_source(shape: Shape) -> str:
    return _source(shape)


def _source(shape: Shape) -> str:
    params, checked, handoff, first, calls = _params(shape.layout)
    general = f"_general({handoff})"
    inner = "_t0 = _clock()\n" if shape.timed else ""
    if shape.action is Action.CAST:
        inner += "_n = 0\n" + "".join(_CAST_ARGUMENT.format(a=a) for a in checked)
        inner += "_timer(_clock() - _t0)\n" if shape.timed else ""
        inner += "if _n:\n    _next(_tick)\n"
    else:
        if shape.action is Action.PROMOTE:
            inner += "_d = None\n" + "".join(
                (_PROMOTE_FIRST if shape.in_place and i == 0 and a == first else _PROMOTE_ARGUMENT).format(
                    a=a, general=general) for i, a in enumerate(checked))
        else:
            inner += "".join(_REFUSE_ARGUMENT.format(a=a, general=general) for a in checked)
        inner += "_timer(_clock() - _t0)\n" if shape.timed else ""
    body = f"if rest or kw:\n    return {general}\n" if shape.layout.signature is None else ""
    body += f"if {_condition(shape, first)}:\n" + textwrap.indent(inner or "pass\n", "    ") + "\n".join(calls) + "\n"
    sig = shape.layout.signature
    defaults = "".join(f"    _d{i} = _defaults[{i}]\n" for i, p in enumerate(sig.parameters.values() if sig else ())
                       if p.default is not p.empty)
    name = f"ampatch_{shape.action.value}"
    closure = textwrap.fill(", ".join(_CLOSURE + ("_defaults",)), 96, initial_indent="    ", subsequent_indent="    ")
    return (f"def _factory(\n{closure},\n):\n{defaults}"
            f"    def {name}({params}):\n{textwrap.indent(body, '        ')}    return {name}\n")


# ------------------------------------------------------------------------------ compiling
_factories: dict[str, Callable] = {}
_hooks: list[Callable[[types.CodeType], None]] = []
_lock = threading.Lock()


def on_new_code(hook: Callable[[types.CodeType], None]) -> None:
    """Call `hook` with the code of every factory compiled from now on, and of those
    compiled so far (once per hook): `o1.dynamo` marks them as code Dynamo must not compile."""
    with _lock:
        if hook in _hooks:
            return
        _hooks.append(hook)
        factories = list(_factories.values())
    for f in factories:
        hook(f.__code__)


def codes() -> Iterator[types.CodeType]:
    """The code of every factory compiled so far (each holds its function's code)."""
    with _lock:
        factories = list(_factories.values())
    for f in factories:
        yield f.__code__


def _factory(text: str) -> Callable:
    with _lock:
        made = _factories.get(text)
        if made is not None:
            return made
        namespace: dict[str, Any] = {"__builtins__": builtins}
        exec(compile(text, f"<ampatch o1 function {len(_factories)}>", "exec"), namespace)
        made = _factories[text] = namespace["_factory"]
        hooks = list(_hooks)
    for hook in hooks:
        hook(made.__code__)
    return made


def build(shape: Shape, values: Values, original: Any) -> types.FunctionType:
    """The O1 function of `original` for `shape`, closing over `values`: named like the
    original, with its globals (TorchScript resolves names through them), `__wrapped__` set."""
    sig = shape.layout.signature
    defaults = [p.default for p in sig.parameters.values()] if sig is not None else []
    made = _factory(source(shape))(**values.closure(), _defaults=defaults)
    fn = types.FunctionType(made.__code__, getattr(original, "__globals__", {"__builtins__": builtins}),
                            getattr(original, "__name__", made.__name__), made.__defaults__, made.__closure__)
    fn.__kwdefaults__ = made.__kwdefaults__
    for attr in ("__module__", "__qualname__", "__doc__"):
        value = getattr(original, attr, None)
        if isinstance(value, str) or (attr == "__doc__" and value is None):
            setattr(fn, attr, value)
    vars(fn)["__wrapped__"] = original
    return fn
