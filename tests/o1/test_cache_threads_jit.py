"""O1/O4 reliability: the cast cache, RNNs under threads, TorchScript, and the
crashes found by running torch's autocast op lists against the O1 policy."""
from __future__ import annotations

import gc
import io
import threading
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampatch as amp

LOW = (torch.bfloat16, torch.float16)


def o1(half, *models, **kw):
    ms = list(models) or [nn.Linear(2, 2)]
    opt = torch.optim.SGD([p for m in ms for p in m.parameters()], lr=0.1)
    amp.initialize(ms, opt, opt_level="O1", half_dtype=half, verbosity=0, **kw)
    return opt


def _cache():
    from ampatch.session.session import current
    return current().cache


# ----------------------------------------------------------------- D6: stale casts without a version bump
def _reference(lin: nn.Linear, x: torch.Tensor, half: torch.dtype) -> torch.Tensor:
    with amp.disable_casts():
        return F.linear(x.to(half), lin.weight.to(half), lin.bias.to(half))


@pytest.mark.parametrize("change", ["data_copy", "data_assign", "vector_to_parameters"])
def test_cache_sees_weight_changes_without_a_version_bump(half, change):
    lin = nn.Linear(4, 4)
    o1(half, lin)
    x = torch.randn(3, 4)
    new = [torch.randn_like(p) for p in lin.parameters()]
    with torch.no_grad():
        first = lin(x)
        if change == "data_copy":
            for p, n in zip(lin.parameters(), new):
                p.data.copy_(n)
        elif change == "data_assign":
            for p, n in zip(lin.parameters(), new):
                p.data = n.clone()
        else:
            torch.nn.utils.vector_to_parameters(torch.cat([n.reshape(-1) for n in new]), lin.parameters())
        second = lin(x)
    assert torch.equal(second, _reference(lin, x, half))
    assert not torch.equal(first, second)


def test_ema_evaluation_between_steps(half):
    """Evaluate the raw weights, swap in the EMA weights through .data, evaluate again, swap back."""
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = o1(half, model)
    ema = [p.detach().clone() * 0.5 for p in model.parameters()]
    x = torch.randn(5, 4)
    for _ in range(2):
        with amp.scale_loss(model(x).float().pow(2).mean(), opt) as s:
            s.backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            raw = model(x)
            backup = [p.data.clone() for p in model.parameters()]
            for p, e in zip(model.parameters(), ema):
                p.data.copy_(e)
            averaged = model(x)
            with amp.disable_casts():
                expected = model(x)  # FP32, EMA weights
            for p, b in zip(model.parameters(), backup):
                p.data.copy_(b)
            again = model(x)
        assert not torch.allclose(raw.float(), averaged.float())
        assert torch.allclose(averaged.float(), expected, rtol=5e-2, atol=5e-2)
        assert torch.equal(again, raw)


# ----------------------------------------------------------------- D10: dropped models are freed
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_inference_session_does_not_pin_dropped_models(half, mode):
    amp.initialize(nn.Linear(2, 2), opt_level="O1", half_dtype=half, verbosity=0)  # inference only
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode
    refs = []
    for _ in range(3):
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        refs.append(weakref.ref(model[0].weight))
        with context():
            out = model(torch.randn(2, 8))
            out = model(torch.randn(2, 8))  # the second call is served from the cache
        assert out.dtype == half
        del model, out
    gc.collect()
    assert all(r() is None for r in refs)
    assert len(_cache()) == 0


def test_cache_entries_made_with_grad_go_at_the_iteration_boundary(half):
    model = nn.Linear(4, 4)
    opt = o1(half, model)
    ref = weakref.ref(model.weight)
    with amp.scale_loss(model(torch.randn(2, 4)).float().sum(), opt) as s:
        s.backward()
    assert len(_cache()) == 0
    del model, s, opt
    amp.deinitialize()
    gc.collect()
    assert ref() is None


# ----------------------------------------------------------------- D7: one RNN module, many threads
@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
def test_one_rnn_module_called_from_several_threads(cls):
    rnn = cls(8, 16, num_layers=2, batch_first=True)
    o1(torch.bfloat16, rnn)
    x = torch.randn(2, 5, 8)
    errors, dtypes = [], []
    start = threading.Barrier(4)

    def worker():
        start.wait()
        try:
            for _ in range(25):
                out, _ = rnn(x)
                dtypes.append(out.dtype)
                with amp.disable_casts():  # an FP32 call in the middle of the others
                    dtypes.append(rnn(x)[0].dtype)
        except Exception as exc:  # noqa: BLE001 - collected and reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:1]
    assert dtypes.count(torch.bfloat16) == dtypes.count(torch.float32) == 100
    assert all(w is p for w, p in zip(rnn._flat_weights, rnn.parameters()))
    amp.deinitialize()
    assert rnn(x)[0].dtype == torch.float32


def test_rnn_call_that_fails_leaves_the_module_intact(half):
    rnn = nn.LSTM(4, 6)
    o1(half, rnn)
    with pytest.raises(RuntimeError):
        rnn(torch.randn(5, 3, 5))  # wrong input size
    assert all(w is p for w, p in zip(rnn._flat_weights, rnn.parameters()))
    assert rnn(torch.randn(5, 3, 4))[0].dtype == half


# ----------------------------------------------------------------- D5 / D19: TorchScript
class _WithLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


def test_jit_script_under_o1_compiles_torch_ops_and_leaves_nothing_behind(half, caplog):
    lin = nn.Linear(4, 4)
    o1(half, lin)
    with caplog.at_level("WARNING", logger="ampatch"):
        amp.initialize(lin, opt_level="O1", half_dtype=half, verbosity=1)
        scripted = torch.jit.script(lin)
    assert "torch.jit.script" in caplog.text  # says that scripted code runs without casts
    assert "aten::linear" in str(scripted.graph) and "^" not in str(scripted.graph)  # no call back into Python
    x = torch.randn(2, 4)
    assert scripted(x).dtype == torch.float32
    torch.jit.save(scripted, io.BytesIO())  # no Python op: it can be saved
    lstm = torch.jit.script(_WithLSTM())  # the patched RNN forward scripts as torch's, overloads and all
    assert lstm(torch.randn(3, 2, 4)).dtype == torch.float32
    amp.deinitialize()
    again = torch.jit.script(nn.Linear(4, 4))  # TorchScript's cached nn.Linear type is clean
    assert again(x).dtype == torch.float32
    torch.jit.save(again, io.BytesIO())


def test_jit_trace_under_o1_records_the_casts(half):
    model = nn.Sequential(nn.Linear(4, 4), nn.Softmax(-1), nn.Linear(4, 2))
    opt = o1(half, model)
    x = torch.randn(3, 4)
    eager = model(x)  # fills the cache: its casts were made outside the trace
    traced = torch.jit.trace(model, x)
    assert traced(x).dtype == half
    assert torch.equal(traced(x), eager)
    assert "aten::to" in str(traced.inlined_graph)
    with amp.scale_loss(model(x).float().sum(), opt) as s:  # training goes on after the trace
        s.backward()
    opt.step()


# ----------------------------------------------------------------- pooling and padding on CPU
POOL_AND_PAD = {
    "avg_pool1d": lambda x: F.avg_pool1d(x[..., 0, 0], 2),
    "avg_pool2d": lambda x: F.avg_pool2d(x[..., 0], 2),
    "avg_pool3d": lambda x: F.avg_pool3d(x, 2),
    "avg_pool3d_4d": lambda x: F.avg_pool3d(x[0], 2),
    "avg_pool3d_options": lambda x: F.avg_pool3d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False),
    "lp_pool3d": lambda x: F.lp_pool3d(x, 2, 2),
    "max_pool1d": lambda x: F.max_pool1d(x[..., 0, 0], 2),
    "max_pool2d": lambda x: F.max_pool2d(x[..., 0], 2),
    "max_pool3d": lambda x: F.max_pool3d(x, 2),
    "adaptive_avg_pool3d": lambda x: F.adaptive_avg_pool3d(x, 2),
    "adaptive_max_pool3d": lambda x: F.adaptive_max_pool3d(x, 2),
    "fractional_max_pool3d": lambda x: F.fractional_max_pool3d(x, 2, output_size=(2, 2, 2)),
    "max_unpool3d": lambda x: F.max_unpool3d(*F.max_pool3d(x, 2, return_indices=True), 2),
    "reflection_pad1d": lambda x: F.pad(x[..., 0, 0], (1, 1), mode="reflect"),
    "reflection_pad2d": lambda x: F.pad(x[..., 0], (1, 1, 1, 1), mode="reflect"),
    "reflection_pad3d": lambda x: F.pad(x, (1, 1, 1, 1, 1, 1), mode="reflect"),
    "replication_pad1d": lambda x: F.pad(x[..., 0, 0], (1, 1), mode="replicate"),
    "replication_pad2d": lambda x: F.pad(x[..., 0], (1, 1, 1, 1), mode="replicate"),
    "replication_pad3d": lambda x: F.pad(x, (1, 1, 1, 1, 1, 1), mode="replicate"),
}


@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last_3d"])
@pytest.mark.parametrize("op", sorted(POOL_AND_PAD))
def test_pooling_and_padding_run_on_cpu_in_both_half_dtypes(half, op, channels_last):
    conv = nn.Conv3d(2, 3, 1)
    o1(half, conv)
    x = torch.randn(2, 2, 4, 4, 4)
    if channels_last:
        x = x.to(memory_format=torch.channels_last_3d)
    h = conv(x)  # half, as in a network
    assert h.dtype == half
    out = POOL_AND_PAD[op](h)
    out.float().sum().backward()
    assert conv.weight.grad.dtype == torch.float32


def test_avg_pool3d_module_matches_cpu_autocast(half):
    net = nn.Sequential(nn.Conv3d(2, 3, 3, padding=1), nn.AvgPool3d(2))
    x = torch.randn(2, 2, 4, 4, 4)
    with torch.autocast("cpu", dtype=half):
        expected = net(x).dtype
    o1(half, net)
    assert net(x).dtype == expected == torch.float32
    assert amp.report().casts["avg_pool3d"] == {"float32": 1}


@pytest.mark.cuda
def test_avg_pool3d_stays_half_on_cuda():
    net = nn.Sequential(nn.Conv3d(2, 3, 3, padding=1), nn.AvgPool3d(2)).cuda()
    amp.initialize(net, opt_level="O1", half_dtype=torch.float16, verbosity=0)
    assert net(torch.randn(2, 2, 4, 4, 4, device="cuda")).dtype == torch.float16


# ----------------------------------------------------------------- the transformer fast path
@pytest.mark.parametrize("input_dtype", ["fp32", "half"])
def test_transformer_inference_fast_path_runs_in_half(half, input_dtype):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0)
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0), 2,
                                    enable_nested_tensor=False)
    mha = nn.MultiheadAttention(16, 2, batch_first=True)
    o1(half, layer, encoder, mha)
    x = torch.randn(2, 5, 16)
    if input_dtype == "half":
        x = x.to(half)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    for m in (layer, encoder, mha):
        m.eval()
    calls = {
        "layer": lambda: layer(x),
        "encoder": lambda: encoder(x, src_key_padding_mask=pad),
        "mha": lambda: mha(x, x, x, need_weights=False)[0],
    }
    for name, call in calls.items():
        slow = call()  # gradients enabled: the per-op path
        with torch.no_grad():
            fast = call()  # the fused path
        assert fast.dtype == half, name
        valid = slice(None) if name != "encoder" else (0,)
        assert torch.allclose(fast[valid].float(), slow[valid].float(), rtol=0.1, atol=0.1), name
    casts = amp.report().casts
    assert "_transformer_encoder_layer_fwd" in casts  # the fused path ran, in half
    if input_dtype == "fp32":  # (MHA takes its fused path only when the input's dtype is the weights')
        assert "_native_multi_head_attention" in casts


# ----------------------------------------------------------------- the policy notes, checked
def test_linalg_norms_are_fp32_while_cpu_autocast_leaves_them():
    b = torch.randn(4, 4).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the note: not registered on CPU
        assert torch.linalg.vector_norm(b).dtype == torch.bfloat16
        assert torch.linalg.matrix_norm(b).dtype == torch.bfloat16
        assert torch.linalg.inv(b + 4 * torch.eye(4).bfloat16()).dtype == torch.float32  # in the CPU list
    amp.initialize(nn.Linear(2, 2), opt_level="O4", verbosity=0)
    assert torch.linalg.vector_norm(b).dtype == torch.float32
    assert torch.linalg.matrix_norm(b).dtype == torch.float32


def test_grid_sample_runs_in_fp32_like_cpu_autocast():
    image, grid = torch.randn(1, 1, 8, 8).bfloat16(), (torch.rand(1, 4, 4, 2) * 2 - 1).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.grid_sample(image, grid, align_corners=False).dtype == torch.float32
    amp.initialize(nn.Linear(2, 2), opt_level="O4", verbosity=0)
    assert F.grid_sample(image, grid, align_corners=False).dtype == torch.float32  # all-bfloat16 inputs too
    assert F.grid_sample(image.float(), grid, align_corners=False).dtype == torch.float32


def test_binary_cross_entropy_is_banned_for_half_inputs_only(half):
    p, target = torch.full((4, 1), 0.25), torch.ones(4, 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # CPU autocast runs it in FP32
        assert F.binary_cross_entropy(p.bfloat16(), target.bfloat16()).dtype == torch.float32
    o1(half)
    assert F.binary_cross_entropy(p, target).dtype == torch.float32  # FP32 inputs: nothing to protect
    with pytest.raises(NotImplementedError, match="allow_banned"):
        F.binary_cross_entropy(p.to(half), target)


# ------------------------------------------------------------------ out= (probe: torch.compile + inductor)
OUT_CALLS = {  # one op of each kind, called with an FP32 `out`; the inputs mix FP32 and half
    "mm (half)": lambda a, h, out: torch.mm(a, h.float(), out=out),
    "bmm (half)": lambda a, h, out: torch.bmm(a[None], a[None], out=out[None]),
    "addmm (half)": lambda a, h, out: torch.addmm(a, a, a, out=out),
    "exp (float)": lambda a, h, out: torch.exp(h, out=out),
    "sum (float)": lambda a, h, out: torch.sum(h, 0, keepdim=True, out=out[:1]),
}


@pytest.mark.parametrize("call", list(OUT_CALLS), ids=list(OUT_CALLS))
def test_out_argument_is_written_and_never_cast(half, call):
    """A call with `out=` runs as written, as under torch.autocast (where it is not
    eligible): before, the wrapper cast `out` into a temporary, the result landed there and
    the caller's tensor stayed unwritten (inductor's FP32 `extern_kernels.bmm(..., out=buf)`
    then returned uninitialized memory as gradients)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(4, 4, generator=g)
    h = torch.randn(4, 4, generator=g).to(half)
    expected = torch.full((4, 4), 7.0)
    OUT_CALLS[call](a, h, expected)
    o1(half)
    out = torch.full((4, 4), 7.0)
    result = OUT_CALLS[call](a, h, out)
    assert out.dtype == torch.float32 and torch.equal(out, expected)
    assert result.data_ptr() == out.data_ptr() or result.data_ptr() in (out[None].data_ptr(), out[:1].data_ptr())
    assert torch.mm(a, a).dtype == half  # the same op without out= still casts


def test_out_argument_of_a_promote_op_is_never_cast(half):
    """Promotion would have made a half `out` an FP32 temporary; the call now fails on the
    mixed dtypes exactly as in plain torch (and as under torch.autocast)."""
    a, h = torch.randn(3, 3), torch.randn(3, 3).to(half)
    with pytest.raises(RuntimeError) as plain:
        torch.cross(h, a, dim=1, out=torch.empty(3, 3, dtype=half))
    o1(half)
    out = torch.full((3, 3), 7.0, dtype=half)
    with pytest.raises(RuntimeError) as patched:
        torch.cross(h, a, dim=1, out=out)
    assert str(patched.value) == str(plain.value)
    torch.cross(h, a.to(half), dim=1, out=out)  # matching dtypes: written
    assert torch.equal(out, torch.linalg.cross(h, a.to(half), dim=1))


def test_out_argument_under_torch_compile(half):
    torch._dynamo.reset()
    a = torch.randn(4, 4)
    expected = torch.mm(a, a)
    o1(half)

    def fn(x, buf):
        torch.mm(x, x, out=buf)
        return buf * 1

    out = torch.empty(4, 4)
    assert torch.equal(torch.compile(fn, backend="eager")(a, out), expected) and torch.equal(out, expected)
    torch._dynamo.reset()


# ------------------------------------------------------------------ reentrant checkpointing (probe: wav2vec2)
def test_reentrant_checkpoint_gives_the_gradients_of_the_plain_forward(half):
    """A reentrant checkpoint segment gets its input as a detached leaf that requires grad.
    Cast once through the cache and shared by the segment's ops (wav2vec2's q/k/v
    projections), its gradients were summed in half before reaching the FP32 input, so
    checkpointing changed the gradients; only parameters are cached now (as in Apex)."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    weights = [nn.Parameter(torch.randn(32, 32)) for _ in range(6)]
    x0 = torch.randn(4, 32)

    def block(x):
        return sum(F.linear(x, w) for w in weights)

    def grads(ckpt):
        x = x0.clone().requires_grad_()
        h = x * 1.0
        out = checkpoint(block, h, use_reentrant=True) if ckpt else block(h)
        out.float().pow(2).sum().backward()
        g = [x.grad] + [w.grad.clone() for w in weights]
        for w in weights:
            w.grad = None
        return g

    o1(half, loss_scale=1.0)
    plain, checkpointed = grads(False), grads(True)
    for a, b in zip(plain, checkpointed):
        assert torch.equal(a, b)
    assert _cache().hits > 0  # the weights themselves are still cast once and reused
