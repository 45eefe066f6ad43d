"""One truth for the weights (issue 43): whatever a user writes last, through any idiom, is
what trains and what is saved, at every level and master mode: EMA copies (timm's ModelEmaV2
and V3 code paths, torch's AveragedModel), writes into `state_dict()` values, in-place edits
of parameters (`nn.init`, a WGAN clip, through `.data` too), loads of values exactly
representable in half, unfreezing with `add_param_group`, frozen params and buffers saved
exactly, `model.float()` after initialize refused with the fix."""
from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from _idioms import ema_v3_update
from torch import nn

import ampatch as amp

F32, BF16 = torch.float32, torch.bfloat16
# (level, keywords): every level and master mode
CONFIGS = {
    "O0": ("O0", {}),
    "O1": ("O1", {}),
    "O2": ("O2", {}),
    "O3": ("O3", {}),
    "O4": ("O4", {}),
    "O5": ("O5", {}),
    "O5-stochastic": ("O5", {"master_weights": "stochastic"}),
    "O5-kahan": ("O5", {"master_weights": "kahan"}),
}
CAST = ["O2", "O3", "O5", "O5-stochastic", "O5-kahan"]
MASTERS = ["O2", "O5"]  # FP32 masters: the model's state_dict() holds FP32 values


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 32)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 4)
        self.register_buffer("offset", torch.linspace(-1, 1, 4) / 3)  # not representable in bfloat16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.body(x)))) + self.offset


def make(config: str, lr: float = 1e-2, seed: int = 0, frozen: tuple[str, ...] = ()):
    torch.manual_seed(seed)
    model = Net()
    for name in frozen:
        for p in getattr(model, name).parameters():
            p.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    level, kw = CONFIGS[config]
    return amp.initialize(model, opt, opt_level=level, verbosity=0, **kw)


def batch(i: int = 0):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def train(model, opt, steps: int, first: int = 0) -> None:
    for i in range(first, first + steps):
        x, y = batch(i)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()


def set_lr(opt, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr


def initial_and_trained(config: str, frozen: tuple[str, ...] = ("body",)):
    """The FP32 initial state of `make`'s model, and that model with `frozen` frozen, 2 steps on."""
    torch.manual_seed(0)
    exact = {k: v.detach().clone() for k, v in Net().state_dict().items()}
    model, opt = make(config, frozen=frozen)
    train(model, opt, 2)
    return exact, model, opt


def half_of(config: str) -> torch.dtype:
    return BF16 if config in CAST else F32


@pytest.fixture(autouse=True)
def _end_session():
    yield
    amp.deinitialize()


# ------------------------------------------------------------------ 1. EMA copies
def ema_v2_update(ema: nn.Module, model: nn.Module, decay: float) -> None:
    """timm's ModelEmaV2._update, as timm writes it."""
    with torch.no_grad():
        for ema_v, model_v in zip(ema.state_dict().values(), model.state_dict().values()):
            ema_v.copy_(decay * ema_v + (1.0 - decay) * model_v)


@pytest.mark.parametrize("update", [ema_v3_update, ema_v2_update], ids=["ModelEmaV3", "ModelEmaV2"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_an_ema_copy_follows_the_model_exactly_in_the_dtype_state_dict_gives(config, update):
    model, opt = make(config)
    ema = copy.deepcopy(model)  # after initialize, as timm's train.py makes it
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for i in range(4):
        train(model, opt, 1, first=i)
        update(ema, model, 0.9)
        for k, v in model.state_dict().items():
            if v.is_floating_point():
                with torch.no_grad():  # the same arithmetic, on plain tensors of the same dtypes
                    if update is ema_v3_update:
                        expected[k].lerp_(v, 0.1)
                    else:
                        expected[k].copy_(0.9 * expected[k] + 0.1 * v)
    got = ema.state_dict()
    assert got.keys() == expected.keys()
    for k in got:
        assert got[k].dtype == expected[k].dtype and torch.equal(got[k], expected[k]), k
    # the copy's forward runs the averaged weights (rounded to its half dtype), the original's masters untouched
    x, _ = batch(50)
    plain = Net()
    plain.load_state_dict({k: v.float() for k, v in got.items()})
    if config in CAST:
        plain = plain.to(half_of(config))
        want = plain(x.to(half_of(config))).float()
    else:
        want = plain(x)
    torch.testing.assert_close(ema(x).float(), want, rtol=0, atol=0)
    assert not torch.equal(got["head.weight"].float(), model.state_dict()["head.weight"].float())


@pytest.mark.parametrize("config", list(CONFIGS))
def test_an_averaged_model_updates_and_evaluates(config):
    model, opt = make(config)
    swa = torch.optim.swa_utils.AveragedModel(model)
    start = {k: v.detach().clone() for k, v in swa.module.state_dict().items()}
    for i in range(3):
        train(model, opt, 1, first=i)
        swa.update_parameters(model)
    now = swa.module.state_dict()
    assert not torch.equal(now["body.weight"], start["body.weight"])
    x, _ = batch(7)
    out = swa(x)
    assert torch.isfinite(out).all()
    # its parameters are what it averaged: the forward sees them
    with torch.no_grad():
        for p in swa.module.parameters():
            p.zero_()
    assert torch.equal(swa(x).float(), swa.module.offset.float().expand(16, 4))


@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_write_into_the_live_state_dict_reaches_the_next_forward_and_is_trained(config):
    model, opt = make(config)
    train(model, opt, 2)
    own = model.state_dict()
    target = torch.full_like(own["head.weight"], 0.25)
    own["head.weight"].copy_(target)
    x, _ = batch(9)
    model(x)  # the forward runs what was written
    assert torch.equal(model.head.weight, target.to(model.head.weight.dtype))
    set_lr(opt, 0.0)
    train(model, opt, 1, first=3)
    assert torch.equal(model.state_dict()["head.weight"].float(), target.float())


# ------------------------------------------------------------------ 2. in-place edits
@pytest.mark.parametrize("how", ["no_grad", "data", "init"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_an_in_place_edit_survives_the_next_step(config, how):
    model, opt = make(config)
    train(model, opt, 3)
    with torch.no_grad():
        for p in model.parameters():  # a WGAN clip
            if how == "data":
                p.data.clamp_(-0.01, 0.01)
            else:
                p.clamp_(-0.01, 0.01)
        if how == "init":
            nn.init.zeros_(model.head.weight)
    clipped = {k: v.detach().clone() for k, v in model.named_parameters()}
    set_lr(opt, 0.0)
    train(model, opt, 1, first=3)
    sd = model.state_dict()
    masters = {id(p): m for p, m in zip(model.parameters(), amp.master_params(opt))}
    for k, p in model.named_parameters():
        assert torch.equal(p, clipped[k]), k  # the step kept the edit
        # what is saved and stepped is the edit: exactly where it changed a value (the clip, the
        # zeros), the exact value it rounds to elsewhere (an element the clip left alone)
        edited = clipped[k].float().abs() == torch.tensor(0.01).to(p.dtype).float()
        if how == "init" and k == "head.weight":
            edited = torch.ones_like(edited)
        for saved in (sd[k], masters[id(p)]):
            assert torch.equal(saved.to(p.dtype), p), k
            assert torch.equal(saved.float()[edited], clipped[k].float()[edited]), k


@pytest.mark.parametrize("config", MASTERS)
def test_a_write_to_the_half_weight_wins_where_it_changed_a_value(config):
    """The master follows the half weight element by element: an element the write changed
    takes the written value exactly, one it left as it was keeps its exact value (a write that
    changes no bit changes nothing)."""
    model, opt = make(config, lr=1e-2)
    train(model, opt, 3)
    before = model.state_dict()["norm.weight"].clone()
    with torch.no_grad():
        model.norm.weight[:16] = 1.0  # half of it: to a value the other half does not hold
        model.norm.weight[16:] = model.norm.weight[16:].clone()  # a write that changes no bit
    sd = model.state_dict()["norm.weight"]
    assert torch.equal(sd[:16], torch.ones(16))
    assert torch.equal(sd[16:], before[16:])
    assert not torch.equal(before[16:], before[16:].to(BF16).float())  # the test can fail


# ------------------------------------------------------------------ 3. loads of half-exact values
@pytest.mark.parametrize("config", list(CONFIGS))
def test_load_state_dict_takes_values_exactly_representable_in_half(config):
    model, opt = make(config, lr=3e-2)
    saved = {k: v.detach().float().clone() for k, v in model.state_dict().items()}  # LayerNorm: exactly 1.0 and 0.0
    train(model, opt, 4)
    assert not torch.equal(model.state_dict()["norm.weight"].float(), saved["norm.weight"])
    model.load_state_dict(saved)  # a rewind
    for k, v in model.state_dict().items():
        if config in MASTERS or config in ("O0", "O1", "O4") or k == "offset":
            assert torch.equal(v.float(), saved[k]), k
        else:  # the half weight is the only copy: the value rounded
            assert torch.equal(v.float(), saved[k].to(BF16).float()), k
    set_lr(opt, 0.0)
    train(model, opt, 1, first=4)
    assert torch.equal(model.norm.weight.float(), torch.ones(32))


@pytest.mark.parametrize("config", MASTERS)
def test_a_half_checkpoint_gives_masters_equal_to_its_widened_values(config):
    model, opt = make(config)
    train(model, opt, 2)
    half = {k: v.to(BF16) for k, v in model.state_dict().items()}
    model.load_state_dict(half)
    for p, m in zip(model.parameters(), amp.master_params(opt)):
        assert torch.equal(m, p.float())


# ------------------------------------------------------------------ 4. unfreezing
@pytest.mark.parametrize("config", MASTERS)
def test_unfreezing_seeds_masters_from_the_exact_values(config):
    exact, model, opt = initial_and_trained(config)
    for p in model.body.parameters():
        p.requires_grad_(True)
    opt.add_param_group({"params": list(model.body.parameters()), "lr": 0.0})
    masters = list(amp.master_params(opt))[-2:]
    assert torch.equal(masters[0], exact["body.weight"]) and torch.equal(masters[1], exact["body.bias"])
    assert not torch.equal(exact["body.weight"].to(BF16).float(), exact["body.weight"])  # the test can fail
    train(model, opt, 2, first=2)
    assert torch.equal(model.state_dict()["body.weight"], exact["body.weight"])  # lr 0: still exact


# ------------------------------------------------------------------ 5. frozen params and buffers
@pytest.mark.parametrize("config", MASTERS)
def test_frozen_params_and_buffers_are_saved_exactly_and_aliased(config):
    exact, model, opt = initial_and_trained(config)
    sd = model.state_dict()
    for k in ("body.weight", "body.bias", "offset"):
        assert sd[k].dtype == F32 and torch.equal(sd[k], exact[k]), k
    again = model.state_dict()
    assert again["offset"].data_ptr() == sd["offset"].data_ptr()  # aliased: no copy per save
    buf = io.BytesIO()
    torch.save(sd, buf)
    fresh, fopt = make(config, seed=3, frozen=("body",))
    fresh.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    for k in ("body.weight", "body.bias", "offset"):
        assert torch.equal(fresh.state_dict()[k], exact[k]), k


@pytest.mark.parametrize("config", list(CONFIGS))
def test_state_dict_aliases_live_tensors(config):
    model, opt = make(config)
    train(model, opt, 1)
    sd = model.state_dict()
    live = {id(p): p for p in model.parameters()}
    masters = {id(p): m for p, m in zip(model.parameters(), amp.master_params(opt))}
    for k, p in model.named_parameters():
        owner = masters[id(p)] if config in MASTERS else p
        assert sd[k].data_ptr() == owner.data_ptr(), k
        assert sd[k].dtype == (F32 if config in MASTERS else p.dtype), k
    assert len(live) == len(sd) - 1


def test_kahan_compensation_travels_in_the_optimizer_state_and_resumes_exactly():
    model, opt = make("O5-kahan", lr=1e-3)
    train(model, opt, 3)
    ckpt = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})
    assert all(v.dtype == BF16 for k, v in ckpt["model"].items() if k != "offset")
    assert any("ampatch_compensation" in s for s in ckpt["optimizer"]["state"].values())
    train(model, opt, 2, first=3)
    after = {k: v.detach().clone() for k, v in model.state_dict().items()}
    amp.deinitialize()
    for order in ("model-first", "optimizer-first", "plain-then-initialize"):
        saved = copy.deepcopy(ckpt)  # torch's optimizer loads 'step' without a copy, then steps it
        torch.manual_seed(5)
        fresh = Net()
        fopt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
        if order == "plain-then-initialize":
            fresh.load_state_dict(saved["model"])
            fopt.load_state_dict(saved["optimizer"])
            fresh, fopt = amp.initialize(fresh, fopt, opt_level="O5", master_weights="kahan", verbosity=0)
        else:
            fresh, fopt = amp.initialize(fresh, fopt, opt_level="O5", master_weights="kahan", verbosity=0)
            loads = [(fresh, saved["model"]), (fopt, saved["optimizer"])]
            for target, state in (loads if order == "model-first" else loads[::-1]):
                target.load_state_dict(state)
        train(fresh, fopt, 2, first=3)
        for k, v in fresh.state_dict().items():
            assert torch.equal(v, after[k]), (order, k)
        amp.deinitialize()


# ------------------------------------------------------------------ deep copies and the model changed after initialize
@pytest.mark.parametrize("config", CAST)
def test_a_deep_copy_is_an_ordinary_half_model_of_its_own(config):
    model, opt = make(config)
    train(model, opt, 1)
    masters = [m.detach().clone() for m in amp.master_params(opt)]
    twin = copy.deepcopy(model)
    assert all(p.dtype == BF16 for n, p in twin.named_parameters() if "norm" not in n or config != "O2")
    with torch.no_grad():
        for v in twin.state_dict().values():
            v.mul_(0.5)
    assert all(torch.equal(a, b) for a, b in zip(masters, amp.master_params(opt)))
    x, _ = batch(3)
    assert not torch.equal(twin(x), model(x))
    twin.float()  # an FP32 EMA is one call away, and takes the exact values where the copy kept them
    assert twin(x).dtype == F32
    restored = pickle_roundtrip(model)
    assert restored.state_dict().keys() == model.state_dict().keys()


def pickle_roundtrip(model):
    buf = io.BytesIO()
    torch.save(model, buf)
    return torch.load(io.BytesIO(buf.getvalue()), weights_only=False)


@pytest.mark.parametrize("change", ["float", "replace"])
@pytest.mark.parametrize("config", CAST)
def test_a_model_changed_after_initialize_names_deinitialize(config, change):
    model, opt = make(config)
    if change == "float":
        model.float()
    else:
        model.head = nn.Linear(32, 4)
    with pytest.raises(RuntimeError) as info:
        model(batch(0)[0])
    notes = "\n".join(getattr(info.value, "__notes__", [])) + str(info.value)
    assert "amp.deinitialize()" in notes
    assert ("'head' was replaced" if change == "replace" else "'body.weight' is float32") in notes
