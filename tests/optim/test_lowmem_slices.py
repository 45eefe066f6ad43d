"""The low-memory master modes' step at the scale of one parameter: a parameter larger than a
chunk steps in chunk-sized slices where the optimizer is elementwise, whole where it is not;
one FP32 workspace serves every chunk of every step; initialize keeps no FP32 copy of the
model beside its masters.

- which optimizers are elementwise: torch.optim's eight, or any that declares it
  (`ampatch_elementwise = True`); a subclass that overrides step() is not, unless it says so;
- sliced equals unsliced bit for bit (weights, compensations, the optimizer's state_dict:
  its layout unchanged) for every elementwise torch.optim optimizer; Adafactor (factored
  second moments: not elementwise) steps whole;
- a checkpoint of a sliced run resumes bit for bit;
- the masters made at initialize hold no FP32 storage (each FP32 weight is freed as it is cast).
"""
from __future__ import annotations

import copy

import pytest
import torch
from _ranks import same
from torch import nn

import ampatch as amp
from ampatch.optim.chunks import ELEMENTWISE, is_elementwise
from ampatch.session.session import current

F32, BF16 = torch.float32, torch.bfloat16
MODES = ["stochastic", "kahan"]
CHUNK = 1024  # elements: each 64 x 64 weight (4096) steps in 4 slices


@pytest.fixture(autouse=True)
def _end_session():
    yield
    amp.deinitialize()


def masters():
    return current().optimizers[0].masters


def model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 16))


def data(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(32, 16, generator=g), torch.randn(32, 16, generator=g)


def train(net, opt, steps: int, start: int = 0, batch: int | None = None) -> list[float]:
    """`steps` steps on batches start.. (or the same `batch` each time); their losses."""
    losses = []
    for i in range(start, start + steps):
        x, y = data(i if batch is None else batch)
        opt.zero_grad()
        loss = ((net(x) - y) ** 2).mean()
        losses.append(float(loss.detach()))
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    return losses



class Recording:
    """Mixed into an optimizer class: records the sizes of the tensors each step() call steps."""

    def step(self, closure=None):
        self.calls.append([p.numel() for g in self.param_groups for p in g["params"]])
        return super().step(closure)


def recording(cls: type, elementwise: bool | None = None) -> type:
    attrs = {"calls": None}
    if elementwise is not None:
        attrs["ampatch_elementwise"] = elementwise
    sub = type(f"Recording{cls.__name__}", (Recording, cls), attrs)
    init = sub.__init__

    def __init__(self, *a, **kw):
        init(self, *a, **kw)
        self.calls = []

    sub.__init__ = __init__
    return sub


# ---------------------------------------------------------------------------------------- who is elementwise
def test_which_optimizers_are_elementwise():
    ps = [nn.Parameter(torch.zeros(3))]
    assert all(is_elementwise(cls(ps, lr=0.1)) for cls in ELEMENTWISE)
    assert {c.__name__ for c in ELEMENTWISE} == {"SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adamax", "NAdam",
                                                 "RAdam"}
    assert not is_elementwise(torch.optim.Adafactor(ps))   # factored second moments: rows and columns
    assert not is_elementwise(torch.optim.LBFGS(ps))
    assert not is_elementwise(recording(torch.optim.SGD)(ps, lr=0.1))  # its own step(): may do anything
    assert is_elementwise(recording(torch.optim.SGD, elementwise=True)(ps, lr=0.1))  # unless it says so
    opt = torch.optim.AdamW(ps)
    opt.ampatch_elementwise = False  # an instance may opt out
    assert not is_elementwise(opt)


# ---------------------------------------------------------------------------------------- sliced = whole
OPTIMIZERS = {
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adam_foreach": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True, amsgrad=True),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2, lr_decay=1e-3),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5, centered=True),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=1e-2, decoupled_weight_decay=True, weight_decay=0.01),
}


def run(make, mode: str, chunk: int, steps: int = 6) -> dict:
    net = model()
    opt = make(net.parameters())
    net, opt = amp.initialize(net, opt, opt_level="O5", master_weights=mode, verbosity=0)
    masters().chunk_numel = chunk
    losses = train(net, opt, steps, batch=0)
    out = {"weights": [p.detach().clone() for p in net.parameters()],
           "comp": [c.clone() for c in masters().comp.values()], "losses": losses,
           "state": copy.deepcopy(opt.state_dict()), "calls": list(getattr(opt, "calls", []))}
    amp.deinitialize()
    return out


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_sliced_step_equals_the_whole_step_for_every_elementwise_optimizer(name):
    whole = run(OPTIMIZERS[name], "kahan", 1 << 30)
    sliced = run(OPTIMIZERS[name], "kahan", CHUNK)
    assert whole["losses"][-1] < whole["losses"][0]  # it trains
    assert same(sliced["weights"], whole["weights"]) and same(sliced["comp"], whole["comp"])
    assert same(sliced["state"], whole["state"])  # the checkpoint's layout and values: as if stepped whole
    shapes = {tuple(v.shape) for st in sliced["state"]["state"].values() for k, v in st.items()
              if torch.is_tensor(v) and v.dim()}
    assert (64, 64) in shapes and (CHUNK,) not in shapes


@pytest.mark.parametrize("mode", MODES)
def test_a_parameter_larger_than_a_chunk_steps_in_slices(mode):
    cls = recording(torch.optim.AdamW, elementwise=True)  # records; declares itself elementwise

    def make(ps):
        opt = cls(ps, lr=1e-2)
        opt.register_step_post_hook(lambda o, a, k: o.calls.append("end"))  # hooks run once a step
        return opt

    out = run(make, mode, CHUNK, steps=2)
    total = sum(w.numel() for w in out["weights"])
    calls = out["calls"]
    assert calls.count("end") == 2
    steps = [calls[:calls.index("end")], calls[calls.index("end") + 1:-1]]
    for step in steps:
        assert all(sum(c) <= CHUNK for c in step), step  # every call a chunk at most
        assert sum(sum(c) for c in step) == total        # and every element once a step
        assert [c for c in step if 4096 in c] == []      # the 64 x 64 weight never whole


def test_an_optimizer_that_is_not_elementwise_steps_each_parameter_whole():
    cls = recording(torch.optim.Adafactor)
    sliced = run(lambda ps: cls(ps, lr=1e-2), "kahan", CHUNK)
    whole = run(lambda ps: cls(ps, lr=1e-2), "kahan", 1 << 30)
    assert 4096 in {n for c in sliced["calls"] for n in c}  # the 64 x 64 weight, whole
    assert all(sum(c) <= 4096 + 64 for c in sliced["calls"])
    assert same(sliced["weights"], whole["weights"]) and same(sliced["state"], whole["state"])
    assert any(k == "row_var" for st in sliced["state"]["state"].values() for k in st)  # its factored state


@pytest.mark.parametrize("mode", MODES)
def test_sliced_run_resumes_bit_for_bit(mode):
    def fresh():
        net = model(seed=3)
        opt = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=0.01)
        net, opt = amp.initialize(net, opt, opt_level="O5", master_weights=mode, verbosity=0)
        masters().chunk_numel = CHUNK
        return net, opt

    net, opt = fresh()
    train(net, opt, 3)
    ckpt = copy.deepcopy({"model": net.state_dict(), "optimizer": opt.state_dict()})
    train(net, opt, 3, start=3)
    straight = [p.detach().clone() for p in net.parameters()]
    amp.deinitialize()
    net, opt = fresh()
    net.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    train(net, opt, 3, start=3)
    assert same([p.detach() for p in net.parameters()], straight)


# ---------------------------------------------------------------------------------------- workspace, initialize
@pytest.mark.parametrize("mode", MODES)
def test_every_chunk_of_every_step_uses_one_workspace(mode, monkeypatch):
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=1e-2, momentum=0.9)
    net, opt = amp.initialize(net, opt, opt_level="O5", master_weights=mode, verbosity=0)
    masters().chunk_numel = CHUNK
    train(net, opt, 1)  # the first step makes the workspace (and the momentum buffers)
    workspace = masters().workspace
    buffers = {d: [t.data_ptr() for t in b] for d, b in workspace.buffers.items()}
    size = workspace.nbytes()
    made: list[int] = []  # FP32 tensors made with torch.empty from now on
    real_empty = torch.empty

    def counting_empty(*args, **kw):
        t = real_empty(*args, **kw)
        if kw.get("dtype") is F32:
            made.append(t.numel())
        return t

    monkeypatch.setattr(torch, "empty", counting_empty)
    train(net, opt, 3, start=1)
    assert made == []  # later steps make no buffers of their own
    assert {d: [t.data_ptr() for t in b] for d, b in workspace.buffers.items()} == buffers
    assert workspace.nbytes() == size
    per_element = 4 * (3 if mode == "stochastic" else 2)  # values, grads (+ the hash's int32 scratch)
    assert size <= per_element * CHUNK  # sized by the chunk, not the model (6288 elements)


@pytest.mark.parametrize("mode", MODES)
def test_masters_made_at_initialize_hold_no_fp32_copy(mode):
    """Before the cast, each master of an FP32 weight is a placeholder, not an alias of the FP32
    weight (which would keep every FP32 weight alive through the cast, beside its bfloat16 copy);
    after it, the master aliases the bfloat16 weight."""
    from ampatch.config.values import MasterMode
    from ampatch.optim.lowmem import LowMemMasters
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=1e-2)
    m = LowMemMasters(opt, {id(p) for p in net.parameters()}, MasterMode(mode))
    for mp, master in m.pairs():
        assert mp.dtype == F32 and master.untyped_storage().nbytes() <= 2
    if mode == "kahan":  # the compensations, made as the cast reaches each weight: what bfloat16 drops of it
        assert not m.comp
        for mp, master in m.pairs():
            m.keeps(mp)
            torch.testing.assert_close(m.comp[id(master)].float(), (mp - mp.to(BF16).float()).to(BF16).float())
    net.to(BF16)
    m.follow_model()
    assert all(master.data_ptr() == mp.data_ptr() for mp, master in m.pairs())
