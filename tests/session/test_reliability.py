"""Reliability: exceptions mid-step, hostile values, long runs, checkpoints.

Each test reproduces one defect of the reliability review (its id in the test's docstring) and fails
without the fix. Models are tiny; float16 runs where a dynamic scale is the point.
"""
from __future__ import annotations

import logging
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampatch as amp
from ampatch.session.session import current

FP16, BF16 = torch.float16, torch.bfloat16


def init(models, optimizers, level, half=FP16, **kw):
    kw.setdefault("verbosity", 0)
    return amp.initialize(models, optimizers, opt_level=level, half_dtype=half, **kw)


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def data(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 4, generator=g) * 0.5, torch.randn(8, 2, generator=g) * 0.5


def grads(opt) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in amp.master_params(opt)]


def masters(opt) -> list[torch.Tensor]:
    return [p.detach().clone() for p in amp.master_params(opt)]


# ============================================================== D1: exceptions in scale_loss
class Boom(Exception):
    pass


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_exception_after_backward_leaves_unscaled_grads(level):
    """D1: block 1 backward; block 2 backward then raise. The grads hold block 1's plus the
    new part unscaled (plain PyTorch: 2x), and the next step applies that, not ~65537x."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = init(model, opt, level)
    x, y = data()
    opt.zero_grad()
    with amp.scale_loss(F.mse_loss(model(x), y), opt) as sl:
        sl.backward()
    one = grads(opt)
    with pytest.raises(Boom):
        with amp.scale_loss(F.mse_loss(model(x), y), opt) as sl:
            sl.backward()
            raise Boom
    two = grads(opt)
    for a, b in zip(one, two):
        torch.testing.assert_close(b, 2 * a, rtol=2e-2, atol=1e-5)
    before = masters(opt)
    opt.step()
    for w0, w1, g in zip(before, masters(opt), two):
        torch.testing.assert_close(w1, w0 - 0.1 * g, rtol=1e-4, atol=1e-5)
    assert amp.report().skipped_steps == []


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_keyboard_interrupt_from_a_backward_hook_leaves_unscaled_grads(level):
    """D1: a KeyboardInterrupt raised by a backward hook (a partial backward: the last layer
    got its new grads, the first did not) leaves no scaled grads behind."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = init(model, opt, level)
    x, y = data()
    opt.zero_grad()
    with amp.scale_loss(F.mse_loss(model(x), y), opt) as sl:
        sl.backward()
    one = grads(opt)

    def interrupt(_grad):
        raise KeyboardInterrupt

    hidden = {}
    handle = model[1].register_forward_hook(lambda m, i, o: hidden.setdefault("h", o))
    loss = F.mse_loss(model(x), y)
    handle.remove()
    hidden["h"].register_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        with amp.scale_loss(loss, opt) as sl:
            sl.backward()
    two = grads(opt)
    # params: [w1, b1, w2, b2]; the hook stopped the backward before the first layer
    for i in (0, 1):
        torch.testing.assert_close(two[i], one[i], rtol=0, atol=0)
    for i in (2, 3):
        torch.testing.assert_close(two[i], 2 * one[i], rtol=2e-2, atol=1e-5)
    # training goes on normally
    opt.step()
    opt.zero_grad()
    with amp.scale_loss(F.mse_loss(model(x), y), opt) as sl:
        sl.backward()
    opt.step()
    assert amp.report().skipped_steps == []


def test_exception_with_non_finite_new_part_skips_the_next_step():
    """D1: the new part of an aborted block holds an inf: the next step is skipped."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = init(model, opt, "O2")
    x, y = data()
    opt.zero_grad()
    with pytest.raises(Boom):
        with amp.scale_loss(F.mse_loss(model(x), y), opt) as sl:
            sl.backward()
            model[0].weight.grad[0, 0] = float("inf")
            raise Boom
    before = masters(opt)
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, masters(opt)))
    assert amp.report().skipped_steps == [0]


# ============================================================== D2, D12: rejected model loads
@pytest.mark.parametrize("level,half", [("O2", FP16), ("O5", BF16)])
def test_rejected_model_load_leaves_the_masters_alone(level, half):
    """D2: torch rejects a broadcastable wrong shape ("size mismatch"); the FP32 master of
    that weight must not take it (the next step would write it into the model, even at lr 0).
    The bias torch did load is taken by its master, as the FP32 model would have it."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = init(model, opt, level, half)
    w0 = model.weight.detach().clone()
    m0 = masters(opt)
    new_bias = torch.arange(4.0) / 3
    with pytest.raises(RuntimeError, match="size mismatch for weight"):
        model.load_state_dict({"weight": torch.zeros(1, 4), "bias": new_bias})
    assert torch.equal(masters(opt)[0], m0[0])
    assert torch.equal(masters(opt)[1], new_bias)  # loaded by torch, so by the master too
    with amp.scale_loss(model(torch.ones(2, 4)).sum(), opt) as sl:
        sl.backward()
    opt.step()
    assert torch.equal(model.weight, w0)
    assert torch.equal(model.bias, new_bias.to(half))


def test_non_broadcastable_wrong_shape_gives_torchs_error():
    """D12: a non-broadcastable wrong shape shows torch's "size mismatch for weight", not a
    copy error from the master re-sync."""
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = init(model, opt, "O2")
    with pytest.raises(RuntimeError, match="size mismatch for weight") as info:
        model.load_state_dict({"weight": torch.zeros(3, 5), "bias": torch.zeros(4)})
    assert "must match" not in str(info.value)


# ============================================================== D3, D4, frozen params: deinitialize
class Rotary(nn.Module):
    """A layer with a registered float buffer and a non-persistent rotary `inv_freq`."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("gain", torch.full((4,), 1 / 3))
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 4, 2).float() / 4)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        angle = x[..., :2] * self.inv_freq
        return self.fc(x * self.gain) + torch.cat([angle.cos(), angle.sin()], -1)


def fp32_snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in
            list(model.named_parameters()) + list(model.named_buffers())}


def assert_exactly(model: nn.Module, snap: dict[str, torch.Tensor]) -> None:
    now = dict(list(model.named_parameters()) + list(model.named_buffers()))
    assert now.keys() == snap.keys()
    for k, v in snap.items():
        assert now[k].dtype == v.dtype, k
        assert torch.equal(now[k], v), k


@pytest.mark.parametrize("level", ["O2", "O3", "O5"])
def test_deinitialize_restores_buffers_exactly(level):
    """D3: floating buffers (a registered one, rotary inv_freq) come back FP32 with their
    exact values; `_apply` replaced the buffer objects, so restoring by object missed them."""
    model = Rotary()
    snap = fp32_snapshot(model)
    model = init(model, None, level, BF16)
    assert model.gain.dtype == model.inv_freq.dtype == BF16
    model(torch.ones(2, 4))
    amp.deinitialize()
    if level == "O3":  # no masters: params come back from their half values (an FP32 copy would defeat O3)
        for k in ("fc.weight", "fc.bias"):
            torch.testing.assert_close(dict(model.named_parameters())[k], snap.pop(k), rtol=1e-2, atol=0)
        assert {k: v for k, v in model.named_buffers()}.keys() == snap.keys()
        for k, v in model.named_buffers():
            assert v.dtype == torch.float32 and torch.equal(v, snap[k]), k
    else:
        assert_exactly(model, snap)


def test_o3_batchnorm_running_stats_back_to_fp32_and_o2_after_o3():
    """D3: BatchNorm running stats trained at O3 come back FP32 (an FP32 forward works), and
    O3 -> O2 re-initialize trains."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = init(model, opt, "O3", BF16)
    x, y = data()
    with amp.scale_loss(F.mse_loss(model(x), y), opt) as sl:
        sl.backward()
    opt.step()
    amp.deinitialize()
    assert {str(t.dtype) for t in model.state_dict().values() if t.is_floating_point()} == {"torch.float32"}
    model(x)  # FP32 forward
    model, opt = init(model, opt, "O2", BF16)
    opt.zero_grad()
    with amp.scale_loss(F.mse_loss(model(x), y), opt) as sl:
        sl.backward()
    opt.step()
    amp.deinitialize()
    assert model[1].running_mean.dtype == torch.float32 and model[0].weight.dtype == torch.float32
    model(x)


def test_parametrization_base_buffer_restored():
    """D3: an orthogonal parametrization's `base` buffer at O2 comes back FP32."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.utils.parametrizations.orthogonal(nn.Linear(4, 4)), nn.Linear(4, 2))
    snap = fp32_snapshot(model)
    assert any(k.endswith("base") for k in snap)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = init(model, opt, "O2", BF16)
    amp.deinitialize()
    for k, v in dict(list(model.named_parameters()) + list(model.named_buffers())).items():
        assert v.dtype == torch.float32, k
    assert_exactly(model, snap)


@pytest.mark.parametrize("shape", ["two_models", "model_and_submodule"])
def test_param_shared_by_two_models_restored_from_its_master(shape):
    """D4: a param shared by two models of one O2 initialize (or a model and its own
    submodule) comes back FP32, from its master."""
    torch.manual_seed(0)
    enc = nn.Linear(4, 4)
    m1 = nn.Sequential(enc, nn.Tanh(), nn.Linear(4, 2))
    m2 = nn.Sequential(enc, nn.Tanh(), nn.Linear(4, 3)) if shape == "two_models" else enc
    params = list({id(p): p for m in (m1, m2) for p in m.parameters()}.values())
    opt = torch.optim.SGD(params, lr=0.1)
    [m1, m2], opt = init([m1, m2], opt, "O2")
    x, y = data()
    with amp.scale_loss(F.mse_loss(m1(x), y) + m2(x).float().pow(2).mean(), opt) as sl:
        sl.backward()
    opt.step()
    master = {id(mp): m for mp, m in zip(params, amp.master_params(opt))}
    expected = master[id(enc.weight)].detach().clone()
    sd = m2.state_dict()
    assert all(v.dtype == torch.float32 for v in sd.values())
    amp.deinitialize()
    assert enc.weight.dtype == torch.float32 and torch.equal(enc.weight, expected)
    assert all(p.dtype == torch.float32 for m in (m1, m2) for p in m.parameters())


def test_frozen_params_come_back_exact():
    """Interop: O2 params in no optimizer (a frozen backbone) get their exact FP32 values
    back from deinitialize, not half-rounded ones; so does a frozen param loaded from an
    FP32 checkpoint after initialize."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2), nn.Linear(2, 2))
    for p in model[0].parameters():
        p.requires_grad_(False)
    snap = fp32_snapshot(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model, opt = init(model, opt, "O2", BF16)
    x, y = data()
    with amp.scale_loss(F.mse_loss(model(x), y), opt) as sl:
        sl.backward()
    opt.step()
    loaded = torch.randn(2, 2) / 3
    model[3].weight.requires_grad_(False)
    amp.deinitialize()
    for k in ("0.weight", "0.bias"):
        assert torch.equal(dict(model.named_parameters())[k], snap[k]), k
    assert not torch.equal(model[2].weight, snap["2.weight"])  # trained
    # a frozen param loaded (through its submodule) after initialize: exact too
    model, opt = init(model, torch.optim.SGD(model[2].parameters(), lr=0.1), "O2", BF16)
    model[3].load_state_dict({"weight": loaded, "bias": torch.zeros(2)})
    amp.deinitialize()
    assert torch.equal(model[3].weight, loaded)


def test_submodule_load_and_state_dict_under_o2():
    """Checkpoints through a submodule (a pretrained backbone): `model[0].load_state_dict`
    reaches the FP32 masters (else the next step would undo the load), and
    `model[0].state_dict()` is FP32 like the model's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = init(model, opt, "O2", BF16)
    backbone = {"weight": torch.randn(4, 4) / 3, "bias": torch.zeros(4)}
    model[0].load_state_dict(backbone)
    assert torch.equal(masters(opt)[0], backbone["weight"])
    with amp.scale_loss(model(torch.ones(2, 4)).sum(), opt) as sl:
        sl.backward()
    opt.step()
    assert torch.equal(model[0].weight, backbone["weight"].to(BF16))
    assert all(v.dtype == torch.float32 for v in model[0].state_dict().values())
    assert model[0].state_dict(keep_vars=True)["weight"] is model[0].weight


def test_load_state_dict_assign_refused_under_o2():
    """`load_state_dict(assign=True)` would swap the half params the masters follow for the
    checkpoint's tensors: refused with the fix, and nothing is loaded."""
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = init(model, opt, "O2", BF16)
    w = model.weight
    with pytest.raises(RuntimeError, match="assign=False"):
        model.load_state_dict({"weight": torch.zeros(4, 4), "bias": torch.zeros(4)}, assign=True)
    assert model.weight is w and not torch.equal(w, torch.zeros(4, 4, dtype=BF16))


# ============================================================== D8: a loss that is always NaN
def nan_steps(model, opt, n: int, x: torch.Tensor) -> None:
    for _ in range(n):
        opt.zero_grad()
        loss = model(x).float().sum() * float("nan")
        with amp.scale_loss(loss, opt) as sl:
            sl.backward()
        opt.step()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_nan_loss_every_step_keeps_a_usable_scale_and_warns_with_backoff(level, caplog):
    """D8: the scale stops at a floor (the run used to fail after ~144 steps, at 2.9e-39);
    after 50 skipped steps in a row a warning names the problem, then at 100, 200, ..."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = init(model, opt, level, verbosity=1)
    w0 = masters(opt)
    x, _ = data()
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING, logger="ampatch"):
        warnings.simplefilter("always")
        nan_steps(model, opt, 210, x)
    scale = amp.loss_scale()
    assert 0 < scale <= 2.0 ** -10 and math.isfinite(1 / scale)
    assert all(torch.equal(a, b) for a, b in zip(w0, masters(opt)))
    assert len(amp.report().skipped_steps) == 210
    ours = [str(w.message) for w in caught if "in a row" in str(w.message)]
    assert [m.split(" optimizer steps")[0].rsplit(" ", 1)[-1] for m in ours] == ["50", "100", "200"]
    assert "the loss itself is nan" in ours[0]
    assert all(issubclass(w.category, RuntimeWarning) for w in caught if "in a row" in str(w.message))
    assert len([r for r in caplog.records if "in a row" in r.getMessage()]) == 3
    # a clean step resets the count: no warning for the next 49 skips
    opt.zero_grad()
    with amp.scale_loss(model(x).float().sum(), opt) as sl:
        sl.backward()
    opt.step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        nan_steps(model, opt, 49, x)
    assert not [w for w in caught if "in a row" in str(w.message)]


def test_skip_warning_names_non_finite_grads_with_a_finite_loss():
    """D8: static scale with master weights (O5): every step skipped by an inf grad, the
    loss finite: the warning says the gradients, not the loss, are the problem."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = init(model, opt, "O5", None, verbosity=1)
    x, y = data()
    with pytest.warns(RuntimeWarning, match="gradients hold inf/NaN") as record:
        for _ in range(50):
            opt.zero_grad()
            with amp.scale_loss(F.mse_loss(model(x), y), opt) as sl:
                sl.backward()
                model[0].weight.grad[0, 0] = float("inf")
            opt.step()
    assert "loss itself" not in str(record[0].message)
    assert amp.loss_scale() == 1.0


def test_scale_floor_and_ceiling_by_default():
    """D8: halving stops at DEFAULT_MIN_LOSS_SCALE when min_loss_scale is None."""
    from ampatch.config.values import DEFAULT_MIN_LOSS_SCALE
    from ampatch.optim.scaler import LossScaler
    s = LossScaler("dynamic")
    for i in range(400):
        s.update(True, i)
    assert s.scale == DEFAULT_MIN_LOSS_SCALE
    torch.full((), 1 / s.scale, dtype=torch.float32)  # the unscale's inverse is a float32


# ============================================================== D13-D17, D20: bad values
def test_min_loss_scale_above_the_start_never_raises_the_scale_on_overflow():
    """D13: min_loss_scale=2**20 above the initial 2**16: the scale starts at the floor (with
    a warning), and an overflow never moves it up."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="min_loss_scale"):
        model, opt = init(model, opt, "O1", min_loss_scale=2.0 ** 20, verbosity=1)
    assert amp.loss_scale() == 2.0 ** 20
    from ampatch.optim.scaler import LossScaler
    s = LossScaler("dynamic", min_loss_scale=2.0 ** 20)
    s.scale = 2.0 ** 10  # however it got there: an overflow halves or holds, never raises
    s.update(True, 0)
    assert s.scale <= 2.0 ** 10


@pytest.mark.parametrize("name,value", [("min_loss_scale", float("nan")), ("max_loss_scale", float("nan")),
                                        ("max_loss_scale", float("inf")), ("min_loss_scale", 1e-45),
                                        ("min_loss_scale", -1.0), ("max_loss_scale", 0.0),
                                        ("max_loss_scale", 1e300), ("loss_scale", 1e-300),
                                        ("loss_scale", 1e300)])
def test_unusable_scale_bounds_are_refused(name, value):
    """D14: NaN (and other unusable values) for min/max_loss_scale, or a static scale whose
    inverse is not a finite float32, are refused with a clear error before anything changes."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=name):
        init(model, opt, "O2", **{name: value})
    assert model[0].weight.dtype == torch.float32


def test_loaded_scale_outside_the_bounds_is_clamped_with_a_warning():
    """D15: a saved scale above max_loss_scale (or under min_loss_scale) is clamped, with a
    warning; a static scale loads as saved (Apex)."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = init(model, opt, "O1", max_loss_scale=2.0 ** 12, min_loss_scale=4.0, verbosity=1)
    with pytest.warns(UserWarning, match="outside this session's range"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 2.0 ** 20, "unskipped": 3}})
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 2.0 ** 12, "unskipped": 3}
    with pytest.warns(UserWarning, match="outside this session's range"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 1.0, "unskipped": 0}})
    assert amp.loss_scale() == 4.0


def test_state_dict_for_scalers_this_session_lacks():
    """D16: `{"loss_scaler1": ...}` into a 1-loss session loads nothing: an error that says
    so (and names num_losses); a partly matching dict warns naming what was not loaded."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = init(model, opt, "O1", verbosity=1)
    state = {"loss_scale": 8.0, "unskipped": 1}
    for bad in ({"loss_scaler1": state}, {}):
        with pytest.raises(KeyError, match="num_losses"):
            amp.load_state_dict(bad)
    assert amp.loss_scale() == 2.0 ** 16
    with pytest.warns(UserWarning, match=r"not loaded: \['loss_scaler1'\]"):
        amp.load_state_dict({"loss_scaler0": state, "loss_scaler1": state})
    assert amp.loss_scale() == 8.0


@pytest.mark.parametrize("bad,error", [(1.5, TypeError), ("0", TypeError), (None, TypeError),
                                       (True, TypeError), (3, ValueError), (-1, ValueError)])
def test_loss_scale_bad_loss_id_names_loss_id(bad, error):
    """D17: amp.loss_scale(1.5), ("0"), (None) fail with an error about loss_id."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    init(model, opt, "O1", num_losses=2)
    with pytest.raises(error, match="loss_id"):
        amp.loss_scale(bad)


def test_duplicated_model_or_optimizer_is_named():
    """D18: the same model or optimizer passed twice: the error says which argument."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"models\[1\] is models\[0\]"):
        init([model, model], opt, "O2")
    with pytest.raises(ValueError, match=r"optimizers\[1\] is optimizers\[0\]"):
        init(model, [opt, opt], "O2")
    assert model[0].weight.dtype == torch.float32 and current() is None


def test_rejected_initialize_keeps_the_logger_level():
    """D20: initialize(verbosity=0, <bad argument>) raises and leaves the logger as it was."""
    log = logging.getLogger("ampatch")
    before = log.level
    try:
        log.setLevel(logging.WARNING)
        for bad in ({"opt_level": "O9"}, {"min_loss_scale": float("nan")}, {"loss_scale": "huge"}):
            with pytest.raises((ValueError, TypeError)):
                amp.initialize(mlp(), None, verbosity=0, **bad)
            assert log.level == logging.WARNING
    finally:
        log.setLevel(before)


# ============================================================== gaps: scale_loss, process_group
def test_scale_loss_needs_an_optimizer_each_once():
    """Gap: `scale_loss(loss, [])` was accepted (nothing unscaled or checked); the same
    optimizer twice would unscale its grads twice."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = init(model, opt, "O1")
    loss = model(data()[0]).float().sum()
    for bad in ([], (), [opt, opt]):
        with pytest.raises(ValueError, match="optimizer"):
            with amp.scale_loss(loss, bad):
                pass
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("bad,error", [("world", TypeError), (0, TypeError), (-100, ValueError)])
def test_process_group_is_validated(bad, error):
    """Gap: process_group was never checked; a wrong one failed at the first overflow."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(error, match="process_group"):
        init(model, opt, "O1", process_group=bad)


# ============================================================== D9: sparse gradients
class Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 4, sparse=True)
        self.fc = nn.Linear(4, 2)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(idx).mean(1))


@pytest.mark.parametrize("level,half,kw", [("O1", FP16, {}), ("O2", FP16, {}), ("O2", BF16, {}),
                                           ("O3", FP16, {"loss_scale": "dynamic"}),
                                           ("O4", None, {"loss_scale": 128.0})])
def test_sparse_gradients_train_like_fp32(level, half, kw):
    """D9: nn.Embedding(sparse=True): the fused unscale takes the sparse grad's values
    (coalesced in float16, as torch.amp.GradScaler does) and O2 masters get FP32 sparse
    grads; two scale_loss blocks accumulate; an inf in a sparse grad skips the step."""
    idx = torch.tensor([[1, 2, 2], [3, 1, 4]])
    y = torch.randn(2, 2, generator=torch.Generator().manual_seed(3))
    blocks = 1 if level == "O3" else 2  # torch cannot add two float16 sparse tensors on CPU
    ref = Bag()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for _ in range(blocks):
        F.mse_loss(ref(idx), y).backward()
    ref_opt.step()

    model = Bag()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt = init(model, opt, level, half, **kw)
    for _ in range(blocks):
        with amp.scale_loss(F.mse_loss(model(idx).float(), y), opt) as sl:
            sl.backward()
    assert amp.master_params(opt).__next__().grad.is_sparse
    opt.step()
    tol = 2e-2 if level in ("O3",) else 1e-2
    torch.testing.assert_close(model.emb.weight.float(), ref.emb.weight, rtol=tol, atol=tol)
    torch.testing.assert_close(model.fc.weight.float(), ref.fc.weight, rtol=tol, atol=tol)
    assert amp.report().skipped_steps == []
    # an inf in the sparse grad: skipped
    opt.zero_grad()
    before = masters(opt)
    with amp.scale_loss(F.mse_loss(model(idx).float(), y), opt) as sl:
        sl.backward()
        g = model.emb.weight.grad
        g._values().view(-1)[0] = float("inf")
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, masters(opt)))
    assert amp.report().skipped_steps == [1]


# ============================================================== D11 and O2 -> O1: optimizer checkpoints
def trained_o2(seed: int = 0, steps: int = 2, model: nn.Module | None = None):
    model = model if model is not None else mlp(seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = init(model, opt, "O2", BF16)
    x, _ = data()
    for _ in range(steps):
        opt.zero_grad()
        with amp.scale_loss(model(x).float().pow(2).mean(), opt) as sl:
            sl.backward()
        opt.step()
    return model, opt


def clone_tree(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: clone_tree(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(clone_tree(v) for v in x)
    return x


def same_tree(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b))
    return a == b


def test_rejected_optimizer_load_changes_nothing():
    """D11: an O2 optimizer checkpoint of another model's shapes, or with tampered masters,
    is rejected before the optimizer state, the masters or the model change."""
    other = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))  # same param count, other shapes
    _, other_opt = trained_o2(model=other)
    foreign = clone_tree(other_opt.state_dict())
    model, opt = trained_o2()
    good = clone_tree(opt.state_dict())
    before = (clone_tree(opt.state_dict()), masters(opt), clone_tree(model.state_dict()))
    tampered = [dict(good, ampatch_masters=[torch.zeros(3)] + good["ampatch_masters"][1:]),
                dict(good, ampatch_masters=good["ampatch_masters"][:-1]),
                dict(good, ampatch_masters=["not a tensor"] + good["ampatch_masters"][1:]),
                dict(good, ampatch_masters=torch.zeros(4))]
    for bad in [foreign] + tampered:
        with pytest.raises((ValueError, TypeError), match="ampatch_masters|master"):
            opt.load_state_dict(bad)
        after = (clone_tree(opt.state_dict()), masters(opt), clone_tree(model.state_dict()))
        assert same_tree(before, after)
    opt.load_state_dict(good)  # the real one still loads


def test_o2_checkpoint_resumed_at_o1_loads_the_masters_into_the_model():
    """Interop: an O2 optimizer checkpoint (with FP32 masters) loaded at O1 puts the exact
    FP32 masters into the FP32 model, instead of only the half-rounded model checkpoint (the
    half weights widened: Apex's; ampatch's own model checkpoint holds the masters)."""
    model, opt = trained_o2()
    ckpt = {"model": clone_tree(model.state_dict()), "opt": clone_tree(opt.state_dict())}
    exact = masters(opt)
    assert all(torch.equal(v, m) for v, m in zip(ckpt["model"].values(), exact))
    ckpt["model"] = {k: v.to(BF16).float() for k, v in ckpt["model"].items()}
    amp.deinitialize()
    fresh = mlp(5)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    fresh, fresh_opt = init(fresh, fresh_opt, "O1", BF16)
    fresh.load_state_dict(ckpt["model"])
    assert not all(torch.equal(p, m) for p, m in zip(fresh.parameters(), exact))  # rounded
    fresh_opt.load_state_dict(ckpt["opt"])
    assert all(torch.equal(p, m) for p, m in zip(fresh.parameters(), exact))
    assert all(p.dtype == torch.float32 for p in fresh.parameters())


# ============================================================== D21: LR schedulers made before initialize
@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("sched", ["StepLR", "OneCycleLR"])
def test_scheduler_made_before_initialize_is_quiet(level, sched):
    """D21: a scheduler made before initialize must not see the patched step as "overridden
    after learning rate scheduler initialization"; its own warnings still fire when due."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if sched == "StepLR":
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    else:
        scheduler = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
    model, opt = init(model, opt, level, BF16)
    x, y = data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scheduler.step()  # before any optimizer.step(): torch warns, rightly
        assert any("before `optimizer.step()`" in str(w.message) for w in caught)
        caught.clear()
        for _ in range(3):
            opt.zero_grad()
            with amp.scale_loss(F.mse_loss(model(x), y), opt) as sl:
                sl.backward()
            opt.step()
            scheduler.step()
    assert not [str(w.message) for w in caught if "lr_scheduler" in str(w.message) or "overridden" in str(w.message)]
    assert opt.param_groups[0]["lr"] != 0.1


# ============================================================== gap: AMPATCH_REPORT in long runs
def test_recorded_report_stays_bounded_and_frees_the_session(monkeypatch, tmp_path):
    """Gap: with AMPATCH_REPORT the per-step losses and step times grew without bound, and
    the exit hook kept the last session (models, optimizers) alive after deinitialize."""
    import gc
    import weakref

    import ampatch.session.telemetry
    from ampatch.base.exit_json import exit_report
    SERIES_POINTS = 64
    monkeypatch.setattr(ampatch.session.telemetry, "SERIES_POINTS", SERIES_POINTS)
    monkeypatch.setenv("AMPATCH_REPORT", str(tmp_path / "report.json"))
    monkeypatch.setattr(exit_report, "source", None)
    monkeypatch.setattr(exit_report, "final", None)
    monkeypatch.setattr(exit_report, "registered", True)  # no real atexit hook from a test
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level="O0", verbosity=0)
    x = torch.ones(1, 2)
    steps = 2 * SERIES_POINTS + 100
    for i in range(steps):
        opt.zero_grad()
        loss = model(x).sum() * 0 + i  # the loss is the step number
        with amp.scale_loss(loss, opt) as sl:
            sl.backward()
        opt.step()
    rep = amp.report()
    assert SERIES_POINTS // 2 <= len(rep.losses) <= SERIES_POINTS
    assert len(rep.step_times_s) <= SERIES_POINTS and rep.steps == steps
    every = rep.losses_every
    assert every > 1 and all(v == i * every for i, v in enumerate(rep.losses))
    session = weakref.ref(current())
    amp.deinitialize()
    del model, opt
    gc.collect()
    assert session() is None
    exit_report.write()  # what the exit hook does: the closed session's report
    import json
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["steps"] == steps and len(saved["losses"]) == len(rep.losses)


def test_half_param_in_two_optimizers_refused_with_masters():
    """A param in two optimizers at O2 got two masters: one optimizer's update was lost
    (silently) when the other copied its stale master into the model. Refused, naming both."""
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.Linear(4, 2))
    o1 = torch.optim.SGD(model.parameters(), lr=0.1)
    o2 = torch.optim.SGD(shared.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"optimizers\[0\] and optimizers\[1\]"):
        init(model, [o1, o2], "O2", BF16)
    assert shared.weight.dtype == torch.float32
    o2 = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    model, [o1, o2] = init(model, [o1, o2], "O2", BF16)
    with pytest.raises(ValueError, match="one optimizer"):
        o2.add_param_group({"params": [shared.weight]})
    init(model, [o1, torch.optim.SGD(shared.parameters(), lr=0.1)], "O1", BF16)  # O1: fine, as in torch


class Interrupted(torch.optim.SGD):
    """SGD whose step is interrupted after it updated the first param."""

    def step(self, closure=None):
        with torch.no_grad():
            p = self.param_groups[0]["params"][0]
            p.add_(p.grad, alpha=-self.param_groups[0]["lr"])
        raise KeyboardInterrupt


def test_interrupted_step_leaves_model_and_masters_agreeing():
    """An O2 step interrupted half-way: the model still shows what the masters hold (the
    next forward does not run on weights the masters no longer have)."""
    model = mlp()
    opt = Interrupted(model.parameters(), lr=0.5)
    model, opt = init(model, opt, "O2", BF16)
    x, y = data()
    with amp.scale_loss(F.mse_loss(model(x), y), opt) as sl:
        sl.backward()
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    for p, m in zip(model.parameters(), amp.master_params(opt)):
        assert torch.equal(p, m.to(p.dtype))


# ============================================================== interop: data loading, Hugging Face
class MathSet(torch.utils.data.Dataset):
    """A dataset doing tensor math in __getitem__, guarded by disable_casts() or not."""

    def __init__(self, guarded: bool) -> None:
        self.guarded = guarded

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> torch.Tensor:
        x = torch.full((2, 2), 1.0 + i)
        if self.guarded:
            with amp.disable_casts():
                return torch.mm(x, x)
        return torch.mm(x, x)


@pytest.mark.parametrize("workers", [0, 1], ids=["in_process", "forked_worker"])
def test_dataset_math_under_o1_and_disable_casts(workers):
    """Interop (documented in the README): under O1, data code gets half results in-process
    and in forked workers; `amp.disable_casts()` keeps it FP32."""
    model = init(mlp(), None, "O1", BF16)
    kw = {"num_workers": workers, "multiprocessing_context": "fork"} if workers else {}
    for guarded, dtype in ((False, BF16), (True, torch.float32)):
        batch = next(iter(torch.utils.data.DataLoader(MathSet(guarded), batch_size=2, **kw)))
        assert batch.dtype == dtype, (guarded, batch.dtype)
    assert model(torch.ones(1, 4)).dtype == BF16  # the model still casts


def test_hugging_face_save_pretrained_after_o2(tmp_path):
    """Interop (README recipe): after O2, `amp.deinitialize()` then `save_pretrained` writes
    exact FP32 weights and a float32 config; `from_pretrained` reloads them in FP32. A save
    made during O2 reloads in FP32 when the dtype is passed."""
    transformers = pytest.importorskip("transformers")
    from packaging.version import Version
    dtype_kw = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    cfg = transformers.GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = init(model, opt, "O2", BF16)
    ids = torch.tensor([[1, 2, 3, 4]])
    with amp.scale_loss(model(ids, labels=ids).loss, opt) as sl:
        sl.backward()
    opt.step()
    model.save_pretrained(tmp_path / "during")
    during = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "during", **{dtype_kw: torch.float32})
    assert all(p.dtype == torch.float32 for p in during.parameters())
    exact = {id(mp): m.detach().clone() for mp, m in zip(model.parameters(), amp.master_params(opt))}
    amp.deinitialize()
    model.save_pretrained(tmp_path / "after")
    after = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "after")
    for (name, p), q in zip(model.named_parameters(), after.parameters()):
        assert q.dtype == torch.float32, name
        assert torch.equal(p, q), name
        if id(p) in exact:
            assert torch.equal(p, exact[id(p)]), name


def test_static_scale_is_kept_when_a_dynamic_checkpoint_is_loaded():
    """"A static scale never changes": a dynamic run's scaler state loaded at a static level
    (O2-fp16 checkpoint resumed at O5) keeps the level's scale, with a warning that says how
    to continue the dynamic scale instead."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = init(model, opt, "O5", None, verbosity=1)
    with pytest.warns(UserWarning, match="static"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 32768.0, "unskipped": 7}})
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 1.0, "unskipped": 7}


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_exception_in_a_delay_unscale_block_unscales_the_pending_grads(level):
    """D1 with delay_unscale: blocks that accumulate scaled grads, the second raising after its
    backward: everything pending is unscaled, so the next step applies plain grads."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = init(model, opt, level)
    x, y = data()
    with amp.scale_loss(F.mse_loss(model(x), y), opt) as sl:
        sl.backward()
    one = grads(opt)
    opt.zero_grad()
    with amp.scale_loss(F.mse_loss(model(x), y), opt, delay_unscale=True) as sl:
        sl.backward()
    with pytest.raises(Boom):
        with amp.scale_loss(F.mse_loss(model(x), y), opt, delay_unscale=True) as sl:
            sl.backward()
            raise Boom
    for a, b in zip(one, grads(opt)):
        torch.testing.assert_close(b, 2 * a, rtol=2e-2, atol=1e-5)
    opt.step()
    assert amp.report().skipped_steps == []


# ============================================================== CUDA (skipped without a GPU)
@pytest.mark.cuda
def test_cuda_frozen_params_kept_on_the_cpu_and_restored_exactly():
    """On CUDA the FP32 values of frozen O2 params wait on the CPU (the half model's device
    memory is what O2 promises) and come back exactly; sparse grads and an exception in
    scale_loss work there too."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).cuda()
    for p in model[0].parameters():
        p.requires_grad_(False)
    snap = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = torch.optim.SGD(model[2].parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    handle = current().models[0]
    kept = [c.shadow for _, own in handle.casts for c in own.values() if c.shadow is not None]
    assert kept and all(t.device.type == "cpu" for t in kept)
    x, y = torch.randn(8, 4, device="cuda"), torch.randn(8, 2, device="cuda")
    with pytest.raises(Boom):
        with amp.scale_loss(F.mse_loss(model(x), y), opt) as sl:
            sl.backward()
            raise Boom
    assert all(float(p.grad.abs().max()) < 100 for p in amp.master_params(opt))
    opt.step()
    amp.deinitialize()
    for k in ("0.weight", "0.bias"):
        assert torch.equal(dict(model.named_parameters())[k], snap[k]), k

    bag = Bag().cuda()
    opt = torch.optim.SGD(bag.parameters(), lr=0.5)
    bag, opt = amp.initialize(bag, opt, opt_level="O1", verbosity=0)
    idx = torch.tensor([[1, 2, 2], [3, 1, 4]], device="cuda")
    with amp.scale_loss(bag(idx).float().pow(2).mean(), opt) as sl:
        sl.backward()
    assert bag.emb.weight.grad.is_sparse and float(bag.emb.weight.grad.coalesce().values().abs().max()) < 100
    opt.step()
    assert amp.report().skipped_steps == []


def test_warnings_point_at_the_users_line():
    """A warning decided deep inside ampatch (initialize, load_state_dict, a hard_override,
    a run of skipped steps) names the user's file and line, not ampatch's."""
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.float16, min_loss_scale=2.0 ** 20)
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 2.0 ** 30, "unskipped": 0}})
        amp._amp_state.hard_override = True
        try:
            amp.initialize(model, opt, opt_level="O1", master_weights=True)
        finally:
            amp._amp_state.hard_override = False
    assert len(caught) >= 3, [str(w.message) for w in caught]
    for w in caught:
        assert w.filename == __file__, (w.filename, str(w.message))
