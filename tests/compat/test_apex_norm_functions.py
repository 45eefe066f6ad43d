"""Apex's normalization autograd Functions (`apex.normalization.fused_layer_norm.Fused*Function`)
on torch's kernels: `.apply` with Apex's signatures, values and gradients equal to torch's
forms (input, weight, bias; each gradient in its tensor's dtype), the mixed-dtype variants
returning the input's dtype, and a DeepLearningExamples-style BERT layer, whose layer norm
calls `FusedLayerNormAffineFunction.apply`, training at O1 and O2 under the Apex alias."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampatch
from ampatch.compat.normalization import fused_layer_norm as fln

EPS = 1e-5
DTYPES = [torch.float32, torch.bfloat16]
# bfloat16 values differ from torch's only by the order of a few roundings
TOL = {torch.float32: {}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


def _tensors(dtype: torch.dtype, weight_dtype: torch.dtype | None = None, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 5, 4, 6, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(4, 6, generator=g)).to(weight_dtype or dtype)
    b = (0.1 * torch.randn(4, 6, generator=g)).to(weight_dtype or dtype)
    return x, w, b


def _value_and_grads(fn, tensors: list[torch.Tensor]):
    """fn's output and the gradients of a fixed weighted sum of it, for each tensor."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    g = torch.Generator().manual_seed(1)
    (out.float() * torch.randn(out.shape, generator=g)).sum().backward()
    return out, [leaf.grad for leaf in leaves]


def _check(function, torch_form, tensors, dtype) -> None:
    out, grads = _value_and_grads(function, tensors)
    ref, ref_grads = _value_and_grads(torch_form, tensors)
    assert out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, **TOL[dtype])
    for t, grad, ref_grad in zip(tensors, grads, ref_grads):
        assert grad is not None and grad.dtype == t.dtype
        torch.testing.assert_close(grad, ref_grad, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [6, [4, 6]], ids=["int", "list"])
def test_layer_norm_functions_equal_torch(dtype: torch.dtype, shape) -> None:
    x, w, b = _tensors(dtype)
    if isinstance(shape, int):
        w, b = w[0], b[0]
    torch_shape = (shape,) if isinstance(shape, int) else tuple(shape)
    _check(lambda x, w, b: fln.FusedLayerNormAffineFunction.apply(x, w, b, shape, EPS),
           lambda x, w, b: F.layer_norm(x, torch_shape, w, b, EPS), [x, w, b], dtype)
    _check(lambda x: fln.FusedLayerNormFunction.apply(x, shape, EPS),
           lambda x: F.layer_norm(x, torch_shape, None, None, EPS), [x], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [6, [4, 6]], ids=["int", "list"])
def test_rms_norm_functions_equal_torch(dtype: torch.dtype, shape) -> None:
    x, w, _ = _tensors(dtype)
    if isinstance(shape, int):
        w = w[0]
    torch_shape = (shape,) if isinstance(shape, int) else tuple(shape)
    _check(lambda x, w: fln.FusedRMSNormAffineFunction.apply(x, w, shape, EPS),
           lambda x, w: F.rms_norm(x, torch_shape, w, EPS), [x, w], dtype)
    _check(lambda x: fln.FusedRMSNormFunction.apply(x, shape, EPS),
           lambda x: F.rms_norm(x, torch_shape, None, EPS), [x], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_mixed_dtype_functions_compute_in_fp32_and_return_the_inputs_dtype(dtype: torch.dtype) -> None:
    x, w, b = _tensors(dtype, weight_dtype=torch.float32)
    shape = [4, 6]
    _check(lambda x, w, b: fln.FusedLayerNormAffineMixedDtypesFunction.apply(x, w, b, shape, EPS),
           lambda x, w, b: F.layer_norm(x.float(), tuple(shape), w, b, EPS).to(x.dtype), [x, w, b], dtype)
    _check(lambda x, w: fln.FusedRMSNormAffineMixedDtypesFunction.apply(x, w, shape, EPS),
           lambda x, w: F.rms_norm(x.float(), tuple(shape), w, EPS).to(x.dtype), [x, w], dtype)
    out = fln.FusedLayerNormAffineMixedDtypesFunction.apply(x, w, b, shape, EPS)
    assert out.dtype == dtype and w.dtype == torch.float32
    # Apex's class hierarchy: the mixed forms are the affine Functions with another forward
    assert issubclass(fln.FusedRMSNormAffineMixedDtypesFunction, fln.FusedRMSNormAffineFunction)


def test_every_function_is_an_autograd_function_with_apexs_memory_efficient_argument() -> None:
    names = [n for n in fln.__all__ if n.endswith("Function")]
    assert len(names) == 6
    x, w, b = _tensors(torch.float32)
    args = {"FusedLayerNorm": (x, w, b), "FusedRMSNorm": (x, w), "": (x,)}
    for name in names:
        cls = getattr(fln, name)
        assert issubclass(cls, torch.autograd.Function), name
        tensors = (x,) if "Affine" not in name else args[name[:name.index("Affine")]]
        plain = cls.apply(*tensors, [4, 6], EPS)
        torch.testing.assert_close(cls.apply(*tensors, [4, 6], EPS, True), plain)  # memory_efficient=True


def test_only_the_tensors_that_need_it_get_a_gradient_and_no_grad_builds_nothing() -> None:
    x, w, b = _tensors(torch.float32)
    x.requires_grad_()
    fln.FusedLayerNormAffineFunction.apply(x, w, b, [4, 6], EPS).sum().backward()
    assert x.grad is not None and w.grad is None and b.grad is None
    with torch.no_grad():
        assert fln.FusedLayerNormAffineFunction.apply(x, w, b, [4, 6], EPS).grad_fn is None


def test_retain_graph_and_in_place_use_of_the_output() -> None:
    x, w, b = (t.requires_grad_() for t in _tensors(torch.float32))
    out = fln.FusedLayerNormAffineFunction.apply(x, w, b, [4, 6], EPS)
    out.mul_(2)  # a residual add or scale in place, as model code does
    loss = (out * out).sum()
    loss.backward(retain_graph=True)
    first = [t.grad.clone() for t in (x, w, b)]
    loss.backward()  # the second pass through the retained graph: gradients accumulate
    for t, grad in zip((x, w, b), first):
        torch.testing.assert_close(t.grad, 2 * grad)
    with pytest.raises(RuntimeError):
        loss.backward()  # freed, as torch's own graphs are


def test_under_o1_a_half_input_runs_in_fp32_and_gradients_keep_their_dtypes(half: torch.dtype) -> None:
    model = nn.Linear(6, 6)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ampatch.initialize(model, opt, opt_level="O1", verbosity=0)
    try:
        x = torch.randn(5, 6).to(half).requires_grad_()
        w, b = torch.ones(6, requires_grad=True), torch.zeros(6, requires_grad=True)
        out = fln.FusedLayerNormAffineFunction.apply(x, w, b, 6, EPS)
        ref = F.layer_norm(x, (6,), w, b, EPS)  # ampatch's O1 runs layer_norm in FP32
        assert out.dtype == ref.dtype == torch.float32
        torch.testing.assert_close(out, ref)
        out.sum().backward()
        assert (x.grad.dtype, w.grad.dtype, b.grad.dtype) == (half, torch.float32, torch.float32)
        assert all(torch.isfinite(t.grad).all() for t in (x, w, b))
        mixed = fln.FusedLayerNormAffineMixedDtypesFunction.apply(x, w, b, 6, EPS)
        assert mixed.dtype == half
    finally:
        ampatch.deinitialize()


def _bert_block(FusedLayerNormAffineFunction) -> nn.Module:  # noqa: N803 - Apex's name
    class BertLayerNorm(nn.Module):
        """DeepLearningExamples' BERT: the layer norm module over Apex's autograd Function."""

        def __init__(self, hidden_size: int, eps: float = 1e-12) -> None:
            super().__init__()
            self.normalized_shape = torch.Size((hidden_size,))
            self.eps = eps
            self.weight = nn.Parameter(torch.ones(hidden_size))
            self.bias = nn.Parameter(torch.zeros(hidden_size))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return FusedLayerNormAffineFunction.apply(x, self.weight, self.bias, self.normalized_shape, self.eps)

    class Block(nn.Module):
        def __init__(self, hidden: int = 32, classes: int = 4) -> None:
            super().__init__()
            self.embed = nn.Linear(16, hidden)
            self.norm1 = BertLayerNorm(hidden)
            self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
            self.norm2 = BertLayerNorm(hidden)
            self.head = nn.Linear(hidden, classes)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.norm1(self.embed(x))
            h = self.norm2(h + self.down(F.gelu(self.up(h))))
            return self.head(h.mean(dim=1))

    return Block()


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_bert_layer_over_the_function_trains_under_the_apex_alias(apex_alias, opt_level: str) -> None:
    from apex import amp
    from apex.normalization.fused_layer_norm import FusedLayerNormAffineFunction
    assert FusedLayerNormAffineFunction is fln.FusedLayerNormAffineFunction
    torch.manual_seed(0)
    model = _bert_block(FusedLayerNormAffineFunction)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    try:
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(16, 8, 16, generator=g), torch.randint(0, 4, (16,), generator=g)
        losses = []
        for _ in range(20):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x).float(), y)
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
                norm = model.norm1  # the Function's gradients reached the model's parameters
                assert norm.weight.grad is not None and norm.weight.grad.dtype == norm.weight.dtype
                assert norm.bias.grad is not None and torch.isfinite(norm.bias.grad.float()).all()
            optimizer.step()
            losses.append(loss.item())
        assert all(torch.isfinite(torch.tensor(losses))), losses
        assert losses[-1] < 0.5 * losses[0], losses
    finally:
        amp.deinitialize()
