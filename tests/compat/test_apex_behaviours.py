"""What Apex's own amp tests (tests/L0/run_amp) check, as ampatch tests on CPU, for both half
dtypes: basic casts and banned functions through `amp.init`, promotion, the cast cache across
train/eval/train with an `_amp_state` scale override, RNNs, `add_param_group` and several
models/losses/optimizers with `cast_model_type=False` and injected overflows, per-loss scale
decrease, and checkpoints across levels. Plus the two documented differences, pinned, and
`Tensor.cpu()` returning FP32 as in Apex.
"""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import Parameter

import ampatch as amp

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
HALVES = pytest.mark.parametrize("half", [F16, BF16], ids=["fp16", "bf16"])


@pytest.fixture(autouse=True)
def _flags():
    amp._amp_state.allow_incoming_model_not_fp32 = False
    yield
    amp._amp_state.allow_incoming_model_not_fp32 = False


def _check(fn, expected: dict, shape: tuple, backward: bool = True) -> None:
    """fn(x) for x of each dtype in `expected` has the expected dtype; grads keep x's dtype."""
    for dtype, out_dtype in expected.items():
        x = torch.randn(shape, dtype=dtype).requires_grad_()
        y = fn(x)
        assert y.dtype == out_dtype, (dtype, y.dtype)
        if backward:
            y.float().sum().backward()
            assert x.grad.dtype == dtype


# ------------------------------------------------------------------ casts through amp.init
@HALVES
def test_layers_cast_as_apex_listed_them(half) -> None:
    handle = amp.init(patch_type=half)
    always_half, always_float = {F32: half, half: half}, {F32: F32, half: F32}
    match = {F32: F32, half: half}
    lin, conv = nn.Linear(8, 8), nn.Conv2d(2, 2, 3)
    for fn in (lin, lambda x: F.linear(x, lin.weight, lin.bias)):
        _check(fn, always_half, (4, 8))
    _check(conv, always_half, (2, 2, 5, 5))
    for fn in (nn.Softmax(dim=1), lambda x: F.softmax(x, dim=1), lambda x: F.mse_loss(x, torch.randn(4, 8))):
        _check(fn, always_float, (4, 8))
    _check(nn.GroupNorm(2, 4), always_float, (2, 4, 3, 3))
    for fn in (nn.ReLU(), F.relu):
        _check(fn, match, (4, 8))
    bn = nn.BatchNorm2d(4)
    _check(bn, match, (2, 4, 3, 3))
    bn.eval()
    _check(lambda x: F.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias), match, (2, 4, 3, 3),
           backward=False)
    other = torch.randn(8, 8)
    for fn in (lambda x: x.matmul(other), lambda x: other.matmul(x), lambda x: x @ other, lambda x: other @ x):
        _check(fn, always_half, (8, 8))
    for fn in (lambda x: x.pow(2.0), lambda x: x ** 2.0, lambda x: x.sum()):
        _check(fn, always_float, (4, 8))
    handle._deactivate()
    assert F.linear(torch.randn(2, 8), lin.weight).dtype == F32


@HALVES
def test_banned_function_raises_unless_allowed(half) -> None:
    target = torch.rand(4, 8)
    fns = (lambda x: nn.BCELoss()(x, target), lambda x: F.binary_cross_entropy(x, target))
    handle = amp.init(patch_type=half)
    for fn in fns:
        with pytest.raises(NotImplementedError, match="binary_cross_entropy_with_logits"):
            fn(torch.rand(4, 8, dtype=half))
    handle._deactivate()
    handle = amp.init(patch_type=half, allow_banned=True)
    for fn in fns:
        assert fn(torch.rand(4, 8, dtype=half)).dtype == F32
    handle._deactivate()


@HALVES
def test_promotion_matches_the_widest_type(half) -> None:
    handle = amp.init(patch_type=half)
    for fn in (torch.atan2, torch.mul, lambda x, y: x.mul(y), lambda x, y: x.atan2(y)):
        for xt, yt in itertools.product((half, F32), repeat=2):
            x = torch.randn(4, dtype=xt).requires_grad_()
            out = fn(x, torch.randn(4, dtype=yt))
            assert out.dtype == (F32 if F32 in (xt, yt) else half)
            out.float().sum().backward()
            assert x.grad.dtype == xt
    ys = [torch.randn(4, dtype=half) for _ in range(3)]
    assert torch.cat(ys + [torch.randn(4)]).dtype == F32 and torch.cat(ys).dtype == half
    for xt, yt in itertools.product((half, F32), repeat=2):  # in place: self's type
        x = torch.randn(4, dtype=xt).requires_grad_()
        out = x.clone().add_(torch.randn(4, dtype=yt))
        assert out.dtype == xt
        out.float().sum().backward()
        assert x.grad.dtype == xt
    handle._deactivate()


@HALVES
def test_rnns_run_in_half(half) -> None:
    handle = amp.init(patch_type=half)
    for cell, state in ((nn.RNNCell(8, 8), False), (nn.GRUCell(8, 8), False), (nn.LSTMCell(8, 8), True)):
        for dtype in (F32, half):
            x = torch.randn(3, 8, dtype=dtype).requires_grad_()
            h = (torch.zeros(3, 8, dtype=dtype),) * 2 if state else torch.zeros(3, 8, dtype=dtype)
            out = cell(x, h)
            out = out[0] if state else out
            assert out.dtype == half
            out.float().sum().backward()
            assert x.grad.dtype == dtype
    for rnn, tuple_state in ((nn.GRU(8, 8, num_layers=2, bidirectional=True), False), (nn.LSTM(8, 8), True)):
        layers = rnn.num_layers * (2 if rnn.bidirectional else 1)
        for dtype in (F32, half):
            x = torch.randn(4, 3, 8, dtype=dtype).requires_grad_()
            h = torch.zeros(layers, 3, 8, dtype=dtype)
            out, _ = rnn(x, (h, h) if tuple_state else h)
            assert out.dtype == half
            out[-1].float().sum().backward()
            assert x.grad.dtype == dtype
    handle._deactivate()


# ------------------------------------------------------------------ .cpu(), and the documented differences
LEVELS = ["O0", "O1", "O2", "O3", "O4", "O5"]


@pytest.mark.parametrize("level", LEVELS)
@HALVES
def test_logits_cpu_numpy_works_at_every_level(level, half) -> None:
    """Every Transformers 2.x/3.x evaluation loop: `logits.detach().cpu().numpy()`. Under O1/O4
    `.cpu()` of a half tensor is FP32, as Apex's was; at the other levels the model's outputs
    are FP32 already."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    half_kw = {} if level in ("O0", "O4", "O5") else {"half_dtype": half}
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0, **half_kw)
    try:
        logits = model(torch.randn(2, 4))
        array = logits.detach().cpu().numpy()
        assert array.shape == (2, 3) and str(array.dtype) == "float32"
        x = torch.randn(3).to(half)
        if level in ("O1", "O4"):
            assert x.cpu().dtype == F32 and x.numpy().dtype.name == "float32"
            assert x.to("cpu").dtype == half  # only Apex's `cpu` casts
        else:
            assert x.cpu().dtype == half
    finally:
        amp.deinitialize()
    assert torch.randn(2).to(half).cpu().dtype == half  # plain PyTorch again


@HALVES
def test_the_documented_differences(half) -> None:
    handle = amp.init(patch_type=half)
    x = torch.randn(4, dtype=half)
    assert x.cpu().dtype == F32  # as in Apex: no longer a difference
    y = x.clone()
    y.exp_()  # Apex raised NotImplementedError; plain PyTorch runs it in the tensor's dtype
    assert y.dtype == half and torch.allclose(y.float(), x.float().exp(), rtol=1e-2)
    handle._deactivate()
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O1", verbosity=0)
    amp.initialize(nn.Linear(2, 2), opt_level="O1", verbosity=0)  # ends the first session
    with pytest.raises(RuntimeError, match="ends the earlier session"):
        with amp.scale_loss(model(torch.ones(1, 2)).sum(), opt):
            pass


# ------------------------------------------------------------------ the cast cache, train/eval/train
class Whitelist(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = Parameter(torch.arange(16.0).view(4, 4).div(8).to(dtype))

    @staticmethod
    def ops(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x.mm(w).mm(w).sum()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops(x, self.weight)


class Blacklist(Whitelist):
    @staticmethod
    def ops(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x + torch.pow(w, 2) + torch.pow(w, 2)).sum()


class Promote(Whitelist):
    @staticmethod
    def ops(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x * w * w).sum()


@pytest.mark.parametrize("module", [Whitelist, Blacklist, Promote])
@pytest.mark.parametrize("level, weight", [("O1", F16), ("O1", F32), ("O4", BF16), ("O4", F32)])
def test_cache_across_train_eval_train(module, level, weight, monkeypatch) -> None:
    monkeypatch.setenv("AMPATCH_HALF_DTYPE", "float16")  # O1 as Apex ran it; O4 stays bfloat16
    x = torch.ones(4, 4)
    model = module(weight)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    amp._amp_state.allow_incoming_model_not_fp32 = True
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)

    def step() -> None:
        model.weight.grad = None
        loss = model(x).sum()
        amp._amp_state.loss_scalers[0]._loss_scale = 4.0
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        assert model.weight.grad.dtype == weight
        w = model.weight.detach().clone().float().requires_grad_()
        model.ops(x.clone(), w).backward()  # not a Parameter: never cached
        torch.testing.assert_close(model.weight.grad.float(), w.grad)
        model.weight.data -= 1.0  # an in-place update the cache must see

    step()
    with torch.no_grad():
        model(x)
    step()
    amp._amp_state.handle._deactivate()


# ------------------------------------------------------------------ cast_model_type=False, several models
class Pair(nn.Module):
    """An FP32 weight and a half one, as in Apex's tests."""

    def __init__(self, unique: int, half: torch.dtype = F16) -> None:
        super().__init__()
        self.weight0 = Parameter(unique + torch.arange(2.0))
        self.weight1 = Parameter((1.0 + unique + torch.arange(2.0)).to(half))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.weight0.float() * self.weight1.float()).sum()


def _zero(models, optimizer, how: str) -> None:
    if how == "none":
        for m in models:
            for p in m.parameters():
                p.grad = None
    elif how == "model":
        for m in models:
            m.zero_grad()
    else:
        optimizer.zero_grad()


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3", "O4", "O5"])
def test_add_param_group_with_an_uncast_model(level) -> None:
    half = BF16 if level in ("O4", "O5") else F16
    x = torch.ones(2)

    def run(use_amp: bool, how: str, accumulate: bool) -> list[torch.Tensor]:
        m0, m1 = Pair(1, half), Pair(2, half)
        opt = torch.optim.SGD([{"params": m0.parameters(), "lr": 0.25}], momentum=0.125)
        if use_amp:
            amp._amp_state.allow_incoming_model_not_fp32 = True
            [m0, m1], opt = amp.initialize([m0, m1], opt, opt_level=level, cast_model_type=False, verbosity=0)
            amp._amp_state.loss_scalers[0]._loss_scale = 4.0

        def backward(loss: torch.Tensor, retain: bool = False) -> None:
            if use_amp:
                with amp.scale_loss(loss, opt) as scaled:
                    scaled.backward(retain_graph=retain)
            else:
                loss.backward(retain_graph=retain)

        _zero([m0, m1], opt, how)
        backward(m0(x))
        opt.step()
        opt.add_param_group({"params": m1.parameters(), "lr": 0.5})
        for _ in range(2):  # twice: the new params pick up momentum
            _zero([m0, m1], opt, how)
            loss = m0(x) + m1(x)
            backward(loss, retain=accumulate)
            if accumulate:
                backward(loss)
            opt.step()
        return [p.detach().clone() for p in (*m0.parameters(), *m1.parameters())]

    for how, accumulate in itertools.product(("none", "model", "optimizer"), (False, True)):
        reference = run(False, "optimizer", accumulate)
        final = run(True, how, accumulate)
        for r, f in zip(reference, final):
            assert f.dtype == r.dtype
            torch.testing.assert_close(f.float(), r.float(), rtol=2e-2, atol=2e-2, msg=f"{how} {accumulate}")
        amp.deinitialize()


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("where", ["fp16", "fp32"])
@pytest.mark.parametrize("num_losses", [1, 2])
def test_two_models_two_losses_injected_overflow_skips_one_step(level, where, num_losses, monkeypatch) -> None:
    monkeypatch.setenv("AMPATCH_HALF_DTYPE", "float16")
    x = torch.ones(2)

    def train(use_amp: bool, inject_at: int) -> tuple[list, list]:
        m0, m1 = Pair(1), Pair(2)
        opt = torch.optim.SGD([{"params": m0.parameters(), "lr": 0.25}, {"params": m1.parameters(), "lr": 0.5}],
                              momentum=0.125)
        if use_amp:
            amp._amp_state.allow_incoming_model_not_fp32 = True
            [m0, m1], opt = amp.initialize([m0, m1], opt, opt_level=level, cast_model_type=False,
                                           num_losses=num_losses, verbosity=0)
            for i, s in enumerate(amp._amp_state.loss_scalers):
                s._loss_scale = 4.0 * 4 ** i
        grads = []
        for it in range(3):
            opt.zero_grad()
            if not use_amp:
                if it == inject_at:
                    continue  # the skipped step
                (m0(x) + m1(x)).backward()
                grads.append([p.grad.clone() for p in (*m0.parameters(), *m1.parameters())])
                opt.step()
                continue
            with amp.scale_loss(m0(x), opt, loss_id=0) as scaled:
                scaled.backward()
            with amp.scale_loss(m1(x), opt, loss_id=num_losses - 1) as scaled:
                scaled.backward()
                if it == inject_at:
                    (m1.weight1 if where == "fp16" else m1.weight0).grad[0] = float("inf")
            if it != inject_at:
                grads.append([p.grad.clone() for p in amp.master_params(opt)])
            opt.step()
        params = [p.detach().clone() for p in (*m0.parameters(), *m1.parameters())]
        if use_amp:
            for p, master in zip(params, amp.master_params(opt)):
                assert torch.equal(p, master.detach().to(p.dtype))
        return grads, params

    ref_grads, ref_params = train(False, inject_at=1)
    grads, params = train(True, inject_at=1)
    assert len(grads) == len(ref_grads) == 2
    for got, want in zip(itertools.chain(*grads), itertools.chain(*ref_grads)):
        torch.testing.assert_close(got.float(), want.float())
    for got, want in zip(params, ref_params):
        torch.testing.assert_close(got, want)
    scales = [s.loss_scale() for s in amp._amp_state.loss_scalers]
    assert scales[-1] == 4.0 * 4 ** (num_losses - 1) / 2  # the scaler of the overflowing loss halved
    amp._amp_state.handle._deactivate()


def test_two_optimizers_skip_only_where_the_overflow_was(monkeypatch) -> None:
    monkeypatch.setenv("AMPATCH_HALF_DTYPE", "float16")
    m0, m1 = Pair(1), Pair(2)
    o0 = torch.optim.SGD(m0.parameters(), lr=0.25)
    o1 = torch.optim.SGD(m1.parameters(), lr=0.5)
    amp._amp_state.allow_incoming_model_not_fp32 = True
    [m0, m1], [o0, o1] = amp.initialize([m0, m1], [o0, o1], opt_level="O2", cast_model_type=False, num_losses=2,
                                        verbosity=0)
    for view in amp._amp_state.loss_scalers:
        view._loss_scale = 16.0  # 2**16 * a gradient of 2 would overflow the float16 param's own grad
    before = [[p.detach().clone() for p in m.parameters()] for m in (m0, m1)]
    x = torch.ones(2)
    with amp.scale_loss(m0(x), o0, loss_id=0) as scaled:
        scaled.backward()
        m0.weight1.grad[0] = float("inf")
    with amp.scale_loss(m1(x), o1, loss_id=1) as scaled:
        scaled.backward()
    o0.step()
    o1.step()
    assert all(torch.equal(b, p) for b, p in zip(before[0], m0.parameters()))  # skipped
    assert all(not torch.equal(b, p) for b, p in zip(before[1], m1.parameters()))  # stepped


# ------------------------------------------------------------------ loss scales per loss, checkpoints
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.param = nn.Parameter(torch.ones(1))  # 1.0: x * 2**17 overflows float16 at every level

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(F.relu(self.conv(x * self.param)))


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_each_loss_scale_decreases_on_its_own_overflows(level, monkeypatch) -> None:
    monkeypatch.setenv("AMPATCH_HALF_DTYPE", "float16")
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level=level, num_losses=3, verbosity=0)
    assert amp._amp_state.opt_properties.loss_scale == "dynamic"
    overflows = [0, 1, 2]  # loss i overflows in its first i iterations
    for _ in range(2):
        opt.zero_grad()
        x = torch.randn(2, 3, 6, 6)
        for i in range(3):
            out = model(x * 2 ** 17 if overflows[i] > 0 else x)
            overflows[i] = max(overflows[i] - 1, 0)
            with amp.scale_loss(out.mean(), opt, loss_id=i) as scaled:  # a half mean: FP32 loss
                scaled.backward(retain_graph=True)
        opt.step()
    assert [s.loss_scale() for s in amp._amp_state.loss_scalers] == [2.0 ** 16, 2.0 ** 15, 2.0 ** 14]
    assert [v["unskipped"] for v in amp.state_dict().values()] == [2, 1, 0]


@pytest.mark.parametrize("level, restore_level", [("O1", "O2"), ("O2", "O1"), ("O2", "O2"), ("O3", "O0")])
def test_checkpoints_are_fp32_and_load_across_levels(level, restore_level, monkeypatch) -> None:
    monkeypatch.setenv("AMPATCH_HALF_DTYPE", "float16")
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level=level, num_losses=2, verbosity=0)
    x = torch.randn(2, 3, 6, 6)
    for _ in range(2):
        opt.zero_grad()
        out = model(x)
        with amp.scale_loss(out.mean(), opt, loss_id=0) as scaled:
            scaled.backward(retain_graph=True)
        with amp.scale_loss(2 * out.mean(), opt, loss_id=1) as scaled:
            scaled.backward()
        opt.step()
    checkpoint = {"model": model.state_dict(), "optimizer": opt.state_dict(), "amp": amp.state_dict()}
    # exact FP32 values where they are kept (masters, buffers); at O3 the float16 params, the only copy
    params = {n for n, _ in model.named_parameters()}
    assert all(v.dtype == (torch.float16 if level == "O3" and k in params else F32)
               for k, v in checkpoint["model"].items() if "num_batches" not in k)
    restored = Net()
    restored_opt = torch.optim.SGD(restored.parameters(), lr=1e-3)
    restored, restored_opt = amp.initialize(restored, restored_opt, opt_level=restore_level, num_losses=2,
                                            verbosity=0)
    restored.load_state_dict(checkpoint["model"])
    restored_opt.load_state_dict(checkpoint["optimizer"])
    amp.load_state_dict(checkpoint["amp"])
    assert amp.state_dict() == checkpoint["amp"]
    for k, v in restored.state_dict().items():
        torch.testing.assert_close(v.float(), checkpoint["model"][k].float(), rtol=1e-3, atol=1e-3)
