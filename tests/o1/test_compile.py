"""O1/O4 under torch.compile: the casts are part of the graph Dynamo captures, on every backend.

Each test compiles through a recording backend (it keeps the FX graph Dynamo hands over, then
delegates to the real backend), so it checks both what the compiled code returns and that
the cast nodes are in the captured graph, not restored later by a backend that re-traces.
Models are tiny: compile time, not run time, is what these tests pay for.
"""
from __future__ import annotations

import threading

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn
from torch._dynamo.backends.registry import lookup_backend

import ampatch as amp

BACKENDS = ["eager", "aot_eager", pytest.param("inductor", marks=pytest.mark.slow)]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def recording(inner: str):
    """A backend that records each captured FX graph, then compiles it with `inner`."""
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return lookup_backend(inner)(gm, example_inputs)

    return backend, graphs


def casts_to(graphs, dtype) -> int:
    """How many `.to(dtype)` nodes the captured graphs hold."""
    return sum(1 for gm in graphs for n in gm.graph.nodes
               if n.op == "call_method" and n.target == "to" and dtype in n.args[1:])


def input_dtypes(graphs, match) -> list[torch.dtype]:
    """dtypes of the tensor inputs of every node whose target matches."""
    out = []
    for gm in graphs:
        for n in gm.graph.nodes:
            if n.op in ("call_function", "call_method") and match(n.target):
                out += [a.meta["example_value"].dtype for a in n.args
                        if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("example_value"), torch.Tensor)]
    return out


def is_linear(target) -> bool:
    return getattr(target, "__name__", "") == "linear"


def o1(models, half=torch.bfloat16, **kw):
    return amp.initialize(models, opt_level="O1", half_dtype=half, verbosity=0, **kw)


# ----------------------------------------------------------------- functions (torch.*, F.*)
class Small(nn.Module):
    """Functions (F.linear), an operator (@) and a Tensor method (softmax), in one graph."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(8, 8), nn.Linear(8, 4)
        self.w = nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x):
        h = F.relu(self.lin1(x))
        return self.lin2((h @ self.w).softmax(-1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_function_method_and_operator_casts_are_captured(backend):
    model = Small()
    o1(model)
    x = torch.randn(2, 8)
    eager = model(x)
    compiler, graphs = recording(backend)
    out = torch.compile(model, backend=compiler)(x)
    assert out.dtype == eager.dtype == torch.bfloat16
    assert torch.allclose(out.float(), eager.float(), atol=1e-2)
    # lin1: x, weight, bias; @: w (h is bfloat16 already); lin2: the softmax output, weight, bias
    assert casts_to(graphs, torch.bfloat16) == 7
    assert casts_to(graphs, torch.float32) == 1  # the product, for softmax
    assert set(input_dtypes(graphs, is_linear)) == {torch.bfloat16}
    out.float().sum().backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_float_functions_and_fp16(backend):
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4), nn.Softmax(-1))
    o1(model, torch.float16)
    compiler, graphs = recording(backend)
    out = torch.compile(model, backend=compiler)(torch.randn(2, 8))
    assert out.dtype == torch.float32  # softmax runs in FP32, as in eager
    assert casts_to(graphs, torch.float16) == 6 and casts_to(graphs, torch.float32) == 2  # x, 2 w, 2 b, LN out
    assert set(input_dtypes(graphs, lambda t: getattr(t, "__name__", "") == "layer_norm")) == {torch.float32}


# ----------------------------------------------------------------- Tensor methods and operators
def methods_and_operators(x, w):
    y = x @ w
    return y, y.softmax(-1), x.matmul(w), 2 ** y, y ** 2, 1 / y, torch.Tensor.exp(y), x.mm(w).sum()


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_tensor_method_and_operator_casts_are_captured(backend):
    o1(nn.Linear(1, 1))
    x, w = torch.randn(4, 4), torch.randn(4, 4, requires_grad=True)
    eager = methods_and_operators(x, w)
    compiler, graphs = recording(backend)
    out = torch.compile(methods_and_operators, backend=compiler)(x, w)
    assert [t.dtype for t in out] == [t.dtype for t in eager]
    assert [t.dtype for t in out] == [torch.bfloat16, torch.float32, torch.bfloat16] + [torch.float32] * 5
    for o, e in zip(out, eager):
        assert torch.allclose(o.float(), e.float(), rtol=2e-2, atol=2e-2)
    assert casts_to(graphs, torch.bfloat16) == 6  # x and w for @, matmul, mm
    assert casts_to(graphs, torch.float32) == 6  # y for softmax, 2 **, **, 1 /, exp; mm's result for sum
    out[0].float().sum().backward()
    assert w.grad.dtype == torch.float32


# ----------------------------------------------------------------- modules, RNNs included
class Attention(nn.Module):
    """A tiny attention block: SDPA, then an explicit softmax attention, then a head."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        scores = (q @ k.transpose(-1, -2)) / (d // self.heads) ** 0.5
        a = a + scores.softmax(-1) @ v
        return self.out(self.norm(a.transpose(1, 2).reshape(b, t, d)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_sdpa_model_backward(backend):
    torch.manual_seed(0)
    model = Attention()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = o1(model, optimizers=opt)
    x = torch.randn(2, 5, 16)
    ref = Attention()
    ref.load_state_dict(model.state_dict())
    eager_loss = ref(x).float().pow(2).mean()  # same weights, eager O1
    eager_loss.backward()
    compiler, graphs = recording(backend)
    compiled = torch.compile(model, backend=compiler)
    loss = compiled(x).float().pow(2).mean()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    assert torch.allclose(loss, eager_loss, rtol=1e-3)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all()
        assert torch.allclose(p.grad, q.grad, rtol=1e-2, atol=1e-3)
    assert set(input_dtypes(graphs, lambda t: t is F.scaled_dot_product_attention
                            or getattr(t, "__name__", "") == "scaled_dot_product_attention")) == {torch.bfloat16}
    opt.step()


class DropoutAttention(nn.Module):
    """SDPA with attention dropout in training (BERT's and T5's pattern): on the CPU its math
    path runs in FP32, and AOT Autograd traces it through torch's Python decomposition of
    matmul, which calls `Tensor.bmm`."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 4, 3, 2, 4).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.1)


@pytest.mark.parametrize("backend", BACKENDS[1:])
@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_backend_traces_torch_internals_without_casts(backend, half):
    """The backend's own tracing sees torch uncast: before, the patched `Tensor.bmm` cast the
    FP32 math of the decomposition back to half and the backward graph failed ("expected
    scalar type Float but found BFloat16")."""
    torch.manual_seed(0)
    model = DropoutAttention()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = o1(model, half, optimizers=opt, loss_scale=1.0)  # the graph is the point, not the scale
    compiler, graphs = recording(backend)
    compiled = torch.compile(model, backend=compiler)
    out = compiled(torch.randn(2, 4, 8), torch.zeros(2, 1, 4, 4))
    assert out.dtype == half
    with amp.scale_loss(out.float().pow(2).mean(), opt) as scaled:
        scaled.backward()
    for p in model.parameters():
        assert p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0
    assert set(input_dtypes(graphs, lambda t: t is F.scaled_dot_product_attention
                            or getattr(t, "__name__", "") == "scaled_dot_product_attention")) == {half}
    opt.step()
    amp.deinitialize()  # the compile steps are torch's own again
    from torch._dynamo.output_graph import OutputGraph
    assert "ampatch" not in OutputGraph.call_user_compiler.__module__


@pytest.mark.slow
def test_inductor_fp32_matmul_while_a_session_patches_torch():
    """Inductor's generated code calls `torch.bmm(a, b, out=buf)` on FP32 buffers at run time,
    where the session's patched torch.bmm is live: before, it cast `buf` into a temporary and
    the compiled function returned uninitialized memory."""
    o1(nn.Linear(2, 2))
    a, b = torch.randn(2, 64, 64), torch.randn(2, 64, 64)
    fn = torch.compile(lambda x, y: torch.ops.aten.bmm(x, y) * 2, backend="inductor")
    assert torch.allclose(fn(a, b), torch.ops.aten.bmm(a, b) * 2, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_transformer_layer_trains_compiled(backend):
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0)
    opt = torch.optim.AdamW(layer.parameters(), 1e-3)
    layer, opt = o1(layer, optimizers=opt)
    compiler, graphs = recording(backend)
    compiled = torch.compile(layer, backend=compiler)
    before = layer.linear1.weight.detach().clone()
    loss = compiled(torch.randn(2, 6, 16)).float().pow(2).mean()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    assert not torch.equal(before, layer.linear1.weight)
    assert set(input_dtypes(graphs, is_linear)) == {torch.bfloat16}


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_rnn_cell_and_module(backend):
    cell, lstm = nn.GRUCell(4, 6), nn.LSTM(4, 6, batch_first=True)
    o1([cell, lstm])
    x = torch.randn(2, 3, 4)
    compiler, graphs = recording(backend)
    assert torch.compile(cell, backend=compiler)(x[:, 0]).dtype == torch.bfloat16
    assert set(input_dtypes(graphs, lambda t: getattr(t, "__name__", "") == "gru_cell")) == {torch.bfloat16}
    # Dynamo runs RNN modules eagerly by default (the eager O1 path applies) ...
    assert torch.compile(lstm, backend="eager")(x)[0].dtype == torch.bfloat16



def test_rnn_module_traced_with_allow_rnn():
    """With Dynamo's experimental allow_rnn the casts of the flat weights are graph nodes.
    (torch 2.13 fails allow_rnn under AOT autograd, plain or with autocast: eager backend only.)"""
    lstm = nn.LSTM(4, 6, batch_first=True)
    o1(lstm)
    compiler, graphs = recording("eager")
    with torch._dynamo.config.patch(allow_rnn=True):
        out, _ = torch.compile(lstm, backend=compiler)(torch.randn(2, 3, 4))
    assert out.dtype == torch.bfloat16
    assert casts_to(graphs, torch.bfloat16) == 5  # the input and the four flat weights
    out.float().sum().backward()
    assert lstm.weight_ih_l0.grad.dtype == torch.float32
    assert lstm._flat_weights[0] is lstm.weight_ih_l0  # nothing half left in the module


# ----------------------------------------------------------------- guards: the switch and the session
def test_disable_casts_and_deinitialize_recompile_without_casts():
    model = nn.Linear(4, 4)
    o1(model)
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(2, 4)
    assert compiled(x).dtype == torch.bfloat16
    with amp.disable_casts():
        assert compiled(x).dtype == torch.float32
    seen = []
    t = threading.Thread(target=lambda: seen.append(compiled(x).dtype))  # casts are on in other threads
    with amp.disable_casts():
        t.start()
        t.join()
    assert seen == [torch.bfloat16]
    o1(model, torch.float16)  # a new session with another half dtype
    assert compiled(x).dtype == torch.float16
    amp.deinitialize()
    assert compiled(x).dtype == torch.float32


def test_eager_parts_after_a_graph_break_still_cast_and_ampatch_code_is_never_compiled():
    lin1, lin2, lstm = nn.Linear(4, 4), nn.Linear(4, 4), nn.LSTM(4, 4)
    o1([lin1, lin2, lstm])

    def f(x):
        y = lin1(x)
        torch._dynamo.graph_break()
        return lin2(y).softmax(-1), torch.mm(y, y)

    def g(x):  # Dynamo skips a frame holding an RNN module: all of it runs eagerly
        return lstm(lin1(x)[None])[0]

    compiler, graphs = recording("eager")
    for _ in range(3):
        soft, mm = torch.compile(f, backend=compiler)(torch.randn(4, 4))
        out = torch.compile(g, backend=compiler)(torch.randn(4, 4))
    assert soft.dtype == torch.float32 and mm.dtype == torch.bfloat16 and out.dtype == torch.bfloat16
    # one graph per side of the break; none of ampatch's own frames (the cast cache, the
    # wrappers, the RNN view) compiled on their own
    assert len(graphs) == 2


# ----------------------------------------------------------------- graph breaks: same as autocast
def _graph_breaks(fn, *args) -> tuple[int, int]:
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(*args)
    return explained.graph_count, explained.graph_break_count


def test_graph_breaks_equal_autocast():
    model = nn.Sequential(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0), nn.Linear(16, 4))
    x = torch.randn(2, 6, 16)

    def with_autocast(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x)

    expected = _graph_breaks(with_autocast, x)
    o1(model)
    assert _graph_breaks(model, x) == expected
    assert _graph_breaks(methods_and_operators, x[0], torch.randn(16, 16)) == (1, 0)


def test_session_started_before_dynamo_is_imported(tmp_path):
    """An O1 session without optimizers does not import Dynamo (seconds, and it rebinds
    torch functions); the first torch.compile installs what methods and operators need."""
    import subprocess
    import sys
    script = tmp_path / "lazy.py"
    script.write_text(
        "import sys, torch, torch.nn as nn, ampatch as amp\n"
        "original = torch.compile\n"
        "amp.initialize(nn.Linear(2, 2), opt_level='O4', verbosity=0)\n"
        "assert 'torch._dynamo' not in sys.modules\n"
        "graphs = []\n"
        "def backend(gm, inputs):\n"
        "    graphs.append(gm)\n"
        "    return gm.forward\n"
        "out = torch.compile(lambda x: (x @ x).softmax(-1), backend=backend)(torch.randn(3, 3))\n"
        "casts = [n.args[1] for gm in graphs for n in gm.graph.nodes if n.target == 'to']\n"
        "assert out.dtype == torch.float32 and casts == [torch.bfloat16] * 2 + [torch.float32], casts\n"
        "amp.deinitialize()\n"
        "assert torch.compile is original\n"
        "print('ok')\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]


@pytest.mark.parametrize("level", ["O2", "O3", "O5"])
def test_model_cast_levels_compile(level):
    """O2/O3/O5 cast the model instead of patching torch: compiled, it trains the same way."""
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=torch.bfloat16, verbosity=0)
    x = torch.randn(2, 8)
    eager = model(x)
    compiler, graphs = recording("aot_eager")
    out = torch.compile(model, backend=compiler)(x)
    assert out.dtype == eager.dtype and torch.equal(out, eager)
    assert set(input_dtypes(graphs, is_linear)) == {torch.bfloat16}
    with amp.scale_loss(out.float().pow(2).mean(), opt) as scaled:
        scaled.backward()
    opt.step()
