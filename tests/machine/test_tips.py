"""ampatch.machine.tips: the dtype-mismatch hint, checked against real torch error messages,
and the float16 eps warning initialize gives (`hardware.eps_lost_in_float16`)."""
from __future__ import annotations

import pytest
import torch
from _config import props
from torch import nn
from torch.nn import functional as F

from ampatch.machine import hardware, tips


def _error(fn) -> BaseException:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - whatever torch raises
        return exc
    pytest.fail("expected a dtype error")


f32 = torch.randn(4, 4)
bf16 = f32.bfloat16()
f16 = f32.half()
MISMATCHES = {
    "torch.mm": lambda: torch.mm(f32, bf16),
    "torch.addmm": lambda: torch.addmm(f32, f32, bf16),
    "torch.bmm": lambda: torch.bmm(f32[None], f16[None]),
    "torch.dot": lambda: torch.dot(f32[0], bf16[0]),
    "torch.mv": lambda: torch.mv(bf16, f32[0]),
    "torch.index_put": lambda: f32.index_put((torch.tensor([0]),), bf16[0:1]),
    "torch.Tensor.index_add": lambda: f32.index_add(0, torch.tensor([0]), bf16[0:1]),
    "torch.Tensor.scatter_": lambda: f32.clone().scatter_(0, torch.tensor([[0]]), bf16[:1, :1]),
    "torch.Tensor.masked_scatter": lambda: f32.masked_scatter(f32 > 0, bf16),
    "torch.nn.functional.linear": lambda: F.linear(f16, f32),
    "torch.nn.functional.conv2d": lambda: F.conv2d(torch.randn(1, 1, 4, 4).bfloat16(),
                                                   torch.randn(1, 1, 3, 3).bfloat16(), torch.randn(1)),
    "torch.nn.functional.bilinear": lambda: F.bilinear(f32, bf16, torch.randn(2, 4, 4)),
    "torch.nn.functional.scaled_dot_product_attention":
        lambda: F.scaled_dot_product_attention(f32[None], bf16[None], f32[None]),
    "torch.nn.functional.cross_entropy": lambda: F.cross_entropy(bf16, torch.tensor([0, 1, 2, 3]), weight=f32[0]),
    "torch.einsum": lambda: torch.einsum("ij,jk->ik", f32, bf16),
    "torch.tensordot": lambda: torch.tensordot(f32, f16, 1),
    "torch.lerp": lambda: torch.lerp(f32, bf16, 0.5),
    "torch.nn.functional.prelu": lambda: F.prelu(bf16, f32[0, :1]),
    "torch.nn.LSTM.forward": lambda: nn.LSTM(4, 4)(bf16[None]),
}


@pytest.mark.parametrize("op", list(MISMATCHES))
def test_dtype_mismatch_errors_get_a_registration_hint(op: str) -> None:
    exc = _error(MISMATCHES[op])
    hint = tips.explain_dtype_error(exc, op)
    assert hint is not None, f"{type(exc).__name__}: {exc}"
    module, _, name = op.rpartition(".")
    assert f'amp.register_promote_function({module}, "{name}")' in hint
    assert f'amp.register_float_function({module}, "{name}")' in hint


@pytest.mark.parametrize("make", [
    lambda: torch.mm(torch.randn(2, 3), torch.randn(2, 3)),                     # shape, not dtype
    lambda: torch.randn(2).index_put_((torch.tensor([0]),), torch.tensor([1.0], dtype=torch.float64)),
    lambda: torch.tensor([1, 2]).index_put_((torch.tensor([0]),), torch.tensor([1], dtype=torch.int32)),
    lambda: F.embedding(torch.tensor([0.5]), torch.randn(3, 2)),                # not a float-mixing error
], ids=["shape", "double", "int", "embedding"])
def test_other_errors_get_no_hint(make) -> None:
    assert tips.explain_dtype_error(_error(make), "torch.x") is None


def test_hint_message_shapes_and_attach_once() -> None:
    assert tips.explain_dtype_error(KeyError("expected scalar type Half"), "torch.mm") is None
    generic = tips.explain_dtype_error(RuntimeError("expected scalar type Float but found Half"))
    assert 'register_promote_function(module, "function_name")' in generic
    bare = tips.explain_dtype_error(RuntimeError("mat1 and mat2 must have the same dtype, got Half"), "fused")
    assert 'register_float_function(module, "fused")' in bare
    assert tips.explain_dtype_error(RuntimeError("both inputs should have same dtype"), "torch.x")  # no types named
    assert tips.explain_dtype_error(RuntimeError("expected scalar type Long but found Int"), "torch.x") is None

    exc = _error(MISMATCHES["torch.mm"])
    tips.hint_dtype_error(exc, "torch.mm")
    tips.hint_dtype_error(exc, "torch.matmul")  # an outer patched call: no second hint
    text = str(exc) + "".join(getattr(exc, "__notes__", []))
    assert text.count("ampatch:") == 1 and '"mm"' in text and "matmul" not in text
    assert tips.explain_dtype_error(exc, "torch.mm") is None


def test_qualified_name() -> None:
    assert tips.qualified_name(torch, "mm") == "torch.mm"
    assert tips.qualified_name(torch.Tensor, "index_put_") == "torch.Tensor.index_put_"
    assert tips.qualified_name(torch.nn.functional, "linear") == "torch.nn.functional.linear"
    assert tips.qualified_name(torch.linalg, "matmul") == "torch.linalg.matmul"


# ----------------------------------------------------------------- wired into the library
class _UserOps:
    @staticmethod
    def mix(a):
        buf = torch.zeros(2, 2)  # an FP32 buffer meets a half input in an unpatched op
        buf[torch.tensor([0, 1])] = a
        return buf


def _notes(exc: BaseException) -> str:
    return "\n".join(getattr(exc, "__notes__", [])) + str(exc)


def test_hint_on_dtype_error_in_registered_function():
    import ampatch as amp
    from ampatch.o1.lists import user
    amp.register_half_function(_UserOps, "mix")
    try:
        amp.initialize(torch.nn.Linear(2, 2), opt_level="O4", verbosity=0)
        with pytest.raises(RuntimeError) as info:
            _UserOps.mix(torch.ones(2, 2))
        assert "register_float_function" in _notes(info.value) and "_UserOps.mix" in _notes(info.value)
    finally:
        user.REGISTERED[:] = [r for r in user.REGISTERED if r[0] is not _UserOps]


def test_hint_on_dtype_error_in_decorated_function():
    import ampatch as amp

    @amp.half_function
    def mix(a):
        return _UserOps.mix(a)

    amp.initialize(torch.nn.Linear(2, 2), opt_level="O4", verbosity=0)
    with pytest.raises(RuntimeError) as info:
        mix(torch.ones(2, 2))
    assert "register_promote_function" in _notes(info.value)


def test_hint_on_dtype_error_in_o2_forward():
    import ampatch as amp

    class WithConstant(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
            self.const = torch.ones(2, 2)  # a plain attribute: not cast with the model

        def forward(self, x):
            return self.lin(x) @ self.const

    model = amp.initialize(WithConstant(), opt_level="O5", verbosity=0)
    with pytest.raises(RuntimeError) as info:
        model(torch.ones(1, 2))
    assert "ampatch" in _notes(info.value)


# ----------------------------------------------------------------- O2/O3/O5: hints that help there
class _ConstantNet(torch.nn.Module):
    """The usual O2 trap: an FP32 tensor the model cast does not reach, used in forward."""

    def __init__(self, fix: str = "") -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.fix = fix
        if fix == "buffer":
            self.register_buffer("const", torch.ones(4, 4))  # buffers are cast with the model
        else:
            self.const = torch.ones(4, 4)  # a plain attribute: not cast

    def forward(self, x):
        h = self.lin(x)
        const = self.const.to(h.dtype) if self.fix == "cast" else self.const
        return h @ const


class _Fp32HeadNet(torch.nn.Module):
    """A layer kept in FP32 on purpose (after initialize), called on a half activation."""

    def __init__(self, fix: bool = False) -> None:
        super().__init__()
        self.body = torch.nn.Linear(4, 8)
        self.head = torch.nn.Linear(8, 2)
        self.fix = fix

    def forward(self, x):
        h = self.body(x)
        return self.head(h.float() if self.fix else h)


def _o2_error(model, level: str) -> BaseException:
    import ampatch as amp
    model = amp.initialize(model, opt_level=level, verbosity=0)
    if isinstance(model, _Fp32HeadNet):
        model.head.float()  # "keep the op's module in FP32"
    with pytest.raises(RuntimeError) as info:
        model(torch.randn(3, 4))
    return info.value


@pytest.mark.parametrize("level", ["O2", "O3", "O5"])
def test_cast_model_hint_names_what_helps_there_not_registrations(level: str) -> None:
    exc = _o2_error(_ConstantNet(), level)
    text = _notes(exc)
    half = "bfloat16" if level == "O5" else str(amp_half_for(level)).removeprefix("torch.")
    assert f"a {half} tensor met an FP32 one" in text
    for helps in ("t.to(x.dtype)", "register_buffer", "keep_fp32=", ".float()", 'opt_level="O1"',
                  "cast_model_outputs"):
        assert helps in text, helps
    # the O1 registrations are named only as what does NOT help here
    assert "register_promote_function(" not in text and "register_float_function(" not in text
    assert "change nothing here" in text


def amp_half_for(level: str) -> torch.dtype:
    return props(level).half_dtype


@pytest.mark.parametrize("level", ["O2", "O3", "O5"])
def test_the_fixes_the_cast_model_hint_names_fix_the_repro(level: str) -> None:
    import ampatch as amp
    _o2_error(_ConstantNet(), level)  # the repro fails ...
    for fix in ("cast", "buffer"):    # ... cast the tensor, or make it a buffer: it runs
        torch.manual_seed(0)
        model = amp.initialize(_ConstantNet(fix), opt_level=level, verbosity=0)
        out = model(torch.randn(3, 4))
        assert out.dtype == torch.float32 and torch.isfinite(out).all()
    torch.manual_seed(0)
    model = amp.initialize(_ConstantNet(), opt_level="O1", verbosity=0)  # ... or use O1
    assert torch.isfinite(model(torch.randn(3, 4))).all()

    # a layer that must run in FP32: the hint says keep_fp32, which fixes it with no change to forward
    assert 'keep_fp32=["name"]' in _notes(_o2_error(_Fp32HeadNet(), level))
    model = amp.initialize(_Fp32HeadNet(), opt_level=level, keep_fp32=["head"], verbosity=0)
    out = model(torch.randn(3, 4))
    assert out.dtype == torch.float32 and model.head.weight.dtype == torch.float32


def test_o1_hint_is_unchanged_by_the_model_dtype_argument() -> None:
    exc = _error(MISMATCHES["torch.mm"])
    assert "register_promote_function(torch, \"mm\")" in tips.explain_dtype_error(exc, "torch.mm")
    model_hint = tips.explain_dtype_error(exc, "torch.mm", model_dtype=torch.float16)
    assert "a float16 tensor met an FP32 one" in model_hint and "register_promote_function(" not in model_hint


# ------------------------------------------------------------------ eps lost in float16
class Tagger(nn.Module):
    """An embedding whose rows outside the batch get a gradient of exactly 0."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.out = nn.Linear(4, 3)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(idx))


def _first_step(level: str, half: torch.dtype, **adam) -> tuple[bool, list[str]]:
    import warnings

    import ampatch as amp

    torch.manual_seed(0)
    model = Tagger()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **adam)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=half, verbosity=1)
    with amp.scale_loss(model(torch.tensor([[1, 2]])).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    amp.deinitialize()
    return finite, [str(w.message) for w in caught if "eps" in str(w.message)]


def test_float16_steps_with_an_eps_float16_rounds_to_zero_warn() -> None:
    """O3 float16 + AdamW's eps=1e-8: torch's own float16 AdamW turns the untouched embedding
    rows NaN at the first step (model.half() does the same); the warning names the way out."""
    finite, warned = _first_step("O3", torch.float16)
    assert not finite and len(warned) == 1
    assert "eps=1e-08" in warned[0] and "O2" in warned[0] and "1e-4" in warned[0]
    assert hardware.eps_lost_in_float16([torch.optim.AdamW(Tagger().half().parameters())]) == [
        "optimizers[0] (AdamW) param group 0: eps=1e-08"]


@pytest.mark.parametrize("level,half,adam", [
    ("O3", torch.float16, {"eps": 1e-4}),   # an eps float16 can hold
    ("O3", torch.bfloat16, {}),             # bfloat16 holds 1e-8
    ("O2", torch.float16, {}),              # FP32 masters: the optimizer steps FP32
    ("O3", torch.float16, {"fused": True}),  # the fused kernel adds eps in FP32
], ids=["eps1e-4", "bf16", "O2", "fused"])
def test_no_eps_warning_where_the_step_is_safe(level, half, adam) -> None:
    finite, warned = _first_step(level, half, **adam)
    assert finite and warned == []
