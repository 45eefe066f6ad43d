"""The O1 mechanism's parts, one by one: the plan of each kind, the one structure walk,
the eager function and its torch.compile twin agreeing on every kind, the wrapt binding the
proxies rely on, and finding what to patch.

(What the wrappers do to real torch ops in a session is tested in o1/test_patched_functions.py.)
"""
from __future__ import annotations

import collections
import sys
import types
from typing import Any, NamedTuple

import pytest
import torch
from torch.nn.utils.rnn import pack_sequence

from ampatch.base.counters import Counters
from ampatch.base.tree import map_tensors
from ampatch.o1 import install as o1
from ampatch.o1.plans import BANNED, BFLOAT16, CPU_FLOAT, FLOAT, HALF, PROMOTE, SEQUENCE_PROMOTE, Action, Kind, plan
from ampatch.o1.proxies import ModuleTwinProxy, TwinProxy, check_builtin_binding, is_patch, wrap
from ampatch.o1.twins import is_traced, traced
from ampatch.o1.wrappers import WrapContext

BF16, F16, F32, F64 = torch.bfloat16, torch.float16, torch.float32, torch.float64


# ----------------------------------------------------------------- plans: each rule decided once
def test_half_plans_cast_every_castable_dtype_but_the_target() -> None:
    p = plan(HALF, "linear", F16)
    assert (p.action, p.target, p.needs, p.label) == (Action.CAST, F16, {F32, BF16}, "float16")
    b = plan(BFLOAT16, "linear", F16)  # bfloat16 whatever the session's half dtype
    assert (b.action, b.target, b.needs, b.label) == (Action.CAST, BF16, {F32, F16}, "bfloat16")


def test_float_cpu_float_and_allowed_banned_plans_cast_half_dtypes_to_fp32() -> None:
    for kind, cpu_only in ((FLOAT, False), (CPU_FLOAT, True)):
        p = plan(kind, "softmax", BF16)
        assert (p.action, p.target, p.needs, p.cpu_only) == (Action.CAST, F32, {F16, BF16}, cpu_only)
    allowed = plan(BANNED, "binary_cross_entropy", BF16, allow_banned=True, message="use bce_with_logits")
    assert (allowed.action, allowed.target, allowed.needs) == (Action.CAST, F32, {F16, BF16})


def test_banned_plan_refuses_half_inputs_with_its_message() -> None:
    p = plan(BANNED, "binary_cross_entropy", BF16, message="use bce_with_logits")
    assert (p.action, p.needs, p.message) == (Action.REFUSE, {F16, BF16}, "use bce_with_logits")
    with pytest.raises(NotImplementedError, match="bce_with_logits"):
        map_tensors((torch.ones(1, dtype=BF16),), p.leaf())
    args = (torch.ones(1), [torch.ones(1, dtype=F64)])
    assert map_tensors(args, p.leaf()) is args


def test_promote_plans_know_in_place_ops() -> None:
    assert [plan(k, op, BF16).in_place for k, op in
            ((PROMOTE, "index_put_"), (PROMOTE, "index_put"), (PROMOTE, "__ipow__"), (SEQUENCE_PROMOTE, "cat"))] \
        == [True, False, False, False]
    assert plan(PROMOTE, "dot", BF16).action is Action.PROMOTE


def test_a_kind_is_its_string_and_an_unknown_kind_names_the_known_ones() -> None:
    assert plan("half", "f", BF16).kind is Kind.HALF and HALF == "half"
    with pytest.raises(ValueError, match="unknown cast kind 'halve'; one of half, bfloat16"):
        plan("halve", "f", BF16)


def test_a_cast_leaf_needs_its_cast() -> None:
    with pytest.raises(TypeError, match="takes the cast it applies"):
        plan(HALF, "f", BF16).leaf()


# ----------------------------------------------------------------- the one structure walk
class Pair(NamedTuple):
    a: Any
    b: Any


def to_bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(BF16) if t.is_floating_point() else t


def test_map_tensors_returns_the_very_object_when_nothing_changes() -> None:
    ints = torch.arange(3)
    for x in ((1, (16,), "s", None), [ints, [ints]], {"a": ints, "b": [1.0]}, Pair(ints, 2), torch.Size([2, 3]),
              collections.defaultdict(list, a=[ints])):
        assert map_tensors(x, to_bf16) is x


def test_map_tensors_rebuilds_each_container_type_around_a_change() -> None:
    t = torch.ones(2)
    nested = map_tensors([t, (t, {"k": Pair(t, [t])})], to_bf16)
    assert type(nested) is list and type(nested[1]) is tuple and type(nested[1][1]["k"]) is Pair
    assert nested[1][1]["k"].b[0].dtype == BF16
    d = map_tensors(collections.defaultdict(list, a=t), to_bf16)
    assert type(d) is collections.defaultdict and d.default_factory is list and d["a"].dtype == BF16
    ordered = map_tensors(collections.OrderedDict(a=t), to_bf16)
    assert type(ordered) is collections.OrderedDict
    packed = pack_sequence([torch.ones(3, 2), torch.ones(2, 2)])
    cast = map_tensors(packed, to_bf16)
    assert type(cast) is type(packed) and cast.data.dtype == BF16 and cast.batch_sizes is packed.batch_sizes


def test_map_tensors_converts_batch_objects_only_when_asked() -> None:
    class Batch:
        def to(self, dtype: torch.dtype) -> str:
            return f"batch in {dtype}"

    b = Batch()
    assert map_tensors([b], to_bf16) == [b]
    assert map_tensors([b, "text"], to_bf16, lambda obj: obj.to(BF16)) == ["batch in torch.bfloat16", "text"]
    module = torch.nn.Linear(1, 1)
    assert map_tensors(module, to_bf16, lambda obj: obj.to(BF16)) is module  # never a module


# ----------------------------------------------------------------- one plan, two builders
def dtypes_of(x: Any) -> Any:
    """The structure of x with each tensor replaced by its dtype."""
    return map_tensors(x, lambda t: t.dtype)


def seen(*args: Any, **kwargs: Any) -> Any:
    """An op that reports the dtypes it received."""
    return dtypes_of((args, kwargs))


def context() -> WrapContext:
    return WrapContext(lambda dtype: (lambda t: t.to(dtype)), BF16, Counters(), allow_banned=False)


T32, T16, TB, T64 = (torch.ones(2, dtype=d) for d in (F32, F16, BF16, F64))
INTS = torch.arange(2)
CALLS = {
    "tensors": ((T32, TB, T64, INTS), {}),
    "lists": (([T32, [T16, INTS]], (TB,)), {"w": T32}),
    "containers": ((Pair(T32, T16), {"x": [T32]}), {}),
    "kwargs": ((T16,), {"other": (T32, 2), "scale": 0.5}),
    "nested_promote": (([[TB, T32]],), {}),
    "all_bf16": ((TB, [TB]), {"dim": 1}),
}
KINDS = (HALF, BFLOAT16, FLOAT, CPU_FLOAT, PROMOTE, "promote_", SEQUENCE_PROMOTE)


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("kind", KINDS)
def test_the_eager_wrapper_and_the_compile_twin_agree(kind: str, call: str) -> None:
    """Both builders read one plan: same dtypes reach the op, for every kind and structure."""
    op = "op_" if kind == "promote_" else "op"
    proxy = wrap(PROMOTE if kind == "promote_" else kind, op, seen, context())
    args, kwargs = CALLS[call]
    eager = proxy(*args, **kwargs)
    assert proxy._torchdynamo_inline(*args, **kwargs) == eager
    assert proxy.__wrapped__(*args, **kwargs) == dtypes_of((args, kwargs))  # the original, untouched


def test_containers_reach_the_op_cast() -> None:
    """Tensors in namedtuples and dicts are cast like those in lists (one walk for all)."""
    proxy = wrap(HALF, "op", seen, context())
    assert proxy(Pair(T32, INTS), {"x": [T16]}) == ((Pair(BF16, torch.int64), {"x": [BF16]}), {})


def test_a_nested_list_is_promoted_to_its_widest_dtype() -> None:
    proxy = wrap(PROMOTE, "op", seen, context())
    assert proxy([[TB, T32]], T16) == (([[F32, F32]], F32), {})


def test_out_calls_run_as_written_under_every_kind() -> None:
    for kind in (HALF, FLOAT, PROMOTE):
        proxy = wrap(kind, "op", seen, context())
        assert proxy(T16, TB, T32, out=T32) == dtypes_of(((T16, TB, T32), {"out": T32}))
        assert proxy._torchdynamo_inline(T16, TB, T32, out=T32) == dtypes_of(((T16, TB, T32), {"out": T32}))


def test_banned_wrapper_and_twin_refuse_half_inputs_only() -> None:
    proxy = wrap(BANNED, "op", seen, context(), banned_message="use op_with_logits")
    for call in (proxy, proxy._torchdynamo_inline):
        assert call(T32, [T64]) == ((F32, [F64]), {})
        with pytest.raises(NotImplementedError, match="op_with_logits"):
            call(T32, [TB])


def test_counters_count_calls_that_converted_something() -> None:
    """report()'s casts count conversions, not calls: a call whose arguments already had the
    target dtype counts nothing (issue 45: "mean float32: 2560" where nothing was converted)."""
    ctx = context()
    half, float_, promote = wrap(HALF, "h", seen, ctx), wrap(FLOAT, "f", seen, ctx), wrap(PROMOTE, "p", seen, ctx)
    half(TB), half(T32), half(T32, T16, INTS)
    float_(T32), float_(T32, dim=1), float_([T32, T64])
    promote(T32, T32), promote(T32, TB)
    assert ctx.counters.snapshot() == {"h": {"bfloat16": 2}, "p": {"float32": 1}}


# ----------------------------------------------------------------- wrapt proxies
def module_function(x: Any) -> Any:
    return x


def test_an_o1_function_is_a_plain_function_carrying_its_twin_behind_a_proxy() -> None:
    check_builtin_binding()
    fn = wrap(FLOAT, "module_function", module_function, context(), owner=sys.modules[__name__])
    assert type(fn) is types.FunctionType and is_patch(fn) and fn.__wrapped__ is module_function
    assert (fn.__name__, fn.__qualname__, fn.__module__) == ("module_function", "module_function", __name__)
    twin = fn._torchdynamo_inline
    assert type(twin) is ModuleTwinProxy and twin._self_binding == "builtin"
    assert twin.__wrapped__ is module_function
    assert isinstance(twin, TwinProxy) and isinstance(twin, types.FunctionType)  # what Dynamo asks
    assert fn(TB).dtype == F32 and twin(TB).dtype == F32


def test_the_binding_check_fails_loudly_on_a_wrapt_that_binds_otherwise() -> None:
    class Plain(ModuleTwinProxy):
        def __init__(self, wrapped: Any, wrapper: Any, traceable: Any = None) -> None:
            TwinProxy.__init__(self, wrapped, wrapper, traceable)  # wrapt's own choice: "function"

    with pytest.raises(ImportError, match=r"wrapt .* \"builtin\" binding .*Plain gave \('function'"):
        check_builtin_binding(Plain)


def test_traced_marks_what_dynamo_may_compile() -> None:
    @traced
    def twin() -> None:
        pass

    assert is_traced(twin) and not is_traced(module_function) and not is_traced(None)


# ----------------------------------------------------------------- finding what to patch
class _Lists:
    HALF = ("mm", "no_such_op")
    FLOAT = ("mm", "exp")  # listed twice: the first list wins
    BANNED = {"log": "use log1p"}


def test_find_puts_registrations_first_each_attribute_once_and_skips_missing_names() -> None:
    targets = o1.find([(torch, "exp", HALF)], [("torch", _Lists)])
    assert [(t.name, t.kind, t.user) for t in targets] == [
        ("exp", HALF, True), ("mm", HALF, False), ("log", BANNED, False)]
    assert targets[-1].message == "use log1p" and all(t.owner is torch for t in targets)
