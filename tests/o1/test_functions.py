"""The generated O1 functions (`o1.generate`): built from each op's layout, one pass over the
arguments that can hold a tensor, the caller's own objects passed on when nothing needs a
cast, the general path for every other call form, and the same casts as before: outputs and
gradients bitwise equal to casting by hand."""
from __future__ import annotations

import inspect
import math
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampatch as amp
from ampatch.base.counters import Counters
from ampatch.o1 import generate, lists
from ampatch.o1.install import find
from ampatch.o1.plans import HALF
from ampatch.o1.proxies import is_patch, wrap
from ampatch.o1.signatures import FALLBACK_POSITIONS, layout_of
from ampatch.o1.wrappers import WrapContext

BF16, F32 = torch.bfloat16, torch.float32


def o4(*models: nn.Module) -> torch.optim.Optimizer:
    ms = list(models) or [nn.Linear(2, 2)]
    opt = torch.optim.SGD([p for m in ms for p in m.parameters()], lr=0.1)
    amp.initialize(ms, opt, opt_level="O4", verbosity=0)
    return opt


# ----------------------------------------------------------------- layouts
@pytest.mark.parametrize("op, positions, checked", [
    (torch._C._nn.linear, 3, {0, 1, 2}),           # F.linear(input, weight, bias)
    (torch.softmax, 3, {0}),                        # softmax(input, dim, dtype)
    (torch.Tensor.softmax, 3, {0}),                 # x.softmax(dim, dtype): self first
    (torch.conv2d, 7, {0, 1, 2}),                   # stride, padding, ... hold no tensor
    (torch.addmm, 5, {0, 1, 2, 3, 4}),              # + the stubs' deprecated addmm(beta, input, mat1, mat2)
    (torch.Tensor.numpy, 1, {0}),                   # no schema: the type stub's signature
    (torch.linalg.inv, 1, {0}),                     # no stub: the schema (aten::linalg_inv)
])
def test_a_builtins_layout_names_its_positions_and_checks_those_that_can_hold_a_tensor(op, positions, checked):
    layout = layout_of(op, generate.RESERVED)
    assert layout.signature is None and layout.positions == positions and layout.checked == checked


def test_a_python_functions_layout_is_its_signature_checking_parameters_typed_for_tensors():
    layout = layout_of(F.layer_norm, generate.RESERVED)
    assert layout.signature == inspect.signature(F.layer_norm)
    assert layout.checked == {"input", "weight", "bias"}  # not normalized_shape: list[int], eps: float

    def untyped(a, b: int, *more, scale: float = 1.0, **options):
        return a

    assert layout_of(untyped, generate.RESERVED).checked == {"a", "more", "options"}


def test_unknown_ops_and_clashing_names_get_the_generic_layout():
    def clash(_op, x):  # a parameter named like the generated code's own closure
        return x

    for op in (clash, math.isqrt):  # (isqrt: a builtin with no operator schema nor type stub)
        layout = layout_of(op, generate.RESERVED)
        assert layout.signature is None and layout.checked == set(range(FALLBACK_POSITIONS))


def test_every_patched_op_is_a_generated_function_keeping_the_originals_identity():
    originals = {(t.owner, t.name): getattr(t.owner, t.name) for t in find([], lists.NAMESPACES)}
    o4()
    for (owner, name), original in originals.items():
        fn = vars(owner).get(name, getattr(owner, name))
        assert is_patch(fn), name
        assert fn.__wrapped__ is original and fn.__name__ == original.__name__
        assert fn.__code__.co_filename.startswith("<ampatch o1 function")


# ----------------------------------------------------------------- the fast path
def recorder() -> tuple[list, types.FunctionType]:
    calls: list = []

    def op(*args, **kwargs):
        calls.append((args, kwargs))
        return args

    return calls, op


def context() -> WrapContext:
    return WrapContext(lambda dtype: (lambda t: t.to(dtype)), BF16, Counters(), allow_banned=False)


def test_a_call_with_nothing_to_convert_passes_the_callers_own_objects_and_counts_nothing():
    calls, op = recorder()
    ctx = context()
    fn = wrap(HALF, "op", op, ctx)
    x, w, ints, f64 = torch.ones(2, dtype=BF16), torch.ones(2, dtype=BF16), torch.arange(2), torch.ones(2).double()
    fn(x, w, ints, f64)
    fn(x, [w, ints], scale=0.5)
    assert all(a is b for a, b in zip(calls[0][0], (x, w, ints, f64)))
    assert calls[1][0][0] is x and calls[1][0][1][0] is w and calls[1][1] == {"scale": 0.5}
    assert ctx.counters.snapshot() == {}


def test_a_builtins_function_passes_exactly_the_arguments_given():
    """Positional defaults mean "not given": the op sees as many arguments as the caller passed."""
    o4()
    x = torch.randn(3, 4)
    assert torch.softmax(x, 1).dtype == F32 and torch.softmax(x.bfloat16(), 1).dtype == F32
    assert torch.softmax(x.bfloat16(), 1, torch.float64).dtype == torch.float64
    with pytest.raises(TypeError, match="softmax"):  # the op's own error: no argument given
        torch.softmax()


# ----------------------------------------------------------------- every call form casts the same
def test_keyword_extra_positional_and_deprecated_calls_cast_like_positional_ones():
    o4()
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(3, 3, generator=g) for _ in range(3))
    expected = torch.ops.aten.addmm(c.bfloat16(), a.bfloat16(), b.bfloat16())
    forms = {
        "positional": torch.addmm(c, a, b),
        "keywords": torch.addmm(c, a, mat2=b),
        "method": c.addmm(a, b),
        "deprecated 4-arg": torch.addmm(1, c, a, b),        # beta first: b sits where out_dtype would
        "deprecated 5-arg": torch.addmm(1, c, 1, a, b),     # more positional arguments than any schema
    }
    for name, out in forms.items():
        assert out.dtype == BF16 and torch.equal(out, expected), name
    assert F.linear(a, weight=b).dtype == BF16 and F.softmax(a.bfloat16(), dim=-1).dtype == F32


def test_a_python_function_keeps_its_signature_and_binds_keywords_as_it_would():
    original = F.softmax
    o4()
    assert F.softmax is not original and inspect.signature(F.softmax) == inspect.signature(original)
    x = torch.randn(2, 3).bfloat16()
    assert torch.equal(F.softmax(x, dim=0), original(x.float(), 0))
    assert F.layer_norm(x, normalized_shape=[3], eps=1e-3).dtype == F32


# ----------------------------------------------------------------- the same casts as before, bitwise
class Block(nn.Module):
    """Linear, LayerNorm, GELU, an operator, a method, a loss and a tied weight (used twice)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.norm, self.out = nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.gelu(self.inp(x))
        y = (self.norm(y) @ self.out.weight.t()).softmax(-1)
        return F.mse_loss(F.linear(y, self.inp.weight), torch.ones(4, 8))

    def by_hand(self, x: torch.Tensor) -> torch.Tensor:
        """The same, with O1's casts written out: each parameter cast once, the tied one reused."""
        w, b = self.inp.weight.to(BF16), self.inp.bias.to(BF16)
        y = F.gelu(F.linear(x.to(BF16), w, b))
        y = F.layer_norm(y.float(), (8,), self.norm.weight, self.norm.bias)
        y = (y.to(BF16) @ self.out.weight.t().to(BF16)).float().softmax(-1)
        return F.mse_loss(F.linear(y.to(BF16), w).float(), torch.ones(4, 8))


def test_outputs_and_gradients_equal_casting_by_hand_bitwise():
    torch.manual_seed(0)
    model, x = Block(), torch.randn(4, 8)
    manual = Block()
    manual.load_state_dict(model.state_dict())
    loss_ref = manual.by_hand(x)
    loss_ref.backward()
    opt = o4(model)
    for _ in range(2):  # the second iteration runs on a cleared cache
        opt.zero_grad()
        loss = model(x)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        assert loss.dtype == F32 and torch.equal(loss, loss_ref)
        for p, q in zip(model.parameters(), manual.parameters()):
            if q.grad is None:  # out.bias: unused
                assert p.grad is None
            else:
                assert p.grad.dtype == F32 and torch.equal(p.grad, q.grad)


def test_without_torchs_type_stubs_a_builtin_checks_every_position(monkeypatch):
    """The stubs are what name the deprecated signatures' tensor positions: without them, every
    position is checked (`torch.addmm(beta, input, mat1, mat2)` still casts mat2)."""
    from ampatch.o1 import signatures

    monkeypatch.setattr(signatures, "_STUBS", ("_C/no_such_stub.pyi",))
    signatures._stub_signatures.cache_clear()
    signatures._cached_layout.cache_clear()
    try:
        assert layout_of(torch.addmm, generate.RESERVED).checked == {0, 1, 2, 3}
    finally:
        monkeypatch.undo()
        signatures._stub_signatures.cache_clear()
        signatures._cached_layout.cache_clear()
    assert layout_of(torch.addmm, generate.RESERVED).checked == {0, 1, 2, 3, 4}
