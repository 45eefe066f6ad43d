"""Loss scaling: scale_loss, skip-on-overflow, several models/losses/optimizers.

Levels O0-O3 run with half_dtype=torch.float16 (O1/O2 then default to a dynamic scale),
O4/O5 with bfloat16. Models are tiny and runs are a few steps. Where training must match a
reference exactly, the reference runs at the same level; where it is compared with FP32
autograd, the reference starts each iteration from the same (master) weights.
"""
from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampatch as amp
import ampatch.optim.scaler as scaler_mod
from ampatch.optim.scaler import LossScaler

FP16 = torch.float16
LEVELS = ["O0", "O1", "O2", "O3", "O4", "O5"]
# Overrides that make every level check for overflow (O0/O3/O4 default to a static 1.0 and
# then scale_loss does nothing, like plain PyTorch).
CHECKING = {"O0": {"loss_scale": 128.0}, "O1": {}, "O2": {}, "O3": {"loss_scale": "dynamic"},
            "O4": {"loss_scale": "dynamic"}, "O5": {}}
CONFIGS = [(lv, {}) for lv in LEVELS] + [(lv, CHECKING[lv]) for lv in ("O0", "O3", "O4")]
CONFIG_IDS = LEVELS + ["O0-static128", "O3-dynamic", "O4-dynamic"]
# Relative tolerance of a gradient against FP32 autograd from the same weights.
TOL = {"O0": 1e-5, "O1": 1e-2, "O2": 1e-2, "O3": 1e-2, "O4": 6e-2, "O5": 6e-2}



def adam(params) -> torch.optim.Adam:
    # eps representable in float16: with the default 1e-8, pure-half O3 Adam divides by zero
    return torch.optim.Adam(params, lr=1e-2, eps=1e-4)


def half_for(level: str) -> torch.dtype | None:
    return FP16 if level in ("O0", "O1", "O2", "O3") else None


def init(models, optimizers, level, **kw):
    kw.setdefault("verbosity", 0)
    return amp.initialize(models, optimizers, opt_level=level, half_dtype=half_for(level), **kw)


def checks_overflow(level: str, kw: dict) -> bool:
    scale = kw.get("loss_scale", "dynamic" if level in ("O1", "O2") else 1.0)
    return scale != 1.0 or level in ("O2", "O5")


def is_dynamic(level: str, kw: dict) -> bool:
    return kw.get("loss_scale", "dynamic" if level in ("O1", "O2") else 1.0) == "dynamic"


def make_model(seed: int = 0, width: int = 8, bn: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    if bn:  # under O2/O5 batch norm stays FP32: its params are their own masters
        return nn.Sequential(nn.Linear(4, width, bias=False), nn.BatchNorm1d(width), nn.Tanh(), nn.Linear(width, 2))
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 2))  # smooth: no ReLU gate flips


def batches(n: int, n_targets: int = 1, seed: int = 1) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 4, generator=g) * 0.5,
             [torch.randn(8, 2, generator=g) * 0.5 for _ in range(n_targets)]) for _ in range(n)]


def clone_tree(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: clone_tree(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(clone_tree(v) for v in x)
    return x


def assert_same(a, b, path="") -> None:
    """Bit-for-bit equality of nested dicts/lists of tensors and numbers."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), f"tensors differ at {path}: max |diff| {(a.float() - b.float()).abs().max()}"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def snapshot(models, opts) -> dict:
    """Everything a step may change: model weights (FP32 view), masters, optimizer state."""
    return {"models": [clone_tree(m.state_dict()) for m in models],
            "masters": [[p.detach().clone() for p in amp.master_params(o)] for o in opts],
            "opt_state": [clone_tree(o.state_dict()) for o in opts]}


def relerr(g: torch.Tensor, ref: torch.Tensor, floor: float = 1e-12) -> float:
    """|g - ref| / |ref|; `floor` bounds the denominator for grads that are nearly zero."""
    g, ref = g.detach().float(), ref.detach().float()
    return float((g - ref).norm() / ref.norm().clamp_min(floor))


def inject(param: torch.Tensor, kind: str) -> None:
    param.grad.view(-1)[0] = float(kind)


# ============================================================== LossScaler (unit)
def test_dynamic_scaler_starts_at_2_16_and_doubles_after_exactly_2000_clean_steps():
    s = LossScaler("dynamic")
    assert s.dynamic and s.scale == 2.0 ** 16
    for i in range(1999):
        s.update(False, i)
    assert s.scale == 2.0 ** 16 and s.unskipped == 1999
    s.update(False, 1999)
    assert s.scale == 2.0 ** 17 and s.unskipped == 0
    for i in range(2000):
        s.update(False, 2000 + i)
    assert s.scale == 2.0 ** 18


def test_dynamic_scaler_backoff_resets_the_clean_count():
    s = LossScaler("dynamic")
    for i in range(1500):
        s.update(False, i)
    s.update(True, 1500)
    assert s.scale == 2.0 ** 15 and s.unskipped == 0
    for i in range(1999):
        s.update(False, i)
    assert s.scale == 2.0 ** 15  # the 1500 clean steps before the overflow do not count
    s.update(False, 0)
    assert s.scale == 2.0 ** 16


def test_dynamic_scaler_floor_and_ceiling():
    s = LossScaler("dynamic", min_loss_scale=2.0 ** 14)
    for i in range(5):
        s.update(True, i)
    assert s.scale == 2.0 ** 14
    s = LossScaler("dynamic")  # no floor: keeps halving
    for i in range(20):
        s.update(True, i)
    assert s.scale == 2.0 ** -4
    s = LossScaler("dynamic", max_loss_scale=2.0 ** 17)
    for i in range(3 * 2000):
        s.update(False, i)
    assert s.scale == 2.0 ** 17
    assert LossScaler("dynamic", max_loss_scale=2.0 ** 10).scale == 2.0 ** 10  # start capped too


def test_static_scaler_never_changes():
    s = LossScaler(128.0)
    assert not s.dynamic and not s.is_identity
    s.update(True, 0)
    assert s.scale == 128.0
    for i in range(4001):
        s.update(False, i)
    assert s.scale == 128.0
    assert LossScaler(1.0).is_identity and not LossScaler("dynamic").is_identity


def test_scaler_state_dict_is_plain_numbers_and_rejects_unknown_keys():
    s = LossScaler("dynamic")
    s.update(False, 0)
    sd = s.state_dict()
    assert sd == {"loss_scale": 65536.0, "unskipped": 1}
    assert type(sd["loss_scale"]) is float and type(sd["unskipped"]) is int
    t = LossScaler("dynamic")
    t.load_state_dict({"loss_scale": 4.0, "unskipped": 7})
    assert (t.scale, t.unskipped) == (4.0, 7)
    for bad in ({"loss_scale": 4.0, "unskipped": 7, "growth": 2}, {"unskipped": 7}):
        with pytest.raises(KeyError):
            t.load_state_dict(bad)
    with pytest.raises(ValueError):
        t.load_state_dict({"loss_scale": float("inf"), "unskipped": 7})
    assert (t.scale, t.unskipped) == (4.0, 7)  # a rejected state changes nothing


def test_unscale_helper_uses_the_fused_kernel():
    assert scaler_mod._unscale_ is torch._amp_foreach_non_finite_check_and_unscale_
    grads = [torch.full((3,), 8.0), torch.full((2,), 8.0, dtype=FP16), torch.full((2,), 8.0, dtype=torch.bfloat16)]
    flag = scaler_mod.unscale_(grads, 0.125, None)
    assert float(flag) == 0.0 and all(torch.equal(g.float(), torch.ones_like(g.float())) for g in grads)
    grads[1][0] = float("nan")
    assert float(scaler_mod.unscale_(grads, 1.0, None)) == 1.0
    assert float(scaler_mod.unscale_([torch.ones(2)], 1.0, torch.ones(()))) == 1.0  # ORed into an existing flag


# ============================================================== API edges
def test_scale_loss_before_initialize_raises():
    loss = torch.ones((), requires_grad=True)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    with pytest.raises(RuntimeError, match="initialize"):
        with amp.scale_loss(loss, opt):
            pass
    for fn in (amp.loss_scale, amp.state_dict):
        with pytest.raises(RuntimeError, match="initialize"):
            fn()
    with pytest.raises(RuntimeError, match="initialize"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 1.0, "unskipped": 0}})


@pytest.mark.parametrize("level", ["O0", "O1", "O2"])
def test_bad_loss_id_raises_value_error(level):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = init(model, opt, level, num_losses=2)
    x, (y,) = batches(1)[0]
    for bad in (2, -1, 5):
        loss = F.mse_loss(model(x), y)
        with pytest.raises(ValueError, match="loss_id"):
            with amp.scale_loss(loss, opt, loss_id=bad):
                pass
        with pytest.raises(ValueError, match="loss_id"):
            amp.loss_scale(bad)
    with amp.scale_loss(F.mse_loss(model(x), y), opt, loss_id=1) as sl:  # the valid ids work
        sl.backward()


@pytest.mark.parametrize("level,expected", [("O0", 1.0), ("O1", 65536.0), ("O2", 65536.0), ("O3", 1.0),
                                            ("O4", 1.0), ("O5", 1.0)])
def test_loss_scale_value_and_scaled_loss(level, expected):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = init(model, opt, level, num_losses=2)
    assert amp.loss_scale() == expected and amp.loss_scale(1) == expected
    assert type(amp.loss_scale()) is float
    x, (y,) = batches(1)[0]
    loss = F.mse_loss(model(x), y)
    with amp.scale_loss(loss, opt) as sl:
        assert sl.dtype == torch.float32
        assert torch.equal(sl, loss.float() * expected)
        sl.backward()


@pytest.mark.parametrize("level", ["O0", "O3", "O4"])
def test_static_one_without_masters_is_plain_pytorch(level):
    """scale_loss yields the loss itself, grads are plain autograd's, and an inf is not caught."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = init(model, opt, level)
    calls = []
    real = scaler_mod._unscale_
    scaler_mod._unscale_ = lambda *a: (calls.append(a), real(*a))[1]
    try:
        x, (y,) = batches(1)[0]
        loss = F.mse_loss(model(x), y)
        with amp.scale_loss(loss, opt) as sl:
            assert sl is loss
            sl.backward()
        plain = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        F.mse_loss(model(x), y).backward()
        assert_same(plain, [p.grad.clone() for p in model.parameters()])
        assert not calls  # no unscale, no check
        loss = F.mse_loss(model(x), y)
        with amp.scale_loss(loss, opt) as sl:
            sl.backward()
            inject(next(model.parameters()), "inf")
        opt.step()
        assert not torch.isfinite(next(model.parameters())).all()  # the step ran, as in plain PyTorch
    finally:
        scaler_mod._unscale_ = real


@pytest.mark.parametrize("level", ["O1", "O2", "O5"])
def test_unscale_is_one_fused_call_without_per_tensor_sync(level):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(6)])  # 12 params
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = init(model, opt, level)
    x = torch.randn(4, 3)
    calls, items = [], []
    real_unscale, real_item = scaler_mod._unscale_, torch.Tensor.item
    had_item = "item" in torch.Tensor.__dict__

    def spy_item(t):
        items.append(t.numel())
        return real_item(t)

    loss = model(x).float().pow(2).mean()
    try:
        with amp.scale_loss(loss, opt) as sl:
            sl.backward()
            # spies on for the exit of the block, where grads are unscaled and checked
            scaler_mod._unscale_ = lambda grads, flag, inv: (calls.append(len(grads)),
                                                             real_unscale(grads, flag, inv))[1]
            torch.Tensor.item = spy_item
    finally:
        scaler_mod._unscale_ = real_unscale
        if had_item:
            torch.Tensor.item = real_item
        else:
            del torch.Tensor.item
    # The exit of the block ran with the spies in place.
    assert sum(calls) == 12 and len(calls) == 1, calls
    assert len(items) <= 1  # one host sync for the verdict, not one per tensor


@pytest.mark.parametrize("level", LEVELS)
def test_master_params(level):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = init(model, opt, level)
    masters = list(amp.master_params(opt))
    assert masters == [p for g in opt.param_groups for p in g["params"]]
    assert len(masters) == 4
    if level in ("O2", "O5"):
        assert all(m.dtype == torch.float32 for m in masters)
        assert all(m is not p for m, p in zip(masters, model.parameters()))
    else:
        assert all(m is p for m, p in zip(masters, model.parameters()))
    # clipping the masters after scale_loss clips what the optimizer steps
    x, (y,) = batches(1)[0]
    with amp.scale_loss(F.mse_loss(model(x), y), opt) as sl:
        sl.backward()
    norm = torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 1e-3)
    assert norm > 1e-3
    total = torch.cat([m.grad.float().flatten() for m in amp.master_params(opt)]).norm()
    assert total == pytest.approx(1e-3, rel=2e-2)


# ============================================================== amp.state_dict
def test_state_dict_format():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = init(model, opt, "O1", num_losses=3)
    sd = amp.state_dict()
    assert sd == {f"loss_scaler{i}": {"loss_scale": 65536.0, "unskipped": 0} for i in range(3)}
    x, (y,) = batches(1)[0]
    for _ in range(2):
        opt.zero_grad()
        with amp.scale_loss(F.mse_loss(model(x), y), opt, loss_id=1) as sl:
            sl.backward()
        opt.step()
    opt.zero_grad()
    with amp.scale_loss(F.mse_loss(model(x), y), opt, loss_id=2) as sl:
        sl.backward()
        inject(next(model.parameters()), "nan")
    opt.step()
    sd = amp.state_dict()
    assert sd == {"loss_scaler0": {"loss_scale": 65536.0, "unskipped": 0},
                  "loss_scaler1": {"loss_scale": 65536.0, "unskipped": 2},
                  "loss_scaler2": {"loss_scale": 32768.0, "unskipped": 0}}
    for v in sd.values():
        assert set(v) == {"loss_scale", "unskipped"}
        assert type(v["loss_scale"]) is float and type(v["unskipped"]) is int


def test_state_dict_round_trips_through_weights_only_load(tmp_path):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = init(model, opt, "O2", num_losses=2)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 512.0, "unskipped": 3},
                         "loss_scaler1": {"loss_scale": 8.0, "unskipped": 1999}})
    torch.save(amp.state_dict(), tmp_path / "amp.pt")
    loaded = torch.load(tmp_path / "amp.pt", weights_only=True)
    model, opt = init(make_model(), torch.optim.SGD(make_model().parameters(), lr=0.1), "O2", num_losses=2)
    assert amp.state_dict() != loaded
    amp.load_state_dict(loaded)
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 512.0, "unskipped": 3},
                                "loss_scaler1": {"loss_scale": 8.0, "unskipped": 1999}}
    assert amp.loss_scale(0) == 512.0 and amp.loss_scale(1) == 8.0


def test_load_state_dict_rejects_unknown_keys_and_warns_on_count_mismatch(caplog):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = init(model, opt, "O1", num_losses=2, verbosity=1)
    good = {"loss_scale": 4.0, "unskipped": 1}
    for error in (KeyError, ValueError):  # an unknown key is both
        with pytest.raises(error, match="scaler1"):
            amp.load_state_dict({"loss_scaler0": good, "scaler1": good})
    bad_entries = [dict(good, extra=1), {"loss_scale": 4.0}, {"loss_scale": 0.0, "unskipped": 1},
                   {"loss_scale": float("nan"), "unskipped": 1}, 4.0]
    for bad in bad_entries:  # a bad second entry: nothing is loaded, not even the good first one
        with pytest.raises((ValueError, KeyError, TypeError)):
            amp.load_state_dict({"loss_scaler0": good, "loss_scaler1": bad})
    assert amp.state_dict() == {f"loss_scaler{i}": {"loss_scale": 65536.0, "unskipped": 0} for i in range(2)}
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ampatch"):
        amp.load_state_dict({"loss_scaler0": good, "loss_scaler1": good})
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    with caplog.at_level(logging.WARNING, logger="ampatch"), pytest.warns(UserWarning, match="num_losses"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 2.0, "unskipped": 5}})
    assert any(r.levelno == logging.WARNING and "loss scaler" in r.getMessage() for r in caplog.records)
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 2.0, "unskipped": 5}, "loss_scaler1": good}
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ampatch"):
        amp.load_state_dict({f"loss_scaler{i}": good for i in range(3)})
    assert any(r.levelno == logging.WARNING for r in caplog.records)


# ============================================================== dynamic scale in training
def one_param_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(1, 1, bias=False)


def one_param_step(model, opt, x, y, poison: bool = False) -> None:
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    with amp.scale_loss(loss, opt) as sl:
        sl.backward()
        if poison:
            inject(model.weight, "inf")
    opt.step()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_scale_doubles_after_2000_clean_float16_steps(level):
    model = one_param_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, opt = init(model, opt, level)
    x, y = torch.full((2, 1), 0.5), torch.full((2, 1), 0.25)
    for _ in range(1999):
        one_param_step(model, opt, x, y)
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 65536.0, "unskipped": 1999}
    one_param_step(model, opt, x, y)
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 131072.0, "unskipped": 0}
    assert amp.report().skipped_steps == []


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_backoff_floor_and_ceiling_in_training(level):
    x, y = torch.full((2, 1), 0.5), torch.full((2, 1), 0.25)
    # backoff and floor: every poisoned step is skipped, the scale stops at min_loss_scale
    model = one_param_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, opt = init(model, opt, level, min_loss_scale=2.0 ** 14)
    w0 = model.weight.detach().clone()
    scales = []
    for _ in range(4):
        one_param_step(model, opt, x, y, poison=True)
        scales.append(amp.loss_scale())
    assert scales == [2.0 ** 15, 2.0 ** 14, 2.0 ** 14, 2.0 ** 14]
    assert torch.equal(model.weight, w0) and amp.report().skipped_steps == [0, 1, 2, 3]
    one_param_step(model, opt, x, y)
    assert not torch.equal(model.weight, w0)
    # ceiling: the start is capped, and growth stops at max_loss_scale
    model = one_param_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, opt = init(model, opt, level, max_loss_scale=2.0 ** 12)
    assert amp.loss_scale() == 2.0 ** 12
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 2.0 ** 11, "unskipped": 1999}})
    one_param_step(model, opt, x, y)
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 2.0 ** 12, "unskipped": 0}
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 2.0 ** 12, "unskipped": 1999}})
    one_param_step(model, opt, x, y)
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 2.0 ** 12, "unskipped": 0}


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_static_scale_checks_overflow_and_never_changes(level):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = init(model, opt, level, loss_scale=128.0)
    data = batches(3)
    for i, (x, (y,)) in enumerate(data):
        before = snapshot([model], [opt])
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        with amp.scale_loss(loss, opt) as sl:
            assert torch.equal(sl, loss.float() * 128.0)
            sl.backward()
            if i == 1:
                inject(next(model.parameters()), "inf")
        opt.step()
        after = snapshot([model], [opt])
        if i == 1:
            assert_same(before, after)
        else:
            with pytest.raises(AssertionError):
                assert_same(before["masters"], after["masters"])
        assert amp.loss_scale() == 128.0
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 128.0, "unskipped": 1999}})
    x, (y,) = data[0]
    opt.zero_grad()
    with amp.scale_loss(F.mse_loss(model(x), y), opt) as sl:
        sl.backward()
    assert amp.loss_scale() == 128.0
    assert amp.report().skipped_steps == [1]


# ============================================================== skip exactly the poisoned step
def train_single(level, kw, data, poison_at=None, kind="inf", skip_at=None, mirror=None):
    """Adam on one model; returns per-iteration amp states, the snapshots around the
    poisoned step, and the final snapshot. `skip_at` leaves out that iteration entirely
    and then loads the scaler state `mirror[skip_at]` (so both runs use the same scales)."""
    model = make_model()
    opt = adam(model.parameters())
    model, opt = init(model, opt, level, **kw)
    states, around = [], None
    for i, (x, (y,)) in enumerate(data):
        if i == skip_at:
            amp.load_state_dict(mirror[i])
            states.append(amp.state_dict())
            continue
        before = snapshot([model], [opt]) if i == poison_at else None
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        with amp.scale_loss(loss, opt) as sl:
            sl.backward()
            if i == poison_at:
                inject(list(model.parameters())[i % 4], kind)
        opt.step()
        if i == poison_at:
            around = (before, snapshot([model], [opt]))
        states.append(amp.state_dict())
    final = snapshot([model], [opt])
    skipped = amp.report().skipped_steps
    amp.deinitialize()
    return states, around, final, skipped


@pytest.mark.parametrize("kind", ["inf", "nan"])
@pytest.mark.parametrize("poison_at", [0, 2, 4])
@pytest.mark.parametrize("level", LEVELS)
def test_overflow_skips_exactly_that_step(level, poison_at, kind):
    kw = CHECKING[level]
    data = batches(6)
    states, (before, after), final, skipped = train_single(level, kw, data, poison_at, kind)
    assert skipped == [poison_at]
    assert_same(before, after)  # params, masters and optimizer state untouched
    s_before = states[poison_at - 1]["loss_scaler0"] if poison_at else {"loss_scale": (
        65536.0 if is_dynamic(level, kw) else float(kw.get("loss_scale", 1.0))), "unskipped": 0}
    s_after = states[poison_at]["loss_scaler0"]
    expected = s_before["loss_scale"] / 2 if is_dynamic(level, kw) else s_before["loss_scale"]
    assert s_after == {"loss_scale": expected, "unskipped": 0}
    # the reference never ran that iteration, and uses the same scales afterwards
    ref_states, _, ref_final, ref_skipped = train_single(level, kw, data, skip_at=poison_at, mirror=states)
    assert ref_skipped == []
    assert ref_states == states
    assert_same(final, ref_final)
    assert all(torch.isfinite(p).all() for p in final["masters"][0])


# ============================================================== several models/losses/optimizers
SPECS = {
    # groups: the models each optimizer steps; losses: (models summed, optimizers given to scale_loss)
    "2models-1opt": dict(n=2, groups=[[0, 1]], losses=[([0], [0]), ([1], [0])]),
    "2models-2opts": dict(n=2, groups=[[0], [1]], losses=[([0], [0]), ([1], [1])]),
    "3models-1opt": dict(n=3, groups=[[0, 1, 2]], losses=[([0, 1], [0]), ([1, 2], [0])]),
    "3models-2opts": dict(n=3, groups=[[0, 1], [2]], losses=[([0, 2], [0, 1]), ([1, 2], [0, 1])]),
}


def zero_grads(how, models, opts):
    if how == "optimizer":
        for o in opts:
            o.zero_grad()
    elif how == "optimizer-zeros":
        for o in opts:
            o.zero_grad(set_to_none=False)
    elif how == "model":
        for m in models:
            m.zero_grad()
    elif how == "model-zeros":
        for m in models:
            m.zero_grad(set_to_none=False)
    else:
        for m in models:
            for p in m.parameters():
                p.grad = None


def small_loss(out, y):
    # batch norm makes outputs O(1): keep scaled float16 grads clear of natural overflow
    return F.mse_loss(out, y) * 0.125


ZEROING = ["optimizer", "optimizer-zeros", "model", "model-zeros", "none-assign"]


@pytest.mark.parametrize("num_losses", [1, 2])
@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("level,kw", CONFIGS, ids=CONFIG_IDS)
def test_several_models_losses_optimizers(level, kw, spec, num_losses):
    """Per iteration, the grads each optimizer sees equal FP32 autograd of the summed losses
    from the same weights. A grad poisoned in loss 0's block (iteration 1) or loss 1's block
    (iteration 3) skips exactly the optimizers of that block (untouched) while the others
    step, and backs off only that loss's scaler; the other block's check sees only its own
    new grads."""
    sp = SPECS[spec]
    zeroing = ZEROING[(LEVELS.index(level) + list(SPECS).index(spec) + num_losses) % len(ZEROING)]
    models = [make_model(seed, bn=True) for seed in range(sp["n"])]
    ref_models = copy.deepcopy(models)
    opts = [adam([p for mi in g for p in models[mi].parameters()]) for g in sp["groups"]]
    models, opts = init(models, opts, level, num_losses=num_losses, **kw)
    checking = checks_overflow(level, kw)
    poison = {1: 0, 3: 1} if checking else {}  # iteration -> poisoned loss
    scales = [amp.loss_scale(i) for i in range(num_losses)]
    expected_skips = []
    for i, (x, ys) in enumerate(batches(5, n_targets=2)):
        start = [[p.detach().float().clone() for p in amp.master_params(o)] for o in opts]
        # FP32 reference grads from the same weights
        with torch.no_grad():
            for j, g in enumerate(sp["groups"]):
                for rp, w in zip([p for mi in g for p in ref_models[mi].parameters()], start[j], strict=True):
                    rp.copy_(w)
        for m in ref_models:
            m.zero_grad()
        with amp.disable_casts():
            for (mids, _), y in zip(sp["losses"], ys):
                small_loss(sum(ref_models[mi](x) for mi in mids), y).backward()
        ref = [[p.grad for mi in g for p in ref_models[mi].parameters()] for g in sp["groups"]]

        zero_grads(zeroing, models, opts)
        for lid, ((mids, oids), y) in enumerate(zip(sp["losses"], ys)):
            loss = small_loss(sum(models[mi](x) for mi in mids), y)
            with amp.scale_loss(loss, [opts[o] for o in oids], loss_id=lid % num_losses) as sl:
                sl.backward()
                if poison.get(i) == lid:
                    inject(next(models[mids[-1]].parameters()), "inf")
        skip = set(sp["losses"][poison[i]][1]) if i in poison else set()
        if i in poison:
            expected_skips.append(i)
            if is_dynamic(level, kw):
                scales[poison[i] % num_losses] /= 2
        assert [amp.loss_scale(k) for k in range(num_losses)] == scales
        grads = [[p.grad for p in amp.master_params(o)] for o in opts]
        before = snapshot(models, opts)
        for o in opts:
            o.step()
        after = snapshot(models, opts)
        for j in range(len(opts)):
            if j in skip:
                assert_same(before["masters"][j], after["masters"][j])
                assert_same(before["opt_state"][j], after["opt_state"][j])
            else:
                floor = 0.05 * float(torch.cat([r.flatten() for r in ref[j]]).norm())
                for k, (g, r) in enumerate(zip(grads[j], ref[j], strict=True)):
                    assert g is not None and relerr(g, r, floor) < TOL[level], (i, j, k, relerr(g, r, floor))
                assert all(not torch.equal(a, b) for a, b in zip(before["masters"][j], after["masters"][j]))
    assert sorted(set(amp.report().skipped_steps)) == expected_skips


def test_an_optimizer_whose_loss_did_not_overflow_still_steps():
    """Two optimizers, each with its own loss; loss 1 overflows: optimizer 0 steps."""
    m0, m1 = make_model(0), make_model(1)
    o0 = torch.optim.SGD(m0.parameters(), lr=0.1, momentum=0.9)
    o1 = torch.optim.SGD(m1.parameters(), lr=0.1, momentum=0.9)
    [m0, m1], [o0, o1] = init([m0, m1], [o0, o1], "O2", num_losses=2)
    x, (y0, y1) = batches(1, n_targets=2)[0]
    before = snapshot([m0, m1], [o0, o1])
    with amp.scale_loss(F.mse_loss(m0(x), y0), o0, loss_id=0) as sl:
        sl.backward()
    with amp.scale_loss(F.mse_loss(m1(x), y1), o1, loss_id=1) as sl:
        sl.backward()
        inject(next(m1.parameters()), "inf")
    o0.step()
    o1.step()
    after = snapshot([m0, m1], [o0, o1])
    assert_same(before["models"][1], after["models"][1])
    assert_same(before["opt_state"][1], after["opt_state"][1])
    assert not torch.equal(before["masters"][0][0], after["masters"][0][0])
    assert len(after["opt_state"][0]["state"]) == 4 and len(after["opt_state"][1]["state"]) == 0
    assert (amp.loss_scale(0), amp.loss_scale(1)) == (65536.0, 32768.0)


# ============================================================== accumulation
SCALED = {"O0": {"loss_scale": "dynamic"}, "O1": {}, "O2": {}, "O3": {"loss_scale": "dynamic"},
          "O4": {"loss_scale": "dynamic"}, "O5": {"loss_scale": "dynamic"}}


def grads_of(opt) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in amp.master_params(opt)]


def backward_in(model, opt, x, y, loss_id=0, delay_unscale=False):
    with amp.scale_loss(F.mse_loss(model(x), y), opt, loss_id=loss_id, delay_unscale=delay_unscale) as sl:
        sl.backward()


@pytest.mark.parametrize("level", LEVELS)
def test_backward_passes_with_different_scales_accumulate(level):
    model = make_model()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = init(model, opt, level, num_losses=2, **SCALED[level])
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 2.0 ** 16, "unskipped": 0},
                         "loss_scaler1": {"loss_scale": 2.0 ** 3, "unskipped": 0}})
    x, (y0, y1) = batches(1, n_targets=2)[0]
    opt.zero_grad()
    backward_in(model, opt, x, y0, 0)
    g0 = grads_of(opt)
    opt.zero_grad()
    backward_in(model, opt, x, y1, 1)
    g1 = grads_of(opt)
    opt.zero_grad()
    backward_in(model, opt, x, y0, 0)
    loss1 = F.mse_loss(model(x), y1)
    with amp.scale_loss(loss1, opt, loss_id=1) as sl:
        assert torch.equal(sl, loss1.float() * 8.0)  # loss 1's own scale
        sl.backward()
    both = grads_of(opt)
    assert_same(both, [a + b for a, b in zip(g0, g1)])
    # and each part is unscaled with its own scale: compare with FP32 autograd
    with torch.no_grad():
        for rp, m in zip(ref.parameters(), amp.master_params(opt)):
            rp.copy_(m.float())
    with amp.disable_casts():
        (F.mse_loss(ref(x), y0) + F.mse_loss(ref(x), y1)).backward()
    for g, r in zip(both, ref.parameters()):
        assert relerr(g, r.grad) < TOL[level]


@pytest.mark.parametrize("level", LEVELS)
def test_delay_unscale_equals_plain_accumulation(level):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = init(model, opt, level, **SCALED[level])
    data = batches(3)
    opt.zero_grad()
    for x, (y,) in data:
        backward_in(model, opt, x, y)
    plain = grads_of(opt)
    opt.zero_grad()
    for k, (x, (y,)) in enumerate(data):
        backward_in(model, opt, x, y, delay_unscale=k < len(data) - 1)
    delayed = grads_of(opt)
    if level in ("O0", "O1", "O4"):  # FP32 grads: power-of-two scaling is exact
        assert_same(plain, delayed)
    else:  # half grads accumulate scaled in half before the unscale
        for a, b in zip(plain, delayed):
            assert relerr(b, a.float()) < TOL[level]
    assert relerr(delayed[0], plain[0].float()) < TOL[level]
    opt.step()
    assert amp.report().skipped_steps == []


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_step_after_only_delayed_blocks_raises(level):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = init(model, opt, level)
    x, (y,) = batches(1)[0]
    backward_in(model, opt, x, y, delay_unscale=True)
    with pytest.raises(RuntimeError, match="delay_unscale"):
        opt.step()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_an_overflow_outlives_a_later_delay_unscale_block(level):
    """Loss 0 overflows; loss 1 then accumulates with delay_unscale and loss 2 finishes the
    iteration cleanly: the step is still skipped (the overflowed grads are in there). The
    same when zero_grad ends the delayed block before the step."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = init(model, opt, level, num_losses=3)
    x, (y,) = batches(1)[0]
    for finish in ("clean block", "zero_grad"):
        before = snapshot([model], [opt])
        with amp.scale_loss(F.mse_loss(model(x), y), opt, loss_id=0) as sl:
            sl.backward()
            inject(next(model.parameters()), "inf")
        backward_in(model, opt, x, y, loss_id=1, delay_unscale=True)
        with pytest.raises(RuntimeError, match="delay_unscale"):
            opt.step()  # scaled grads are never applied, skipped or not
        if finish == "zero_grad":
            opt.zero_grad()
        else:
            backward_in(model, opt, x, y, loss_id=2)
        opt.step()
        assert_same(before, snapshot([model], [opt]))
        opt.zero_grad()
    backward_in(model, opt, x, y)
    opt.step()  # the skip was for one step only
    assert not torch.equal(before["masters"][0][0], next(amp.master_params(opt)))
    assert amp.report().skipped_steps == [0, 1] and amp.report().steps == 3


@pytest.mark.parametrize("zeroing", ZEROING)
@pytest.mark.parametrize("level", LEVELS)
def test_every_way_of_zeroing_trains_identically(level, zeroing):
    """Master grads never leak across steps, whichever way grads are zeroed; with no
    zeroing at all, they do accumulate (so the comparison can fail)."""
    def run(how):
        model = make_model(bn=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = init(model, opt, level)
        for x, (y,) in batches(3):
            if how is not None:
                zero_grads(how, [model], [opt])
            backward_in(model, opt, x, y)
            opt.step()
        out = snapshot([model], [opt])
        amp.deinitialize()
        return out

    reference = run("optimizer")
    assert_same(run(zeroing), reference)
    with pytest.raises(AssertionError):
        assert_same(run(None), reference)


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_plain_backward_outside_scale_loss_with_masters(level):
    """A plain backward (no scale_loss) under master weights still reaches the masters at
    step(); and optimizer.zero_grad() clears the grads it leaves on the half model."""
    model = make_model()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt = init(model, opt, level)
    x, (y,) = batches(1)[0]

    def ref_grads():
        with torch.no_grad():
            for rp, m in zip(ref.parameters(), amp.master_params(opt)):
                rp.copy_(m)
        ref.zero_grad()
        F.mse_loss(ref(x), y).backward()
        return [p.grad.clone() for p in ref.parameters()]

    expected = ref_grads()
    start = [m.detach().clone() for m in amp.master_params(opt)]
    F.mse_loss(model(x), y).backward()
    opt.step()
    for m, w, r in zip(amp.master_params(opt), start, expected):
        assert relerr((w - m) / 0.5, r) < TOL[level]
    F.mse_loss(model(x), y).backward()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    expected = ref_grads()
    backward_in(model, opt, x, y)
    for g, r in zip(grads_of(opt), expected):
        assert relerr(g, r) < TOL[level]


@pytest.mark.parametrize("verbosity", [0, 1])
def test_skips_are_logged_at_the_chosen_verbosity(verbosity, caplog):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = init(model, opt, "O1", verbosity=verbosity)
    x, (y,) = batches(1)[0]
    with caplog.at_level(logging.DEBUG, logger="ampatch"):
        caplog.clear()
        with amp.scale_loss(F.mse_loss(model(x), y), opt) as sl:
            sl.backward()
        opt.step()
        clean = [r for r in caplog.records if "overflow" in r.getMessage()]
        with amp.scale_loss(F.mse_loss(model(x), y), opt) as sl:
            sl.backward()
            inject(next(model.parameters()), "inf")
        opt.step()
    logged = [r for r in caplog.records if "overflow" in r.getMessage()]
    assert not clean
    assert len(logged) == verbosity


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_gradient_penalty_recipe_reads_the_scale_inside_the_block(level):
    """Grads of the scaled loss are unscaled with amp.loss_scale() read inside the block:
    the exit of a block counts as a clean unscale and may grow the scale (here it does)."""
    model = make_model()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = init(model, opt, level)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 1999}})
    x, (y,) = batches(1)[0]
    loss = F.mse_loss(model(x), y)
    with amp.scale_loss(loss, opt) as sl:
        grads = torch.autograd.grad(sl, list(model.parameters()), create_graph=True)
        inv = 1.0 / amp.loss_scale()
    assert amp.loss_scale() == 2048.0
    penalty = sum((g.float() * inv).pow(2).sum() for g in grads)
    with amp.scale_loss(loss + penalty, opt) as sl:
        sl.backward()
    with torch.no_grad():
        for rp, m in zip(ref.parameters(), amp.master_params(opt)):
            rp.copy_(m)
    with amp.disable_casts():
        ref_loss = F.mse_loss(ref(x), y)
        ref_grads = torch.autograd.grad(ref_loss, list(ref.parameters()), create_graph=True)
        (ref_loss + sum(g.pow(2).sum() for g in ref_grads)).backward()
    for g, r in zip(grads_of(opt), ref.parameters()):
        assert relerr(g, r.grad) < TOL[level]


def test_last_step_skipped_says_whether_the_step_happened():
    """`amp.last_step_skipped` is what the framework integrations hold an LR scheduler on: True
    after an overflowed step, False after a clean one, and False (not an error) when the session
    is disabled and nothing is ever skipped."""
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", half_dtype=torch.float16, verbosity=0)
    with amp.scale_loss(model(torch.randn(2, 4)).sum() * float("inf"), opt) as scaled:
        scaled.backward()
    opt.step()
    assert amp.last_step_skipped(opt)
    opt.zero_grad()
    with amp.scale_loss(model(torch.randn(2, 4)).sum() * 1e-3, opt) as scaled:  # small: no float16 overflow
        scaled.backward()
    opt.step()
    assert not amp.last_step_skipped(opt)
    with pytest.raises(RuntimeError, match="amp.last_step_skipped got an optimizer"):
        amp.last_step_skipped(torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1))
    model, opt = amp.initialize(torch.nn.Linear(4, 1), torch.optim.SGD(model.parameters(), lr=0.1), enabled=False)
    assert amp.last_step_skipped(opt) is False
