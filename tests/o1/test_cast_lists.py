"""The O1 op policy (ampatch.o1.lists) against the installed torch.

Checks that every listed name exists, that the lists are disjoint, that in-place ops are
never HALF/FLOAT, and, empirically, that each PROMOTE entry is needed (a mixed-dtype call
fails or mis-types without a wrapper) while each NATIVELY_PROMOTING entry is not.
"""
from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch

from ampatch.base.patcher import resolve_owner
from ampatch.o1.lists import NAMESPACES, torch_ops, vf

pytestmark = pytest.mark.filterwarnings("ignore:index_reduce\\(\\) is in beta")

KINDS = ("HALF", "FLOAT", "PROMOTE", "SEQUENCE_PROMOTE", "CPU_FLOAT")
ALL_LISTS = KINDS + ("BANNED", "NATIVELY_PROMOTING")
HALF_DTYPES = (torch.bfloat16, torch.float16)
INPLACE_DUNDERS = frozenset({
    "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
    "__ipow__", "__imatmul__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
    "__irshift__", "__idiv__",
})




def is_inplace(name: str) -> bool:
    """`exp_`, `index_put_`, `__iadd__`: ops that write into their first argument."""
    if name.startswith("__") and name.endswith("__"):
        return name in INPLACE_DUNDERS
    return name.endswith("_")


def names(module: ModuleType, lst: str) -> tuple[str, ...]:
    value = getattr(module, lst, ())
    return tuple(value) if isinstance(value, dict) else value


def entries(*lists: str) -> list[Any]:
    return [pytest.param(path, name, id=f"{path}.{name}")
            for path, module in NAMESPACES for lst in lists for name in names(module, lst)]


# ------------------------------------------------------------------ structure


def test_namespaces_shape() -> None:
    assert [path for path, _ in NAMESPACES] == [
        "torch", "torch.nn.functional", "torch.Tensor", "torch.linalg", "torch._VF"]
    for path, module in NAMESPACES:
        assert isinstance(module, ModuleType)
        assert module.__doc__ and module.__doc__.strip(), f"{module.__name__} needs a docstring"
        assert "Deliberate differences" in inspect.getsource(module), module.__name__
        for lst in KINDS + ("NATIVELY_PROMOTING",):
            value = getattr(module, lst, ())  # CPU_FLOAT is optional
            assert isinstance(value, tuple) and all(isinstance(n, str) for n in value), (path, lst)
        assert isinstance(module.BANNED, dict)
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in module.BANNED.items())


@pytest.mark.parametrize(("path", "name"), entries(*ALL_LISTS))
def test_listed_name_exists(path: str, name: str) -> None:
    owner = resolve_owner(path)
    assert hasattr(owner, name), f"{path}.{name} does not exist on torch {torch.__version__}"
    assert callable(getattr(owner, name)), f"{path}.{name} is not callable"


@pytest.mark.parametrize(("path", "module"), NAMESPACES, ids=[p for p, _ in NAMESPACES])
def test_no_duplicates_and_disjoint(path: str, module: ModuleType) -> None:
    seen: dict[str, str] = {}
    for lst in ALL_LISTS:
        listed = names(module, lst)
        dupes = {n for n in listed if listed.count(n) > 1}
        assert not dupes, f"{path}.{lst} lists {sorted(dupes)} more than once"
        for n in listed:
            assert n not in seen, f"{path}.{n} is in both {seen[n]} and {lst}"
            seen[n] = lst


@pytest.mark.parametrize(("path", "name"), entries("HALF", "FLOAT", "CPU_FLOAT"))
def test_inplace_never_half_or_float(path: str, name: str) -> None:
    assert not is_inplace(name), (
        f"{path}.{name} is in-place: a HALF/FLOAT wrapper would write into a cast copy")


def test_inplace_helper() -> None:
    assert is_inplace("index_put_") and is_inplace("__ipow__") and is_inplace("exp_")
    assert not is_inplace("__pow__") and not is_inplace("__matmul__") and not is_inplace("exp")


@pytest.mark.parametrize("lst", ["HALF", "FLOAT", "PROMOTE", "NATIVELY_PROMOTING"])
def test_tensor_methods_mirror_torch_functions(lst: str) -> None:
    tensor_module = dict(NAMESPACES)["torch.Tensor"]
    missing = [n for n in getattr(torch_ops, lst)
               if hasattr(torch.Tensor, n) and n not in getattr(tensor_module, lst)]
    assert not missing, f"torch.{lst} entries that exist as Tensor methods but are not in tensor.{lst}: {missing}"


def test_banned_messages_name_the_alternatives() -> None:
    banned = [(path, n, msg) for path, module in NAMESPACES for n, msg in module.BANNED.items()]
    assert ("torch.nn.functional", "binary_cross_entropy") in [(p, n) for p, n, _ in banned]
    for path, name, msg in banned:
        assert "BCEWithLogitsLoss" in msg or "binary_cross_entropy_with_logits" in msg, (path, name)
        assert "allow_banned" in msg, (path, name)
        assert 'register_float_function(torch, "sigmoid")' in msg, (path, name)


def test_rnn_cells_are_called_through_vf() -> None:
    cells = {torch.nn.RNNCell: ("rnn_tanh_cell", "rnn_relu_cell"),
             torch.nn.LSTMCell: ("lstm_cell",), torch.nn.GRUCell: ("gru_cell",)}
    for cls, cell_names in cells.items():
        source = inspect.getsource(cls.forward)
        for n in cell_names:
            assert f"_VF.{n}(" in source, f"{cls.__name__}.forward no longer calls _VF.{n}"
    assert sorted(vf.HALF) == sorted(n for cs in cells.values() for n in cs)
    for n in vf.HALF:
        assert n in torch_ops.HALF
        assert getattr(torch._VF, n) is getattr(torch, n)


# ------------------------------------------------------------------ promotion, measured

class K(dict):
    """Keyword arguments, as the last element of an example's argument tuple."""


Factory = Callable[..., torch.Tensor]


def factory(dtype: torch.dtype) -> Factory:
    """Deterministic tensors whose values are exact in float32, bfloat16 and float16."""
    def make(*shape: int) -> torch.Tensor:
        n = math.prod(shape)
        return ((torch.arange(n) % 7 + 1) / 8).reshape(shape).to(dtype)
    return make


def idx(*values: int) -> torch.Tensor:
    return torch.tensor(values)


def mask() -> torch.Tensor:
    return torch.tensor([True, False, True, False])


_binary4 = lambda a, b: (a(4), b(4))  # noqa: E731
_index_src = lambda a, b: (a(4), 0, idx(0, 2), b(2))  # noqa: E731
_seq = lambda a, b: ([a(3), b(3)],)  # noqa: E731

# "path:name" -> builder(a, b) of the call's arguments; `a` makes the first (self) tensor's
# dtype, `b` the other dtype. Every PROMOTE / SEQUENCE_PROMOTE / NATIVELY_PROMOTING entry
# needs one.
EXAMPLES: dict[str, Callable[[Factory, Factory], tuple]] = {
    # torch: PROMOTE
    "torch:dot": _binary4,
    "torch:vdot": _binary4,
    "torch:inner": lambda a, b: (a(2, 3), b(2, 3)),
    "torch:tensordot": lambda a, b: (a(2, 3), b(3, 2), 1),
    "torch:cross": lambda a, b: (a(2, 3), b(2, 3), 1),
    "torch:bilinear": lambda a, b: (a(2, 3), a(2, 4), b(5, 3, 4), b(5)),
    "torch:lerp": lambda a, b: (a(4), b(4), 0.5),
    "torch:index_put": lambda a, b: (a(4), (idx(0, 2),), b(2)),
    "torch:index_copy": _index_src,
    "torch:index_add": _index_src,
    "torch:index_reduce": lambda a, b: (a(4), 0, idx(0, 2), b(2), "prod"),
    "torch:scatter": _index_src,
    "torch:scatter_add": _index_src,
    "torch:scatter_reduce": lambda a, b: (a(4), 0, idx(0, 2), b(2), "sum"),
    "torch:masked_scatter": lambda a, b: (a(4), mask(), b(4)),
    "torch:put": lambda a, b: (a(4), idx(0, 2), b(2)),
    "torch:embedding_bag": lambda a, b: (a(3, 4), idx(0, 1, 2, 1), idx(0, 2), False, 0, False, b(4)),
    "torch:isclose": _binary4,
    "torch:allclose": _binary4,
    "torch:meshgrid": lambda a, b: (a(3), b(2), K(indexing="ij")),
    "torch:cartesian_prod": lambda a, b: (a(3), b(2)),
    # torch: NATIVELY_PROMOTING
    "torch:add": _binary4,
    "torch:sub": _binary4,
    "torch:mul": _binary4,
    "torch:div": _binary4,
    "torch:true_divide": _binary4,
    "torch:addcmul": lambda a, b: (a(4), b(4), b(4)),
    "torch:addcdiv": lambda a, b: (a(4), b(4), b(4)),
    "torch:atan2": _binary4,
    "torch:hypot": _binary4,
    "torch:maximum": _binary4,
    "torch:minimum": _binary4,
    "torch:fmax": _binary4,
    "torch:fmin": _binary4,
    "torch:clamp": lambda a, b: (a(4), b(4), b(4)),
    "torch:where": lambda a, b: (mask(), a(4), b(4)),
    "torch:eq": _binary4,
    "torch:ne": _binary4,
    "torch:lt": _binary4,
    "torch:le": _binary4,
    "torch:gt": _binary4,
    "torch:ge": _binary4,
    "torch:equal": _binary4,
    "torch:outer": lambda a, b: (a(3), b(2)),
    "torch:ger": lambda a, b: (a(3), b(2)),
    "torch:kron": lambda a, b: (a(2, 2), b(2, 2)),
    "torch:block_diag": lambda a, b: (a(2, 2), b(2, 2)),
    "torch:trapezoid": _binary4,
    "torch:cat": _seq,
    "torch:concat": _seq,
    "torch:concatenate": _seq,
    "torch:stack": _seq,
    "torch:hstack": _seq,
    "torch:vstack": _seq,
    "torch:dstack": _seq,
    "torch:column_stack": _seq,
    "torch:row_stack": _seq,
    # torch.nn.functional: PROMOTE
    "torch.nn.functional:bilinear": lambda a, b: (a(2, 3), a(2, 4), b(5, 3, 4), b(5)),
    "torch.nn.functional:embedding_bag": lambda a, b: (
        idx(0, 1, 2, 1), a(3, 4), idx(0, 2), K(mode="sum", per_sample_weights=b(4))),
    # torch.Tensor: PROMOTE (in-place entries keep self's dtype)
    "torch.Tensor:dot": _binary4,
    "torch.Tensor:vdot": _binary4,
    "torch.Tensor:inner": lambda a, b: (a(2, 3), b(2, 3)),
    "torch.Tensor:cross": lambda a, b: (a(2, 3), b(2, 3), 1),
    "torch.Tensor:lerp": lambda a, b: (a(4), b(4), 0.5),
    "torch.Tensor:lerp_": lambda a, b: (a(4), b(4), 0.5),
    "torch.Tensor:index_put": lambda a, b: (a(4), (idx(0, 2),), b(2)),
    "torch.Tensor:index_put_": lambda a, b: (a(4), (idx(0, 2),), b(2)),
    "torch.Tensor:index_copy": _index_src,
    "torch.Tensor:index_copy_": _index_src,
    "torch.Tensor:index_add": _index_src,
    "torch.Tensor:index_add_": _index_src,
    "torch.Tensor:index_reduce": lambda a, b: (a(4), 0, idx(0, 2), b(2), "prod"),
    "torch.Tensor:index_reduce_": lambda a, b: (a(4), 0, idx(0, 2), b(2), "prod"),
    "torch.Tensor:scatter": _index_src,
    "torch.Tensor:scatter_": _index_src,
    "torch.Tensor:scatter_add": _index_src,
    "torch.Tensor:scatter_add_": _index_src,
    "torch.Tensor:scatter_reduce": lambda a, b: (a(4), 0, idx(0, 2), b(2), "sum"),
    "torch.Tensor:scatter_reduce_": lambda a, b: (a(4), 0, idx(0, 2), b(2), "sum"),
    "torch.Tensor:masked_scatter": lambda a, b: (a(4), mask(), b(4)),
    "torch.Tensor:masked_scatter_": lambda a, b: (a(4), mask(), b(4)),
    "torch.Tensor:put": lambda a, b: (a(4), idx(0, 2), b(2)),
    "torch.Tensor:put_": lambda a, b: (a(4), idx(0, 2), b(2)),
    "torch.Tensor:isclose": _binary4,
    "torch.Tensor:allclose": _binary4,
    # torch.Tensor: NATIVELY_PROMOTING
    "torch.Tensor:add": _binary4,
    "torch.Tensor:sub": _binary4,
    "torch.Tensor:mul": _binary4,
    "torch.Tensor:div": _binary4,
    "torch.Tensor:true_divide": _binary4,
    "torch.Tensor:addcmul": lambda a, b: (a(4), b(4), b(4)),
    "torch.Tensor:addcdiv": lambda a, b: (a(4), b(4), b(4)),
    "torch.Tensor:atan2": _binary4,
    "torch.Tensor:hypot": _binary4,
    "torch.Tensor:maximum": _binary4,
    "torch.Tensor:minimum": _binary4,
    "torch.Tensor:fmax": _binary4,
    "torch.Tensor:fmin": _binary4,
    "torch.Tensor:clamp": lambda a, b: (a(4), b(4), b(4)),
    "torch.Tensor:where": lambda a, b: (a(4), mask(), b(4)),
    "torch.Tensor:eq": _binary4,
    "torch.Tensor:ne": _binary4,
    "torch.Tensor:lt": _binary4,
    "torch.Tensor:le": _binary4,
    "torch.Tensor:gt": _binary4,
    "torch.Tensor:ge": _binary4,
    "torch.Tensor:equal": _binary4,
    "torch.Tensor:outer": lambda a, b: (a(3), b(2)),
    "torch.Tensor:ger": lambda a, b: (a(3), b(2)),
    "torch.Tensor:kron": lambda a, b: (a(2, 2), b(2, 2)),
    "torch.Tensor:__add__": _binary4,
    "torch.Tensor:__radd__": _binary4,
    "torch.Tensor:__sub__": _binary4,
    "torch.Tensor:__rsub__": _binary4,
    "torch.Tensor:__mul__": _binary4,
    "torch.Tensor:__rmul__": _binary4,
    "torch.Tensor:__truediv__": _binary4,
    "torch.Tensor:__eq__": _binary4,
    "torch.Tensor:__ne__": _binary4,
    "torch.Tensor:__lt__": _binary4,
    "torch.Tensor:__le__": _binary4,
    "torch.Tensor:__gt__": _binary4,
    "torch.Tensor:__ge__": _binary4,
    "torch.Tensor:add_": _binary4,
    "torch.Tensor:sub_": _binary4,
    "torch.Tensor:mul_": _binary4,
    "torch.Tensor:div_": _binary4,
    "torch.Tensor:addcmul_": lambda a, b: (a(4), b(4), b(4)),
    "torch.Tensor:addcdiv_": lambda a, b: (a(4), b(4), b(4)),
    "torch.Tensor:atan2_": _binary4,
    "torch.Tensor:hypot_": _binary4,
    "torch.Tensor:copy_": _binary4,
    "torch.Tensor:__iadd__": _binary4,
    "torch.Tensor:__isub__": _binary4,
    "torch.Tensor:__imul__": _binary4,
    "torch.Tensor:__itruediv__": _binary4,
    "torch.Tensor:__ipow__": _binary4,
    # torch.linalg: PROMOTE
    "torch.linalg:cross": lambda a, b: (a(2, 3), b(2, 3)),
}


class Outcome:
    """What one call did: raised, or returned floating dtypes plus the other results."""

    def __init__(self, error: Exception | None = None, dtypes: tuple = (), others: tuple = ()) -> None:
        self.error, self.dtypes, self.others = error, dtypes, others


def _split(result: Any) -> tuple[tuple, tuple]:
    """Floating tensor dtypes in the result, and everything else (bool tensors, Python values)."""
    items = result if isinstance(result, (tuple, list)) else (result,)
    dtypes = tuple(t.dtype for t in items if isinstance(t, torch.Tensor) and t.is_floating_point())
    others = tuple(t for t in items if not (isinstance(t, torch.Tensor) and t.is_floating_point()))
    return dtypes, others


def call(path: str, name: str, first: torch.dtype, second: torch.dtype) -> Outcome:
    fn = getattr(resolve_owner(path), name)
    args = EXAMPLES[f"{path}:{name}"](factory(first), factory(second))
    kwargs: dict = {}
    if args and isinstance(args[-1], K):
        args, kwargs = args[:-1], dict(args[-1])
    try:
        result = fn(*args, **kwargs)
    except (RuntimeError, TypeError, ValueError) as error:
        return Outcome(error=error)
    return Outcome(None, *_split(result))


def same_values(x: tuple, y: tuple) -> bool:
    if len(x) != len(y):
        return False
    for u, v in zip(x, y):
        if isinstance(u, torch.Tensor) or isinstance(v, torch.Tensor):
            if not (isinstance(u, torch.Tensor) and isinstance(v, torch.Tensor) and torch.equal(u, v)):
                return False
        elif u != v:
            return False
    return True


def promotes_correctly(path: str, name: str, first: torch.dtype, second: torch.dtype) -> tuple[bool, str]:
    """Whether the mixed call works as if every float argument were in the target dtype.

    Target: the widest dtype (out-of-place) or the first argument's dtype (in-place).
    """
    target = first if is_inplace(name) else torch.promote_types(first, second)
    mixed = call(path, name, first, second)
    if mixed.error is not None:
        return False, f"raises {type(mixed.error).__name__}: {str(mixed.error).splitlines()[0]}"
    if any(d != target for d in mixed.dtypes):
        return False, f"returns {mixed.dtypes}, expected {target}"
    reference = call(path, name, target, target)
    if not same_values(mixed.others, reference.others):
        return False, f"non-float results {mixed.others} differ from the promoted call's {reference.others}"
    return True, "ok"


def supported(path: str, name: str, dtype: torch.dtype) -> bool:
    """The op runs with every float argument in `dtype` on this CPU build."""
    return call(path, name, dtype, dtype).error is None


def example_or_fail(path: str, name: str) -> None:
    if f"{path}:{name}" not in EXAMPLES:
        pytest.fail(f"add an example call for {path}.{name} to EXAMPLES in tests/o1/test_cast_lists.py")
    homogeneous = call(path, name, torch.float32, torch.float32)
    assert homogeneous.error is None, f"the example for {path}.{name} fails even in float32: {homogeneous.error}"


@pytest.mark.parametrize(("path", "name"), entries("PROMOTE", "SEQUENCE_PROMOTE"))
def test_promote_entry_is_needed(path: str, name: str) -> None:
    """Without a wrapper, a float32/half mix raises or mis-types: the wrapper is needed."""
    example_or_fail(path, name)
    tested = []
    for half in HALF_DTYPES:
        if not supported(path, name, half):
            continue  # no CPU kernel in this dtype at all: a mixed failure would prove nothing
        tested.append(half)
        verdicts = [promotes_correctly(path, name, torch.float32, half),
                    promotes_correctly(path, name, half, torch.float32)]
        assert not all(ok for ok, _ in verdicts), (
            f"{path}.{name} handles float32 mixed with {half} natively: move it to NATIVELY_PROMOTING")
    assert torch.bfloat16 in tested, f"{path}.{name}'s example does not run in bfloat16 on CPU"


@pytest.mark.parametrize(("path", "name"), entries("NATIVELY_PROMOTING"))
def test_natively_promoting_needs_no_wrapper(path: str, name: str) -> None:
    """A float32/half mix returns the widest dtype (self's, in place) with the right values."""
    example_or_fail(path, name)
    for half in HALF_DTYPES:
        if not supported(path, name, half):
            continue
        for first, second in ((torch.float32, half), (half, torch.float32)):
            ok, why = promotes_correctly(path, name, first, second)
            assert ok, f"{path}.{name}({first}, {second}) {why}: it needs PROMOTE"


def test_every_example_belongs_to_a_list() -> None:
    listed = {f"{path}:{n}" for path, module in NAMESPACES
              for lst in ("PROMOTE", "SEQUENCE_PROMOTE", "NATIVELY_PROMOTING") for n in getattr(module, lst)}
    stale = sorted(set(EXAMPLES) - listed)
    assert not stale, f"examples for names no list holds: {stale}"
