"""Writing an op's O1 function: Python source made from its action and `signatures.Layout`.

Each patched op gets one plain function, set on torch in the op's place. It reads the
per-thread switch, looks at the arguments that can hold a tensor one by one (inline, in one
pass), converts those that need it, counts the call once if it converted anything, and calls
the op with the arguments as they came: no tuple, list or dict is built, no second call is
made. A call this shape cannot serve (keywords or extra positional arguments to a builtin,
a promotion that changes something, a refused dtype) goes to the op's general path, which
walks everything (`wrappers.general_path`). docs/internals.md shows a generated function.

The source depends only on the layout, the action and a few flags, never on the op: each
distinct source is compiled once, as a factory that takes the op's values (the op itself,
its counter, its casts: `Values`) and returns the function. `codes()` lists the compiled
code, which `torch.compile` must never compile on its own (`o1.dynamo`).
"""
from __future__ import annotations

import builtins
import functools
import inspect
import threading
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .signatures import Layout

__all__ = ["Shape", "Values", "RESERVED", "source", "build", "codes", "on_new_code"]

CAST, PROMOTE, REFUSE = "cast", "promote", "refuse"

# The closure names of every generated function, and its locals: a Python signature that
# uses one of them gets the generic layout (`signatures.layout_of`).
_CLOSURE = ("_op", "_switch", "_M", "_atoms", "_Tensor", "_Parameter", "_needs", "_convert", "_entries", "_get",
            "_hits", "_stale", "_no_grad_get", "_no_grad_put", "_grad", "_walk", "_general", "_tick", "_clock", "_timer", "_off_cpu", "_type", "_next", "_id")
RESERVED = frozenset(_CLOSURE + ("_n", "_t", "_b", "_d", "_e", "_g", "_k", "_t0", "rest", "kw"))


@dataclass(frozen=True)
class Shape:
    """What a generated source depends on."""

    action: str          # CAST, PROMOTE or REFUSE
    layout: Layout
    in_place: bool = False   # PROMOTE: the first argument's dtype decides
    cpu_only: bool = False   # CAST: only when the first argument is on the CPU
    timed: bool = False      # report the seconds spent converting


@dataclass(frozen=True)
class Values:
    """What one op's function closes over (names as in the source, without the underscore)."""

    op: Callable                    # the original
    switch: Any                     # base.patcher.cast_switch
    M: Any                          # the "not given" sentinel of a builtin's positional arguments
    atoms: frozenset                # argument types that never hold a tensor (the sentinel's among them)
    Tensor: type
    Parameter: type
    needs: frozenset                # CAST/REFUSE: the dtypes converted / refused
    convert: Callable               # CAST: a plain tensor -> the target dtype
    cache: Any                      # CAST: the cast cache's casts to the target dtype (`cache.Inline`)
    walk: Callable                  # CAST: anything else -> the same object, or one with tensors converted
    general: Callable               # (args, kwargs) -> the op's result, the general path
    tick: Any                       # CAST: the op's counter (itertools.count)
    clock: Callable | None = None   # timed: time.perf_counter
    timer: Callable | None = None   # timed: given the seconds spent converting
    off_cpu: Callable | None = None  # cpu_only: whether the first argument is a tensor off the CPU


# ------------------------------------------------------------------------------ the source
def _params(shape: Shape) -> tuple[str, list[str], list[str], str, str]:
    """(the def's parameter list, the names checked in order, the call's arguments, the
    argument tuple and keyword dict handed to the general path, the first argument's name)."""
    layout = shape.layout
    if layout.signature is None:
        names = [f"a{i}" for i in range(layout.positions)]
        params = ", ".join([f"{n}=_M" for n in names] + (["/"] if names else []) + ["*rest", "**kw"])
        checked = [n for i, n in enumerate(names) if i in layout.checked]
        args = "(" + "".join(f"{n}, " for n in names) + "*rest)"
        return params, checked, names, f"{args}, kw", names[0] if names else "None"
    parts, call, positional, keywords, checked = [], [], [], [], []
    star = False
    for i, (name, prm) in enumerate(layout.signature.parameters.items()):
        default = "" if prm.default is prm.empty else f"=_d{i}"
        if prm.kind is prm.VAR_POSITIONAL:
            parts.append(f"*{name}")
            call.append(f"*{name}")
            positional.append(f"*{name}")
            star = True
        elif prm.kind is prm.VAR_KEYWORD:
            parts.append(f"**{name}")
            call.append(f"**{name}")
            keywords.append(f"**{name}")
        elif prm.kind is prm.KEYWORD_ONLY:
            if not star:
                parts.append("*")
                star = True
            parts.append(f"{name}{default}")
            call.append(f"{name}={name}")
            keywords.append(f"{name!r}: {name}")
        else:
            parts.append(f"{name}{default}")
            call.append(name)
            positional.append(name)
            if prm.kind is prm.POSITIONAL_ONLY and (i + 1 == len(layout.signature.parameters) or list(
                    layout.signature.parameters.values())[i + 1].kind is not prm.POSITIONAL_ONLY):
                parts.append("/")
        if name in layout.checked:
            checked.append(name)
    first = next((n for n, p in layout.signature.parameters.items()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)), "None")
    handoff = "(" + "".join(f"{a}, " for a in positional) + "), {" + ", ".join(keywords) + "}"
    return ", ".join(parts), checked, call, handoff, first


def _cast_check(a: str) -> list[str]:
    """Convert `a` if it needs it, a parameter through the cast cache (`cache.Inline`);
    `_n = 1` when it did."""
    return [f"_t = _type({a})",
            "if _t is _Tensor:",
            f"    if {a}.dtype in _needs:",
            f"        {a} = _convert({a})",
            "        _n = 1",
            "elif _t is _Parameter:",
            f"    if {a}.requires_grad:",
            f"        _k = _id({a})",
            "        _e = _get(_k)",
            f"        if _e is not None and _e[0] == {a}._version:",
            f"            {a} = _e[1]",
            "            _next(_hits)",
            "            _n = 1",
            f"        elif {a}.dtype in _needs:",
            "            _g = _grad()",
            f"            _b = None if _g else _no_grad_get({a}, _k)",
            "            if _b is None:",
            f"                _b = _convert({a})",
            "                if not _g:",
            f"                    _no_grad_put({a}, _k, _b)",
            "                else:",
            "                    if _e is not None:",
            "                        _next(_stale)",
            f"                    _entries[_k] = ({a}._version, _b)",
            f"            {a} = _b",
            "            _n = 1",
            f"    elif {a}.dtype in _needs:",
            f"        {a} = _convert({a})",
            "        _n = 1",
            "elif _t not in _atoms:",
            f"    _b = _walk({a})",
            f"    if _b is not {a}:",
            f"        {a} = _b",
            "        _n = 1"]


def _promote_check(a: str, general: str, first: bool) -> list[str]:
    """Hand the call to the general path unless every floating tensor so far has one dtype
    (in place: the first argument's dtype, floating or not)."""
    if first:
        return [f"_t = _type({a})",
                "if _t is _Tensor or _t is _Parameter:",
                f"    _d = {a}.dtype",
                "elif _t not in _atoms:",
                f"    return {general}"]
    return [f"_t = _type({a})",
            "if _t is _Tensor or _t is _Parameter:",
            f"    _e = {a}.dtype",
            "    if _e.is_floating_point:",
            "        if _d is None:",
            "            _d = _e",
            "        elif _e is not _d:",
            f"            return {general}",
            "elif _t not in _atoms:",
            f"    return {general}"]


def _refuse_check(a: str, general: str) -> list[str]:
    """Hand the call to the general path (which raises) if `a` may hold a refused dtype."""
    return [f"_t = _type({a})",
            "if _t is _Tensor or _t is _Parameter:",
            f"    if {a}.dtype in _needs:",
            f"        return {general}",
            "elif _t not in _atoms:",
            f"    return {general}"]


def _calls(shape: Shape, names: list[str], call: list[str]) -> list[str]:
    """The call of the op with the arguments as given (a builtin: as many as were given)."""
    if shape.layout.signature is not None:
        return [f"return _op({', '.join(call)})"]
    lines = []
    for k in range(len(names), 0, -1):
        lines += [f"if {names[k - 1]} is not _M:", f"    return _op({', '.join(names[:k])})"]
    return lines + ["return _op()"]


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
    params, checked, call, handoff, first = _params(shape)
    general = f"_general({handoff})"
    condition = "_switch.enabled"
    sig = shape.layout.signature
    if sig is not None and "out" in sig.parameters and sig.parameters["out"].kind is not inspect.Parameter.VAR_KEYWORD:
        condition += " and out is None"  # a call with out= runs as written (plans.OUT)
    var_kw = next((n for n, p in sig.parameters.items() if p.kind is p.VAR_KEYWORD), None) if sig else None
    if var_kw is not None:
        condition += f" and 'out' not in {var_kw}"
    if shape.cpu_only:
        condition += f" and not _off_cpu({first})"
    body: list[str] = []
    if sig is None:
        body += ["if rest or kw:", f"    return {general}"]
    inner: list[str] = ["_t0 = _clock()"] if shape.timed else []
    if shape.action == CAST:
        inner.append("_n = 0")
        for a in checked:
            inner += _cast_check(a)
        if shape.timed:
            inner.append("_timer(_clock() - _t0)")
        inner += ["if _n:", "    _next(_tick)"]
    elif shape.action == PROMOTE:
        inner.append("_d = None")
        for i, a in enumerate(checked):
            inner += _promote_check(a, general, shape.in_place and i == 0 and a == first)
    else:
        for a in checked:
            inner += _refuse_check(a, general)
    if shape.action != CAST and shape.timed:
        inner.append("_timer(_clock() - _t0)")
    body += [f"if {condition}:"] + ["    " + line for line in inner or ["pass"]]
    body += _calls(shape, [n for n in call if sig is None], call)
    name = f"ampatch_{shape.action}"
    lines = [f"def _factory({', '.join(_CLOSURE)}, _defaults):",
             *(f"    _d{i} = _defaults[{i}]" for i, prm in enumerate(sig.parameters.values() if sig else ())
               if prm.default is not prm.empty),
             f"    def {name}({params}):",
             *("        " + line for line in body),
             f"    return {name}"]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ compiling
_factories: dict[str, Callable] = {}
_hooks: list[Callable[[types.CodeType], None]] = []
_lock = threading.Lock()


def on_new_code(hook: Callable[[types.CodeType], None]) -> None:
    """Call `hook` with the code of every factory compiled from now on (and those compiled
    so far): `o1.dynamo` marks them as code Dynamo must not compile."""
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


def _cache_values(inline: Any) -> tuple:
    """The closure values `_entries` ... `_no_grad_put` from a `cache.Inline` (or None)."""
    if inline is None:
        return (None,) * 6
    return inline.entries, inline.get, inline.hits, inline.stale, inline.no_grad_get, inline.no_grad_put


def build(shape: Shape, values: Values, original: Any) -> types.FunctionType:
    """The O1 function of `original` for `shape`, closing over `values`: named like the
    original, with its globals (TorchScript resolves names through them), `__wrapped__` set."""
    sig = shape.layout.signature
    defaults = [p.default for p in sig.parameters.values()] if sig is not None else []
    made = _factory(source(shape))(
        values.op, values.switch, values.M, values.atoms, values.Tensor, values.Parameter, values.needs,
        values.convert, *_cache_values(values.cache), torch.is_grad_enabled, values.walk, values.general, values.tick,
        values.clock, values.timer, values.off_cpu, type, next, id, defaults)
    fn = types.FunctionType(made.__code__, getattr(original, "__globals__", {"__builtins__": builtins}),
                            getattr(original, "__name__", made.__name__), made.__defaults__, made.__closure__)
    fn.__kwdefaults__ = made.__kwdefaults__
    for attr in ("__module__", "__qualname__", "__doc__"):
        value = getattr(original, attr, None)
        if isinstance(value, str) or (attr == "__doc__" and value is None):
            setattr(fn, attr, value)
    fn.__wrapped__ = original
    return fn
