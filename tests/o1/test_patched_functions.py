"""O1/O4: patched torch functions cast their inputs; deinitialize undoes every patch."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

import ampatch as amp

LOW = (torch.float16, torch.bfloat16)


def o1(half, *models, **kw):
    """initialize at O1 with the given half dtype; models get a throwaway SGD."""
    ms = list(models) or [nn.Linear(2, 2)]
    opt = torch.optim.SGD([p for m in ms for p in m.parameters()], lr=0.1)
    amp.initialize(ms, opt, opt_level="O1", half_dtype=half, verbosity=0, **kw)
    return opt


# ----------------------------------------------------------------- op coverage
def test_module_linear_output_half_grad_fp32(half):
    lin = nn.Linear(8, 4)
    o1(half, lin)
    out = lin(torch.randn(3, 8))
    assert out.dtype == half
    out.float().sum().backward()
    assert lin.weight.dtype == torch.float32 and lin.weight.grad.dtype == torch.float32


@pytest.mark.parametrize("call", [
    lambda x, w: F.linear(x, w),
    lambda x, w: torch.mm(x, w.t()),
    lambda x, w: torch.matmul(x, w.t()),
    lambda x, w: x.matmul(w.t()),
    lambda x, w: x @ w.t(),
    lambda x, w: torch.Tensor.matmul(x, w.t()),
    lambda x, w: torch.linalg.matmul(x, w.t()),
    lambda x, w: torch.einsum("ij,kj->ik", x, w),
    lambda x, w: torch.bmm(x[None], w.t()[None])[0],
    lambda x, w: torch.addmm(torch.zeros(3, 4), x, w.t()),
], ids=["F.linear", "mm", "matmul", "method", "operator", "unbound", "linalg", "einsum", "bmm", "addmm"])
def test_half_ops_functions_methods_operators(half, call):
    o1(half)
    x = torch.randn(3, 8, requires_grad=True)
    w = torch.randn(4, 8, requires_grad=True)
    out = call(x, w)
    assert out.dtype == half
    out.float().sum().backward()
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32


@pytest.mark.parametrize("call", [
    lambda x: F.softmax(x, -1),
    lambda x: x.softmax(-1),
    lambda x: torch.log_softmax(x, -1),
    lambda x: x ** 2,
    lambda x: 2 ** x,
    lambda x: torch.exp(x),
    lambda x: x.sum(),
    lambda x: F.layer_norm(x, (8,)),
    lambda x: F.mse_loss(x, torch.zeros(3, 8)),
    lambda x: F.cross_entropy(x, torch.tensor([1, 2, 3])),
], ids=["F.softmax", "Tensor.softmax", "log_softmax", "__pow__", "__rpow__", "exp", "sum", "layer_norm",
        "mse_loss", "cross_entropy"])
def test_float_ops_run_in_fp32(half, call):
    o1(half)
    x = torch.randn(3, 8).to(half).requires_grad_()
    out = call(x)
    assert out.dtype == torch.float32
    out.sum().backward()
    assert x.grad.dtype == half  # gradients reaching a tensor have its dtype


def test_unlisted_ops_keep_dtype_and_native_promotion(half):
    o1(half)
    h = torch.randn(4).to(half)
    f = torch.randn(4)
    assert torch.relu(h).dtype == half
    assert (h + f).dtype == torch.float32  # torch promotes natively; no wrapper needed
    assert torch.cat([h, f]).dtype == torch.float32


def test_promote_ops(half):
    o1(half)
    h = torch.randn(4).to(half)
    f = torch.randn(4, requires_grad=True)
    assert torch.dot(h, f).dtype == torch.float32
    assert torch.dot(f, h).dtype == torch.float32
    target = torch.zeros(5, dtype=half)
    target.index_put_((torch.tensor([0, 2]),), torch.ones(2))  # in-place: others cast to self's dtype
    assert target.dtype == half and target[2].item() == 1
    bil = nn.Bilinear(4, 4, 2)
    out = bil(h[None], torch.randn(1, 4))
    assert out.dtype == torch.float32  # promoted to the widest input instead of failing


def test_float64_and_integer_tensors_are_never_cast(half):
    o1(half)
    d = torch.randn(3, 3, dtype=torch.float64)
    assert torch.mm(d, d).dtype == torch.float64
    emb = nn.Embedding(10, 4)
    idx = torch.tensor([1, 2])
    assert emb(idx).dtype == torch.float32
    assert torch.softmax(d, 0).dtype == torch.float64


def test_attention(half):
    o1(half)
    q = torch.randn(2, 4, 5, 8)
    assert F.scaled_dot_product_attention(q, q, q).dtype == half
    mha = nn.MultiheadAttention(16, 2, batch_first=True)
    amp.deinitialize()
    o1(half, mha)
    x = torch.randn(2, 5, 16)
    out, _ = mha(x, x, x)
    assert out.dtype == half
    out.float().sum().backward()
    assert mha.in_proj_weight.grad.dtype == torch.float32


def test_transformer_layer_trains(half):
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0)
    opt = torch.optim.AdamW(layer.parameters(), 1e-3)
    layer, opt = amp.initialize(layer, opt, opt_level="O1", half_dtype=half, verbosity=0)
    x = torch.randn(2, 6, 16)
    before = layer.linear1.weight.detach().clone()
    loss = layer(x).float().pow(2).mean()
    with amp.scale_loss(loss, opt) as s:
        s.backward()
    opt.step()
    assert not torch.equal(before, layer.linear1.weight)
    assert all(p.dtype == torch.float32 for p in layer.parameters())


# ----------------------------------------------------------------- RNNs
@pytest.mark.parametrize("cls", [nn.RNN, nn.LSTM, nn.GRU])
@pytest.mark.parametrize("input_dtype", ["fp32", "half"])
def test_rnn_modules_run_in_half(half, cls, input_dtype):
    rnn = cls(4, 6, num_layers=2, batch_first=True)
    o1(half, rnn)
    x = torch.randn(3, 5, 4)
    if input_dtype == "half":
        x = x.to(half)
    out, _ = rnn(x)
    assert out.dtype == half
    out.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in rnn.parameters())


def test_lstm_packed_sequence_and_hidden_state(half):
    rnn = nn.LSTM(4, 6)
    o1(half, rnn)
    x = torch.randn(5, 3, 4)
    packed = pack_padded_sequence(x, torch.tensor([5, 3, 2]))
    hx = (torch.zeros(1, 3, 6), torch.zeros(1, 3, 6))
    out, (h, c) = rnn(packed, hx)
    assert out.data.dtype == half and h.dtype == half
    out.data.float().sum().backward()
    assert rnn.weight_ih_l0.grad.dtype == torch.float32
    assert rnn._flat_weights[0] is rnn.weight_ih_l0  # the swap is undone after the call


@pytest.mark.parametrize("cls", [nn.RNNCell, nn.LSTMCell, nn.GRUCell])
def test_rnn_cells_run_in_half(half, cls):
    cell = cls(4, 6)
    o1(half, cell)
    out = cell(torch.randn(3, 4))
    out = out[0] if isinstance(out, tuple) else out
    assert out.dtype == half
    out.float().sum().backward()
    assert cell.weight_ih.grad.dtype == torch.float32


# ----------------------------------------------------------------- the cast cache
def _cache():
    from ampatch.session.session import current
    return current().cache


def test_cache_casts_each_param_once_per_iteration(half):
    lin = nn.Linear(4, 4)
    opt = o1(half, lin)
    x = torch.randn(2, 4)
    a, b = lin(x), lin(x)
    cache = _cache()
    assert cache.misses == 2 and cache.hits == 2  # weight and bias, cast once, reused once
    with amp.scale_loss((a.float() + b.float()).sum(), opt) as s:
        s.backward()
    assert len(cache) == 0  # cleared on scale_loss exit
    assert lin.weight.grad.dtype == torch.float32


def test_cache_never_serves_a_stale_weight_after_in_place_update(half):
    lin = nn.Linear(4, 4, bias=False)
    o1(half, lin)
    x = torch.ones(1, 4)
    first = lin(x)
    with torch.no_grad():
        lin.weight.add_(1.0)  # no scale_loss in between
    second = lin(x)
    expected = (x @ lin.weight.t()).to(half)
    assert torch.allclose(second.float(), expected.float(), rtol=1e-2)
    assert not torch.allclose(first.float(), second.float())


def test_cache_train_eval_train(half):
    lin = nn.Linear(4, 4)
    opt = o1(half, lin)
    x = torch.randn(2, 4)
    with torch.no_grad():  # eval first: the cast made here has no graph
        lin(x)
    out = lin(x)
    assert out.requires_grad
    out.float().sum().backward()
    assert lin.weight.grad is not None
    lin.weight.grad = None
    with amp.scale_loss(lin(x).float().sum(), opt) as s:
        s.backward()
    assert lin.weight.grad is not None


def test_optimizer_step_runs_with_casts_disabled(half):
    seen = []

    class Probe(torch.optim.SGD):
        def step(self, closure=None):
            p = self.param_groups[0]["params"][0]
            seen.append(torch.mm(p.detach(), p.detach().t()).dtype)
            return super().step(closure)

    lin = nn.Linear(3, 3)
    opt = Probe(lin.parameters(), lr=0.1)
    lin, opt = amp.initialize(lin, opt, opt_level="O1", half_dtype=half, verbosity=0, loss_scale=128.0)
    with amp.scale_loss(lin(torch.randn(2, 3)).float().sum(), opt) as s:
        s.backward()
    opt.step()
    assert seen == [torch.float32]
    assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype == half  # casts back on after step


# ----------------------------------------------------------------- banned functions
def test_banned_binary_cross_entropy(half):
    o1(half)
    p = torch.sigmoid(F.linear(torch.randn(4, 3), torch.randn(1, 3)))  # half
    with pytest.raises(NotImplementedError, match="BCEWithLogitsLoss"):
        F.binary_cross_entropy(p, torch.ones(4, 1))
    with pytest.raises(NotImplementedError, match="allow_banned"):
        nn.BCELoss()(p, torch.ones(4, 1))
    # FP32 inputs are fine, as in Apex: nothing to protect
    assert F.binary_cross_entropy(torch.full((4, 1), 0.5), torch.ones(4, 1)).dtype == torch.float32


def test_allow_banned_runs_in_fp32(half):
    o1(half, allow_banned=True)
    p = torch.sigmoid(F.linear(torch.randn(4, 3), torch.randn(1, 3)))
    assert F.binary_cross_entropy(p, torch.ones(4, 1)).dtype == torch.float32


def test_register_float_sigmoid_makes_bce_safe(half):
    amp.register_float_function(torch, "sigmoid")
    try:
        o1(half)
        p = torch.sigmoid(F.linear(torch.randn(4, 3), torch.randn(1, 3)))
        assert p.dtype == torch.float32
        assert F.binary_cross_entropy(p, torch.ones(4, 1)).dtype == torch.float32
    finally:
        from ampatch.o1.lists import user
        user.REGISTERED[:] = [r for r in user.REGISTERED if r[1] != "sigmoid"]


# ----------------------------------------------------------------- registration and decorators
class _Ops:
    """A user namespace with functions to register."""

    @staticmethod
    def mix(a, b):
        return a * 2 + b

    @staticmethod
    def other(a):
        return a + 1


def test_register_half_function_persists_across_sessions(half):
    from ampatch.o1.lists import user
    amp.register_half_function(_Ops, "mix")
    try:
        original = vars(_Ops)["mix"]
        o1(half)
        assert _Ops.mix(torch.ones(2), torch.ones(2)).dtype == half
        amp.deinitialize()
        assert vars(_Ops)["mix"] is original
        assert _Ops.mix(torch.ones(2), torch.ones(2)).dtype == torch.float32
        o1(half)  # the registration is policy: still there
        assert _Ops.mix(torch.ones(2), torch.ones(2)).dtype == half
    finally:
        user.REGISTERED[:] = [r for r in user.REGISTERED if r[0] is not _Ops]


def test_register_after_initialize_applies_now(half):
    from ampatch.o1.lists import user
    o1(half)
    try:
        amp.register_promote_function(_Ops, "other")
        amp.register_bfloat16_function(_Ops, "mix")
        assert _Ops.mix(torch.ones(2), torch.ones(2)).dtype == torch.bfloat16
    finally:
        user.REGISTERED[:] = [r for r in user.REGISTERED if r[0] is not _Ops]


def test_register_unknown_name_raises():
    with pytest.raises(ValueError, match="no attribute"):
        amp.register_half_function(torch, "definitely_not_a_function")


@pytest.mark.parametrize("decorator,expected", [
    (amp.half_function, "half"), (amp.float_function, torch.float32),
    (amp.bfloat16_function, torch.bfloat16), (amp.promote_function, torch.float32)])
def test_decorators(half, decorator, expected):
    @decorator
    def f(a, b):
        return a.to(torch.float64) * 0 + a if a.dtype != b.dtype else a + b

    @decorator
    def dtype_of(a, b):
        return a.dtype, b.dtype

    a, b = torch.ones(2), torch.ones(2, dtype=half)
    assert dtype_of(a, b) == (torch.float32, half)  # no session: untouched
    o1(half)
    want = half if expected == "half" else expected
    assert dtype_of(a, b) == (want, want)
    assert f.__name__ == "f"


# ----------------------------------------------------------------- switches, threads, levels
def test_disable_casts_is_per_thread(half):
    o1(half)
    x = torch.randn(2, 2)
    seen = {}

    def worker():
        seen["thread"] = torch.mm(x, x).dtype

    with amp.disable_casts():
        assert torch.mm(x, x).dtype == torch.float32
        t = threading.Thread(target=worker)
        t.start()
        t.join()
    assert seen["thread"] == half
    assert torch.mm(x, x).dtype == half


def test_casts_apply_in_worker_threads_and_counters_are_exact(half):
    lin = nn.Linear(4, 4)
    o1(half, lin)
    x = torch.randn(2, 4)
    results = []

    def worker():
        for _ in range(50):
            results.append(lin(x).dtype)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(results) == {half} and len(results) == 200
    assert amp.report().casts["linear"][str(half).removeprefix("torch.")] == 200


def test_o1_resolves_bfloat16_on_cpu_and_o4_is_bfloat16():
    lin = nn.Linear(2, 2)
    amp.initialize(lin, opt_level="O1", verbosity=0)
    assert lin(torch.randn(1, 2)).dtype == torch.bfloat16
    amp.initialize(lin, opt_level="O4", verbosity=0)
    assert lin(torch.randn(1, 2)).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="float16"):
        amp.initialize(lin, opt_level="O4", half_dtype=torch.float16)


def test_o0_and_o2_do_not_patch_torch():
    before = torch.mm
    amp.initialize(nn.Linear(2, 2), opt_level="O0", verbosity=0)
    assert torch.mm is before
    amp.initialize(nn.Linear(2, 2), opt_level="O2", verbosity=0)
    assert torch.mm is before


# ----------------------------------------------------------------- deinitialize identity
def _snapshot():
    owners = [torch, F, torch.Tensor, torch.linalg, torch._VF, nn.RNN, nn.LSTM, nn.GRU]
    return [(o, dict(vars(o))) for o in owners]


def _assert_same(snapshot):
    for owner, before in snapshot:
        after = vars(owner)
        assert after.keys() == before.keys(), (owner, set(after) ^ set(before))
        changed = [k for k in before if after[k] is not before[k]]
        assert not changed, (owner, changed[:5])


@pytest.mark.parametrize("levels", [["O1"], ["O1", "O4", "O1"], ["O4", "O2", "O1", "O0"]])
def test_deinitialize_restores_every_attribute_identically(levels):
    snap = _snapshot()
    tensor_attrs = {n: getattr(torch.Tensor, n) for n in ("matmul", "__matmul__", "__pow__", "__rpow__", "softmax")}
    model = nn.Sequential(nn.Linear(2, 2), nn.LSTM(2, 2))
    for level in levels:
        amp.initialize(model[0], opt_level=level, verbosity=0)
    assert torch.Tensor.matmul is not tensor_attrs["matmul"] or levels[-1] in ("O0", "O2")
    amp.deinitialize()
    _assert_same(snap)
    for name, obj in tensor_attrs.items():
        assert getattr(torch.Tensor, name) is obj
    assert "matmul" not in vars(torch.Tensor)  # inherited from TensorBase: deleted, not set


def test_initialize_with_no_optimizer_returns_models_only():
    lin = nn.Linear(2, 2)
    assert amp.initialize(lin, opt_level="O1", verbosity=0) is lin
    assert amp.initialize([lin], opt_level="O1", verbosity=0) == [lin]


def test_report_counts_casts_and_prints():
    lin = nn.Linear(4, 4)
    opt = torch.optim.SGD(lin.parameters(), 0.1)
    amp.initialize(lin, opt, opt_level="O4", verbosity=0)
    with amp.scale_loss(F.mse_loss(lin(torch.randn(2, 4)), torch.zeros(2, 4)), opt) as s:
        s.backward()
    opt.step()
    r = amp.report()
    d = r.to_dict()
    assert d["casts"]["linear"] == {"bfloat16": 1}
    assert d["casts"]["mse_loss"] == {"float32": 1}
    assert d["steps"] == 1 and d["skipped_steps"] == []
    assert "linear" in str(r) and "O4" in str(r)


def test_calls_before_initialize_raise():
    with pytest.raises(RuntimeError, match="initialize"):
        with amp.scale_loss(torch.ones(()), torch.optim.SGD([torch.zeros(1, requires_grad=True)], 0.1)):
            pass
    with pytest.raises(RuntimeError, match="initialize"):
        amp.report()


def test_wrapper_timing_is_opt_in(monkeypatch):
    lin = nn.Linear(4, 4)
    amp.initialize(lin, opt_level="O4", verbosity=0)
    lin(torch.randn(2, 4))
    assert amp.report().time_s["wrappers"] is None
    assert "not measured" in str(amp.report())
    monkeypatch.setenv("AMPATCH_TIME_WRAPPERS", "1")
    amp.initialize(lin, opt_level="O4", verbosity=0)
    assert lin(torch.randn(2, 4)).dtype == torch.bfloat16
    assert amp.report().time_s["wrappers"] > 0
    h = torch.ones(3, dtype=torch.bfloat16)  # the timed paths cast like the untimed ones
    assert torch.softmax(h, 0).dtype == torch.float32
    assert torch.dot(h, torch.ones(3)).dtype == torch.float32
    with pytest.raises(NotImplementedError):
        F.binary_cross_entropy(torch.full((2,), 0.5, dtype=torch.bfloat16), torch.ones(2))


def test_promote_casts_tensor_keyword_arguments(half):
    o1(half)
    x = torch.zeros(3, 2)
    out = torch.index_add(x, 0, torch.tensor([0, 2]), source=torch.ones(2, 2, dtype=half))
    assert out.dtype == torch.float32 and out[2, 0].item() == 1
    assert amp.report().casts["index_add"] == {"float32": 1}


def test_registration_overrides_the_builtin_policy(half):
    from ampatch.o1.lists import user
    amp.register_half_function(torch, "exp")  # a built-in FLOAT op
    try:
        o1(half)
        assert torch.exp(torch.ones(2)).dtype == half
    finally:
        user.REGISTERED[:] = [r for r in user.REGISTERED if r[1] != "exp"]
    amp.deinitialize()
    o1(half)
    assert torch.exp(torch.ones(2, dtype=half)).dtype == torch.float32
