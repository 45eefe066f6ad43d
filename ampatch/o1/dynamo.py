"""torch.compile under O1/O4: Tensor methods and operators, as Dynamo sees them.

Patched functions (`torch.*`, `F.*`, `torch.linalg.*`, `torch.Tensor.softmax(x)`) carry
their own plain-Python twin, which Dynamo inlines (`proxies`: `_torchdynamo_inline`). Method
calls and operators on tensors (`x.softmax(-1)`, `x @ w`, `x ** 2`) never look at
`torch.Tensor`'s attributes inside Dynamo: it records the method name or the operator
directly. So, while a session patches torch, two Dynamo entry points are wrapped (and put
back by `deinitialize`, like every other patch):

- `TensorVariable.call_method`: a call of a method that ampatch patched on `torch.Tensor`
  is traced through that patch, read from `torch.Tensor` with a source, so the compiled
  code is guarded on it (and recompiles after `deinitialize` or inside `disable_casts()`);
- `BuiltinVariable.call_function`: `a @ b`, `a ** b`, `2 ** a`, `2 / a` on tensors become
  the `__matmul__`, `__pow__`, `__rpow__`, `__rtruediv__` calls Python would make, when
  those are patched.

The patch's own call of the original method comes back to these entry points; a per-thread
stack of the names being traced lets it through. If this torch's Dynamo lacks the entry
points, `install` logs a warning and compiled code keeps only the function casts.

The backend then compiles the captured graph, casts included, and must see torch as it is:
AOT Autograd traces it through torch's own Python decompositions (`aten.matmul`'s calls
`Tensor.bmm`), where a patched op would cast torch's internal FP32 math back to half
(SDPA's math path with dropout then failed in backward). So the backend compile, and the
lazy compile of the backward graph, run with casts off in their thread, as torch runs them
with autocast off (`_BACKEND_COMPILE`).

A module kept in FP32 (`keep_fp32`) runs with casts off, but Dynamo chooses the casts of
what it traces when it traces (`proxies.TwinProxy._torchdynamo_inline`), not where a
module runs: so its forward wrapper (`model.forwards.UncastForward`, handed in as `eager`) runs eagerly,
outside the graph, with casts off as in eager mode (`torch.compiler.disable`: a graph break).
"""
from __future__ import annotations

import functools
import importlib
import inspect
import logging
import operator
import sys
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import wrapt

from ..base import patcher, tree
from ..base.patcher import Patcher, disable_casts
from . import cache, generate, plans, proxies, rnn, signatures, wrappers
from .twins import is_traced

logger = logging.getLogger("ampatch")

# operator -> (method Python calls on the left operand, reflected method on the right one)
_OPERATORS: dict[Callable, tuple[str, str | None]] = {
    operator.matmul: ("__matmul__", "__rmatmul__"),
    operator.pow: ("__pow__", "__rpow__"),
    operator.truediv: ("__truediv__", "__rtruediv__"),
}



# (module, class, method) of the steps that compile a captured graph: Dynamo's hand-over to the
# backend (AOT Autograd traces forward and backward there) and AOT's lazy backward compile
_BACKEND_COMPILE: tuple[tuple[str, str, str], ...] = (
    ("torch._dynamo.output_graph", "OutputGraph", "call_user_compiler"),
    ("torch._functorch._aot_autograd.runtime_wrappers", "_AutogradBackwardCompiler", "get_or_compile"),
)


class _Tracing(threading.local):
    """Names whose patch Dynamo is tracing right now, innermost last (per tracing thread)."""

    def __init__(self) -> None:
        self.names: list[str] = []


_tracing = _Tracing()


def _patched_method(name: str) -> Callable | None:
    """torch.Tensor.<name> when ampatch patched it, and Dynamo is not inside that patch."""
    if _tracing.names and _tracing.names[-1] == name:
        return None
    wrapper = vars(torch.Tensor).get(name)  # a patch is set on torch.Tensor itself
    return wrapper if proxies.is_patch(wrapper) else None


def _trace_method(tx: Any, name: str, args: list, kwargs: dict) -> Any:
    """Trace `torch.Tensor.<name>(*args, **kwargs)` through ampatch's patch, guarded on it."""
    from torch._dynamo.source import AttrSource
    from torch._dynamo.variables.builder import VariableBuilder

    source = AttrSource(AttrSource(tx.import_source("torch"), "Tensor"), name)
    fn = VariableBuilder(tx, source)(getattr(torch.Tensor, name))
    _tracing.names.append(name)
    try:
        return fn.call_function(tx, list(args), dict(kwargs))
    finally:
        _tracing.names.pop()


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    """`code` and every function body nested in it."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _eager_codes() -> Iterator[types.CodeType]:
    """The code of ampatch's eager O1 path: the wrappers and what they call (plans, the
    structure walk, the cast cache), the RNN forward. (The generated O1 functions are
    marked as they are compiled, `generate.on_new_code`.)

    Dynamo must never compile these frames on its own (it would happen in the eager parts
    of a compiled function, after a graph break): they read per-thread state that Dynamo
    cannot guard and look up parameters by id, so each parameter would recompile. The
    twins (`o1.twins`, and whatever is marked `traced`) are what Dynamo traces; it
    still inlines the helpers they call from here, as skipping a frame does not stop that.
    """
    for module in (patcher, plans, wrappers, proxies, tree, cache, rnn, signatures, generate):
        for obj in vars(module).values():
            if getattr(obj, "__module__", None) != module.__name__ or is_traced(obj):
                continue
            functions = [obj] if inspect.isfunction(obj) else [
                f for f in vars(obj).values() if inspect.isfunction(f)] if inspect.isclass(obj) else []
            for fn in functions:
                yield from _codes(fn.__code__)


def _skip_generated(code: types.CodeType) -> None:
    """Mark a generated O1 function's factory, and the function in it, as never compiled."""
    from torch._dynamo.eval_frame import skip_code
    for c in _codes(code):
        skip_code(c)


def install(patcher: Patcher, eager: Sequence[tuple[type, str]] = (),
            after_compile: Callable[[], None] = lambda: None) -> None:
    """Wrap Dynamo's method and operator entry points for the session (see the module doc);
    the methods in `eager` ((class, name): the forward of a kept module) run outside the graph;
    `after_compile` runs once installed and after each backend compile step (`captured`).

    Importing Dynamo takes a second or two (and rebinds a few torch functions), so a
    session that starts before anything imported it installs on the first `torch.compile`
    call instead (`torch.compiler.compile` and `Module.compile` go through it too)."""
    if "torch._dynamo" in sys.modules:
        _install_now(patcher, eager, after_compile)
        return
    lock, done = threading.Lock(), list[bool]()

    def compile_first(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        with lock:
            if not done:
                done.append(True)
                _install_now(patcher, eager, after_compile)
        return wrapped(*args, **kwargs)

    patcher.patch(torch, "compile", wrapt.FunctionWrapper(torch.compile, compile_first))


def _install_now(patcher: Patcher, eager: Sequence[tuple[type, str]], after_compile: Callable[[], None]) -> None:
    try:
        from torch._dynamo.variables.builtin import BuiltinVariable
        from torch._dynamo.variables.tensor import TensorVariable
        call_method = vars(TensorVariable)["call_method"]
        call_function = vars(BuiltinVariable)["call_function"]
    except (ImportError, KeyError) as exc:
        logger.warning("ampatch: this torch's Dynamo has no %s; under torch.compile, casts of Tensor methods "
                       "and operators (x.softmax(), x @ w) are not captured, only those of functions.", exc)
        return

    def plain_tensor(v: Any) -> bool:
        """A torch.Tensor in the traced code (not an ndarray, a subclass or a scalar Dynamo
        models as a tensor: those keep Dynamo's own handling)."""
        return type(v.realize() if hasattr(v, "realize") else v) is TensorVariable

    def tensor_call_method(self: Any, tx: Any, name: str, args: list, kwargs: dict) -> Any:
        if type(self) is TensorVariable and _patched_method(name) is not None:
            return _trace_method(tx, name, [self, *args], kwargs)
        return call_method(self, tx, name, args, kwargs)

    def builtin_call_function(self: Any, tx: Any, args: list, kwargs: dict) -> Any:
        names = _OPERATORS.get(self.fn) if len(args) == 2 and not kwargs else None
        if names is not None:
            left, right = args
            if plain_tensor(left):
                if _patched_method(names[0]) is not None:
                    return _trace_method(tx, names[0], [left, right], {})
            elif names[1] is not None and plain_tensor(right) and not left.is_tensor() \
                    and _patched_method(names[1]) is not None:
                return _trace_method(tx, names[1], [right, left], {})
        return call_function(self, tx, args, kwargs)

    _compile_without_casts(patcher, after_compile)
    _torch_tables(patcher)
    for cls, name in eager:
        patcher.patch(cls, name, _eagerly(vars(cls)[name]))
    from torch._dynamo.eval_frame import skip_code
    for code in _eager_codes():  # a set in torch: adding twice is harmless
        skip_code(code)
    generate.on_new_code(_skip_generated)
    patcher.patch(TensorVariable, "call_method", tensor_call_method)
    patcher.patch(BuiltinVariable, "call_function", builtin_call_function)
    after_compile()  # Dynamo may have been imported just now


_METHOD_TYPES = (types.MethodDescriptorType, types.WrapperDescriptorType, types.BuiltinFunctionType)


def _torch_tables(patcher: Patcher) -> None:
    """Dynamo's two tables of torch's own functions (`trace_rules.get_torch_obj_rule_map`,
    `trace_rules.get_tensor_method`) are built once per process by looking names up on torch:
    built while a session's O1 functions stand in torch's place (Dynamo first imported, or
    first tracing, under O1), they hold those and miss torch's originals, which Dynamo then
    refuses to trace (a graph break where a twin calls its op). While the session patches
    torch, both answer with the originals added; `deinitialize` drops their caches, so they
    are rebuilt from torch as it is then."""
    from torch._dynamo import trace_rules

    rule_map, tensor_methods = trace_rules.get_torch_obj_rule_map, trace_rules.get_tensor_method

    @functools.cache
    def completed_rule_map() -> dict[Any, Any]:
        table = rule_map()
        for _owner, _name, original, replacement in patcher.patched():
            rule = table.get(replacement) if isinstance(replacement, types.FunctionType) else None
            if rule is not None:
                table.setdefault(original, rule)
        return table

    @functools.cache
    def completed_tensor_methods() -> frozenset[Any]:
        originals = [original for owner, name, original, _ in patcher.patched()
                     if owner is torch.Tensor and isinstance(original, _METHOD_TYPES) and name != "__new__"]
        return tensor_methods() | frozenset(originals)

    def drop_caches() -> None:
        rule_map.cache_clear()
        tensor_methods.cache_clear()

    patcher.patch(trace_rules, "get_torch_obj_rule_map", completed_rule_map)
    patcher.patch(trace_rules, "get_tensor_method", completed_tensor_methods)
    patcher.on_restore(drop_caches)


_EAGER_REASON = ("ampatch: at O1/O4 a module in keep_fp32 runs eagerly, with casts off (a graph break); compile "
                 "without fullgraph=True, or use O2/O3/O5, where kept modules are part of the graph")


def _eagerly(fn: Callable) -> Callable:
    """`fn` as `torch.compiler.disable` makes it: Dynamo calls it, never traces it."""
    try:
        return torch.compiler.disable(fn, reason=_EAGER_REASON)
    except TypeError:  # torch before 2.7: no reason
        return torch.compiler.disable(fn)


def _compile_without_casts(patcher: Patcher, after: Callable[[], None]) -> None:
    """Run each `_BACKEND_COMPILE` step with casts off (see the module doc), then `after`
    (the backend may have imported Inductor: `captured.keep_torch_ops`)."""
    for module, cls_name, name in _BACKEND_COMPILE:
        try:
            cls = getattr(importlib.import_module(module), cls_name)
            original = vars(cls)[name]
        except (ImportError, AttributeError, KeyError) as exc:
            logger.warning("ampatch: this torch has no %s.%s.%s (%s); under torch.compile, backends that trace "
                           "the graph again (aot_eager, inductor) may see torch's own code cast.", module,
                           cls_name, name, exc)
            continue
        patcher.patch(cls, name, _without_casts(original, after))


def _without_casts(original: Callable, after: Callable[[], None]) -> Callable:
    @functools.wraps(original)
    def method(*args: Any, **kwargs: Any) -> Any:
        try:
            with disable_casts():
                return original(*args, **kwargs)
        finally:
            after()
    return method
