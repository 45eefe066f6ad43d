"""`keep_fp32`: chosen modules run in FP32, with everything inside them, at
every level.

- which modules: names as `named_modules()` gives them (one string, comma-separated, a
  list), classes, callables, with several models the model's index in front ("1.head");
  the outermost match only; an unknown name lists close names;
- at O0-O5 in both half dtypes: the kept module's params and buffers stay FP32, its ops run
  in FP32 (a matmul inside, the O1 counters count nothing inside), its inputs arrive FP32,
  its outputs leave FP32 (O1/O4) or in the model's half dtype (O2/O3/O5), its grads are FP32;
  at O2/O5 its params are their own masters; `deinitialize` restores everything;
- an O2 checkpoint resumes bit for bit; `AMPATCH_KEEP_FP32` forces names from outside;
  `report()` lists the kept modules; copies and DataParallel replicas run their own weights;
  tied weights; a model kept whole;
- torch.compile on every backend (the FSDP2 cases are in test_fsdp.py).
"""
from __future__ import annotations

import copy
import io
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampatch as amp
from ampatch.config import env
from ampatch.model import keep
from ampatch.model.forwards import forward_casts_bypassed
from ampatch.session.session import current as live_session

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
LEVELS = ["O0", "O1", "O2", "O3", "O4", "O5"]
CASTS_MODEL = ("O2", "O3", "O5")
PATCHES = ("O1", "O4")


class Probe(nn.Module):
    """A matmul with its own weight (O1 casts it to half, unless kept), recording what it sees."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(n, n) / n ** 0.5)
        self.seen: list[tuple[torch.dtype, torch.dtype, torch.dtype]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.matmul(x, self.w)
        self.seen.append((x.dtype, self.w.dtype, y.dtype))
        return y


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.head = nn.Sequential(Probe(8), nn.BatchNorm1d(8), nn.LayerNorm(8), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def make(seed: int = 0) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    net = Net()
    return net, torch.optim.Adam(net.parameters(), lr=1e-2, eps=1e-4)


def init(net, opt, level, half=BF16, **kw):
    half = half if level in ("O1", "O2", "O3") else None
    return amp.initialize(net, opt, opt_level=level, half_dtype=half, verbosity=0, **kw)


def names(kept: list[keep.Kept]) -> list[str]:
    return [k.label for k in kept]


# ------------------------------------------------------------------ which modules
def test_names_one_string_comma_separated_or_a_list():
    net = Net()
    assert names(keep.matching([net], "head")) == ["head"]
    assert names(keep.matching([net], "body, head.3")) == ["body", "head.3"]
    assert names(keep.matching([net], ["head.3", "body"])) == ["body", "head.3"]  # named_modules() order
    assert keep.matching([net], "head")[0].module is net.head
    assert keep.matching([net], None) == [] and keep.matching([net], []) == []


def test_only_the_outermost_match_is_kept():
    net = Net()
    assert names(keep.matching([net], ["head.3", "head", "head.0"])) == ["head"]


def test_classes_and_callables():
    net = Net()
    assert names(keep.matching([net], nn.Linear)) == ["body", "head.3"]
    assert names(keep.matching([net], [Probe, nn.LayerNorm])) == ["head.0", "head.2"]
    assert names(keep.matching([net], lambda name, m: name.startswith("head"))) == ["head"]
    assert names(keep.matching([net], nn.Sequential)) == ["head"]


def test_several_models_take_the_model_index_in_front():
    a, b = Net(), nn.ModuleDict({"first": nn.Linear(3, 3), "second": nn.Linear(3, 3)})
    assert names(keep.matching([a, b], "1.first")) == ["1.first"]
    assert keep.matching([a, b], "1.first")[0].module is b["first"]
    assert names(keep.matching([a, b], "head")) == ["0.head"]  # only model 0 has one: no index needed
    assert names(keep.matching([a, b], "second")) == ["1.second"]
    assert names(keep.matching([a, b], "1")) == ["1"]          # model 1 whole
    k = keep.matching([a, b], "1.second")[0]
    assert (k.model, k.name, k.label) == (1, "second", "1.second")
    with pytest.raises(ValueError, match=r"several models.*'0\.body', '1\.body'"):
        keep.matching([a, Net()], "body")
    with pytest.raises(ValueError, match="ambiguous"):  # model 1's label "1", model 0's child "1"
        keep.matching([nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), nn.Linear(2, 2)], "1")


def test_unknown_names_list_close_ones():
    with pytest.raises(ValueError, match=r"no module is named 'haed'.*Close names: 'head'") as exc:
        keep.matching([Net()], "haed")
    assert "named_modules()" in str(exc.value)
    with pytest.raises(ValueError, match=r"'head\.9'.*Close names: 'head\.3', 'head\.2'"):
        keep.matching([Net()], ["body", "head.9"])
    with pytest.raises(ValueError, match=r"AMPATCH_KEEP_FP32: no module is named 'bdy'"):
        keep.matching([Net()], None, forced=["bdy"])


def test_bad_specifications_raise_type_errors(caplog):
    net = Net()
    with pytest.raises(TypeError, match="keep_fp32 takes module names"):
        keep.matching([net], 3)
    with pytest.raises(TypeError, match="keep_fp32 items are"):
        keep.matching([net], [net.head])           # a module object, not its name
    with pytest.raises(TypeError, match="not an nn.Module class"):
        keep.matching([net], [int])
    with pytest.raises(TypeError, match="must return True or False"):
        keep.matching([net], lambda name, m: None)
    with caplog.at_level(logging.WARNING, logger="ampatch"):
        assert keep.matching([net], nn.Conv2d) == []
    assert "matches no module" in caplog.text


def test_initialize_refuses_an_unknown_name_and_changes_nothing():
    net, opt = make()
    with pytest.raises(ValueError, match="Close names: 'head'"):
        init(net, opt, "O2", keep_fp32="heads")
    assert live_session() is None
    assert net.body.weight.dtype == F32 and "forward" not in vars(net.head)


# ------------------------------------------------------------------ every level
@pytest.mark.parametrize("level", LEVELS)
def test_kept_module_runs_in_fp32_at_every_level(level, half):
    if level in ("O4", "O5") and half == F16:
        pytest.skip("O4/O5 are bfloat16")
    half = half if level in ("O1", "O2", "O3") else BF16
    net, opt = make()
    ids = {n: id(p) for n, p in net.named_parameters()}
    net, opt = init(net, opt, level, half, keep_fp32="head")
    boundary = []
    hook = net.head.register_forward_hook(lambda m, args, out: boundary.append((args[0].dtype, out.dtype)))
    x = torch.randn(6, 4)
    out = net(x)
    loss = out.float().pow(2).mean()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    hook.remove()

    body = half if level in CASTS_MODEL else F32
    assert net.body.weight.dtype == body
    kept = [*net.head.parameters(), *(b for b in net.head.buffers() if b.is_floating_point())]
    assert {t.dtype for t in kept} == {F32}
    assert net.head[0].seen == [(F32, F32, F32)]  # the matmul inside ran in FP32 on FP32 inputs
    arriving = half if level != "O0" else F32     # the body's output: half at every level but O0
    leaving = half if level in CASTS_MODEL else F32
    assert boundary == [(arriving, leaving)]
    assert out.dtype == F32
    assert all(p.grad is not None and p.grad.dtype == F32 for p in net.head.parameters())
    report = amp.report()
    assert report.keep_fp32 == ["head"]
    if level in PATCHES:  # the body's linear is cast, nothing inside the kept head is
        assert report.casts["linear"] == {str(half).removeprefix("torch."): 1}
        assert not {"matmul", "layer_norm"} & set(report.casts)
    opt.step()
    assert net.head[0].w.dtype == F32

    amp.deinitialize()
    assert {n: id(p) for n, p in net.named_parameters()} == ids
    assert {p.dtype for p in net.parameters()} == {F32}
    assert not {"forward", "_replicate_for_data_parallel"} & set(vars(net.head))


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_without_keep_fp32_the_probe_runs_in_half(level):
    """The test above can fail: without keep_fp32 the same probe sees half."""
    net, opt = make()
    init(net, opt, level)
    net(torch.randn(6, 4))
    assert net.head[0].seen[0][2] == BF16


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_kept_params_are_their_own_masters(level):
    net, opt = make()
    net, opt = init(net, opt, level, keep_fp32="head")
    masters = list(amp.master_params(opt))
    model_params = {id(p) for p in net.parameters()}
    assert all(any(m is p for m in masters) for p in net.head.parameters())  # stepped as they are
    separate = [m for m in masters if id(m) not in model_params]
    assert len(separate) == 2 and {m.dtype for m in separate} == {F32}  # body.weight, body.bias only
    assert "ampatch_masters" in opt.state_dict()
    assert sum(m is not None for m in opt.state_dict()["ampatch_masters"]) == 2


def test_o2_state_dict_is_fp32_and_loads_back():
    net, opt = make()
    init(net, opt, "O2", keep_fp32="head")
    sd = net.state_dict()
    assert {v.dtype for v in sd.values() if v.is_floating_point()} == {F32}
    other, _ = make(seed=3)
    net.load_state_dict(other.state_dict())
    assert torch.equal(net.head[3].weight, other.head[3].weight)
    assert torch.equal(next(amp.master_params(opt)), other.body.weight)


# ------------------------------------------------------------------ checkpoints
def _train(net, opt, batches):
    for x, y in batches:
        opt.zero_grad()
        with amp.scale_loss(F.mse_loss(net(x), y), opt) as scaled:
            scaled.backward()
        opt.step()


def _state(net, opt) -> dict:
    return {"model": {k: v.clone() for k, v in net.state_dict().items()},
            "masters": [p.detach().clone() for p in amp.master_params(opt)],
            "opt": opt.state_dict()["state"], "amp": amp.state_dict()}


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("half", [BF16, F16], ids=["bf16", "fp16"])
def test_o2_checkpoint_resumes_bit_for_bit(half):
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)) for _ in range(6)]
    net, opt = init(*make(), "O2", half, keep_fp32="head")
    _train(net, opt, data)
    straight = _state(net, opt)
    amp.deinitialize()

    net, opt = init(*make(), "O2", half, keep_fp32="head")
    _train(net, opt, data[:3])
    buf = io.BytesIO()
    torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "amp": amp.state_dict()}, buf)
    amp.deinitialize()
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    net, opt = init(*make(seed=1), "O2", half, keep_fp32="head")  # other weights: all from the checkpoint
    net.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    amp.load_state_dict(ckpt["amp"])
    _train(net, opt, data[3:])
    assert _same(_state(net, opt), straight)


# ------------------------------------------------------------------ from outside
def test_env_forces_names_added_to_the_scripts_own(monkeypatch, caplog):
    monkeypatch.setenv(env.KEEP_FP32, "head.0, head.3")
    net, opt = make()
    with caplog.at_level(logging.WARNING, logger="ampatch"):
        amp.initialize(net, opt, opt_level="O1", keep_fp32="body")
    assert amp.report().keep_fp32 == ["body", "head.0", "head.3"]
    assert "AMPATCH_KEEP_FP32=head.0,head.3" in caplog.text
    net(torch.randn(6, 4))
    assert net.head[0].seen == [(F32, F32, F32)]
    assert "linear" not in amp.report().casts  # body and head.3 both kept


def test_env_name_that_matches_nothing_names_the_variable(monkeypatch):
    monkeypatch.setenv(env.KEEP_FP32, "hed")
    with pytest.raises(ValueError, match=r"AMPATCH_KEEP_FP32: no module is named 'hed'.*'head'"):
        init(*make(), "O2")


def test_env_names_leave_a_session_without_models_alone(monkeypatch):
    monkeypatch.setenv(env.KEEP_FP32, "head")
    handle = amp.init()  # Apex's old entry point: initialize([]), patches only
    assert handle.is_active() and amp.report().keep_fp32 == []


def test_report_lists_the_kept_modules():
    init(*make(), "O2", keep_fp32=[nn.Linear])
    report = amp.report()
    assert report.keep_fp32 == ["body", "head.3"] and report.to_dict()["keep_fp32"] == ["body", "head.3"]
    assert "kept in FP32: body, head.3" in str(report)
    amp.deinitialize()
    init(*make(), "O2")
    assert amp.report().keep_fp32 == [] and "kept in FP32" not in str(amp.report())


# ------------------------------------------------------------------ copies, replicas, bypass
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_copies_and_replicas_run_their_own_weights(level):
    net, opt = make()
    init(net, opt, level, keep_fp32="head")
    net.eval()
    x = torch.randn(6, 4)
    ref = net(x)
    twin = copy.deepcopy(net)
    assert vars(twin.head)["forward"].__wrapped__.__self__ is twin.head
    assert torch.equal(twin(x), ref)
    with torch.no_grad():
        twin.head[3].bias.add_(1.0)
    assert not torch.equal(twin(x), ref) and twin.head[0].seen[-1] == (F32, F32, F32)

    buf = io.BytesIO()
    torch.save(net, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert torch.equal(loaded(x), ref)

    replica = net.head._replicate_for_data_parallel()  # what nn.parallel.replicate does per device
    assert vars(replica)["forward"].__wrapped__.__self__ is replica
    assert "_replicate_for_data_parallel" not in vars(replica)
    assert torch.equal(nn.DataParallel(net)(x), ref)  # on CPU, DataParallel calls the module itself


def test_bypass_passes_inputs_and_outputs_untouched():
    net, opt = make()
    init(net, opt, "O1", keep_fp32="head")
    h = torch.randn(6, 8, dtype=BF16)
    with forward_casts_bypassed():
        out = net.head(h)  # neither upcast nor casts off: O1 casts the matmul as written
    assert net.head[0].seen == [(BF16, F32, BF16)] and out.dtype == BF16
    amp.deinitialize()
    lin = nn.Linear(3, 3)
    amp.initialize(lin, opt_level="O2", verbosity=0)
    with forward_casts_bypassed():
        assert lin(torch.randn(2, 3, dtype=BF16)).dtype == BF16  # the model's output cast is off too
    assert lin(torch.randn(2, 3, dtype=BF16)).dtype == F32


# ------------------------------------------------------------------ special cases
def test_tied_weights_keep_both_modules_where_the_model_is_cast():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.mid = nn.Linear(8, 8)
            self.out = nn.Linear(8, 10, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, idx):
            return self.out(self.mid(self.emb(idx)))

    model = Tied()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match=r"keeps 'emb' in FP32 too.*tied"):
        amp.initialize(model, opt, opt_level="O2", keep_fp32="out")
    assert amp.report().keep_fp32 == ["emb", "out"]
    assert model.emb.weight.dtype == F32 and model.mid.weight.dtype == BF16
    out = model(torch.tensor([[1, 2, 3]]))
    with amp.scale_loss(out.float().logsumexp(-1).sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert model.emb.weight.grad is None or model.emb.weight.grad.dtype == F32
    amp.deinitialize()
    amp.initialize(model, opt, opt_level="O1", keep_fp32="out", verbosity=0)  # no cast params: no need
    assert amp.report().keep_fp32 == ["out"]


def test_a_model_kept_whole():
    a, b = Net(), Net()
    opt = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)
    amp.initialize([a, b], opt, opt_level="O2", keep_fp32="1", verbosity=0)
    assert a.body.weight.dtype == BF16 and {p.dtype for p in b.parameters()} == {F32}
    x = torch.randn(6, 4)
    assert a(x).dtype == F32 and b(x).dtype == F32 and b(x.to(BF16)).dtype == F32
    assert b.head[0].seen[-1] == (F32, F32, F32)
    own = [m for m in amp.master_params(opt) if any(m is p for p in [*a.parameters(), *b.parameters()])]
    assert len(own) == 9 + 2 and all(any(m is p for m in own) for p in b.parameters())  # and a's batch norm
    amp.deinitialize()
    assert "forward" not in vars(b) and "forward" not in vars(a)


def test_o1_output_cast_of_a_model_kept_whole():
    net = Net()
    amp.initialize(net, opt_level="O1", keep_fp32=Net, cast_model_outputs=BF16, verbosity=0)
    assert amp.report().keep_fp32 == [""]
    out = net(torch.randn(6, 4))
    assert out.dtype == BF16 and net.head[0].seen == [(F32, F32, F32)]
    assert "(the whole model)" in str(amp.report())


def test_disabled_session_still_checks_names():
    with pytest.raises(ValueError, match="no module is named"):
        amp.initialize(Net(), opt_level="O2", enabled=False, keep_fp32="nope")


# ------------------------------------------------------------------ torch.compile
class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.head = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


COMPILED = ([pytest.param(level, backend, id=f"{level}-{backend}")
             for level in ("O1", "O2", "O3", "O4", "O5") for backend in ("eager", "aot_eager")]
            + [pytest.param(level, "inductor", id=f"{level}-inductor", marks=pytest.mark.slow)
               for level in ("O1", "O2")])


@pytest.mark.parametrize("level,backend", COMPILED)
def test_compiled_models_keep_the_module_in_fp32(level, backend):
    """Compile after initialize: at O2/O3/O5 the kept module is in the graph with FP32 inputs
    and weights; at O1/O4 it runs eagerly (a graph break) with casts off, and only the body's
    linear, in half, is in the graph."""
    import torch._dynamo
    from torch._dynamo.backends.registry import lookup_backend

    graphs: list[torch.fx.GraphModule] = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return lookup_backend(backend)(gm, example_inputs)

    torch._dynamo.reset()
    try:
        torch.manual_seed(0)
        model = Small()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = init(model, opt, level, keep_fp32="head")
        seen = []
        if level in PATCHES:  # runs eagerly there, so the hook sees it run
            model.head[2].register_forward_hook(lambda m, a, o: seen.append((a[0].dtype, o.dtype)))
        x = torch.randn(6, 4)
        eager = model(x)
        compiled = torch.compile(model, backend=recording)
        out = compiled(x)
        out.float().sum().backward()
    finally:
        torch._dynamo.reset()
    assert out.dtype == eager.dtype == F32
    torch.testing.assert_close(out, eager, rtol=2e-2, atol=2e-2)
    linears = [[a.meta["example_value"].dtype for a in n.args[:2]] for gm in graphs for n in gm.graph.nodes
               if n.op == "call_function" and getattr(n.target, "__name__", "") == "linear"]
    if level in PATCHES:
        assert linears == [[BF16, BF16]]                 # the body, cast in the graph
        assert seen == [(F32, F32), (F32, F32)]           # the kept head: eager, then compiled call
    else:
        assert linears == [[BF16, BF16], [F32, F32], [F32, F32]]
    assert all(p.grad is not None and p.grad.dtype == F32 for p in model.head.parameters())


def test_fullgraph_at_o1_says_why_it_breaks():
    import torch._dynamo

    torch._dynamo.reset()
    try:
        model = Small()
        amp.initialize(model, opt_level="O1", keep_fp32="head", verbosity=0)
        with pytest.raises(Exception, match="keep_fp32 runs eagerly.*use O2/O3/O5"):
            torch.compile(model, fullgraph=True, backend="eager")(torch.randn(2, 4))
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_a_kept_output_layer_gives_the_model_its_fp32_values(level):
    """A kept module whose output is the model's own output: the model returns its FP32
    values, not their half rounding (logits beyond float16's 65504 stay finite)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    with torch.no_grad():
        model[1].weight.mul_(1e5)
    x = torch.full((2, 8), 10.0)
    reference = model(x)
    model, _ = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=level,
                              half_dtype=torch.float16, keep_fp32=["1"], verbosity=0)
    out = model(x)
    assert out.dtype == torch.float32 and bool(torch.isfinite(out).all())
    assert out.abs().max() > 65504
    torch.testing.assert_close(out, reference, rtol=1e-2, atol=0)
    out.sum().backward()
    assert model[1].weight.grad is not None and model[1].weight.grad.dtype == torch.float32


def test_hooks_on_a_kept_output_still_fire_when_the_model_returns_its_fp32_values():
    """The FP32 values the model returns route their gradient through the half copy the kept
    module returned, so hooks on that copy (FSDP2 gathers the kept unit's weight there) fire
    and the gradient equals the one the half copy gets."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    model, _ = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2",
                              half_dtype=torch.float16, keep_fp32=["1"], verbosity=0)
    grads = []

    def note(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        out.register_hook(grads.append)
    model[1].register_forward_hook(note)
    out = model(torch.randn(2, 8))
    assert out.dtype == torch.float32
    (out * torch.arange(4.0)).sum().backward()
    assert len(grads) == 1 and grads[0].dtype == torch.float16
    torch.testing.assert_close(grads[0].float(), torch.arange(4.0).expand(2, 4))
    assert model[1].weight.grad is not None


class AddsInPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 4)

    def forward(self, x):
        out = self.head(x)
        out += 1.0  # the half copy changed after the kept module returned it
        return out


def test_a_kept_output_changed_in_place_afterwards_is_returned_as_changed():
    torch.manual_seed(0)
    model = AddsInPlace()
    reference = model(torch.ones(2, 4))
    model = amp.initialize(model, opt_level="O2", half_dtype=torch.float16, keep_fp32=["head"], verbosity=0)
    torch.testing.assert_close(model(torch.ones(2, 4)), reference, rtol=1e-2, atol=1e-2)
