"""Checkpoints: model, optimizer and `amp.state_dict()` saved mid-run with
torch.save, loaded with `torch.load(..., weights_only=True)` into fresh objects, continue
bit-for-bit like the uninterrupted run, at every level (O2 with its FP32 masters too).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampatch as amp

FP16 = torch.float16
LEVELS = ["O0", "O1", "O2", "O3", "O4", "O5"]
STEPS, SAVE_AFTER, POISON_AT = 6, 3, 1
CHECKING = ("O1", "O2", "O5")  # levels that skip on overflow by default (the others would go NaN)



def make(seed: int):
    """A model with FP32 batch norm under O2/O5 (buffers included) and Adam (state with a step count)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-4)  # eps representable in float16
    return model, opt


def init(model, opt, level):
    return amp.initialize(model, opt, opt_level=level, verbosity=0,
                          half_dtype=FP16 if level in ("O0", "O1", "O2", "O3") else None)


def data():
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g) * 0.5) for _ in range(STEPS)]


def train_step(model, opt, x, y, poison: bool) -> None:
    opt.zero_grad()
    loss = F.mse_loss(model(x), y) * 0.125
    with amp.scale_loss(loss, opt) as sl:
        sl.backward()
        if poison:  # a skipped step before the save
            next(model.parameters()).grad.view(-1)[0] = float("inf")
    opt.step()


def state(model, opt) -> dict:
    """Everything that must match: model (FP32 view, BN buffers too), what the optimizer
    steps (FP32 masters under O2/O5), optimizer state, loss scaler."""
    return {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "masters": [p.detach().clone() for p in amp.master_params(opt)],
            "opt": {k: {n: (t.detach().clone() if torch.is_tensor(t) else t) for n, t in st.items()}
                    for k, st in opt.state_dict()["state"].items()},
            "amp": amp.state_dict()}


def assert_same(a, b, path="") -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), f"differs at {path}: max |diff| {(a.float() - b.float()).abs().max()}"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def uninterrupted(level: str) -> list[dict]:
    model, opt = init(*make(0), level)
    out = []
    for i, (x, y) in enumerate(data()):
        train_step(model, opt, x, y, poison=i == POISON_AT and level in CHECKING)
        out.append(state(model, opt))
    amp.deinitialize()
    return out


def save_mid_run(level: str, path) -> None:
    model, opt = init(*make(0), level)
    for i, (x, y) in enumerate(data()[:SAVE_AFTER]):
        train_step(model, opt, x, y, poison=i == POISON_AT and level in CHECKING)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "amp": amp.state_dict()}, path)
    amp.deinitialize()


def resume(level: str, path, order: str, strip_masters: bool = False, widen: bool | None = None):
    model, opt = init(*make(123), level)  # fresh objects, different initial weights
    ck = torch.load(path, weights_only=True)
    opt_sd = ck["optimizer"]
    model_sd = ck["model"]
    if strip_masters:  # what a plain torch optimizer checkpoint would hold
        opt_sd = {k: opt_sd[k] for k in ("state", "param_groups")}
    if strip_masters if widen is None else widen:  # and the half model's weights widened (Apex's checkpoints)
        model_sd = {k: v if k.startswith("1.") else v.to(FP16).float() for k, v in model_sd.items()}  # BN stays FP32
    if order == "model-first":
        model.load_state_dict(model_sd)
        opt.load_state_dict(opt_sd)
    else:
        opt.load_state_dict(opt_sd)
        if not strip_masters:  # the loaded masters already reached the half model
            masters = list(amp.master_params(opt))
            assert all(torch.equal(p, m.to(p.dtype)) for p, m in zip(model.parameters(), masters, strict=True))
        model.load_state_dict(model_sd)
    amp.load_state_dict(ck["amp"])
    return model, opt


@pytest.mark.parametrize("order", ["model-first", "optimizer-first"])
@pytest.mark.parametrize("level", LEVELS)
def test_resume_is_bit_for_bit(level, order, tmp_path):
    reference = uninterrupted(level)
    path = tmp_path / "ck.pt"
    save_mid_run(level, path)
    model, opt = resume(level, path, order)
    assert_same(state(model, opt), reference[SAVE_AFTER - 1], "after load")
    for i, (x, y) in enumerate(data()[SAVE_AFTER:], start=SAVE_AFTER):
        train_step(model, opt, x, y, poison=False)
        assert_same(state(model, opt), reference[i], f"step {i}")
    if level in ("O2", "O5"):
        assert all(p.dtype == torch.float32 for p in amp.master_params(opt))
        assert next(model.parameters()).dtype == (FP16 if level == "O2" else torch.bfloat16)


@pytest.mark.parametrize("level", ["O1", "O2", "O5"])
def test_checkpoint_holds_the_skip_and_the_scale(level, tmp_path):
    """The poisoned step before the save was skipped; its loss-scale backoff and clean-step
    count travel in the checkpoint as plain Python numbers."""
    path = tmp_path / "ck.pt"
    save_mid_run(level, path)
    ck = torch.load(path, weights_only=True)
    scale = 32768.0 if level in ("O1", "O2") else 1.0
    assert ck["amp"] == {"loss_scaler0": {"loss_scale": scale, "unskipped": SAVE_AFTER - POISON_AT - 1}}
    sc = ck["amp"]["loss_scaler0"]
    assert type(sc["loss_scale"]) is float and type(sc["unskipped"]) is int
    steps = {int(st["step"]) for st in ck["optimizer"]["state"].values()}
    assert steps == {SAVE_AFTER - 1}  # Adam never counted the skipped step
    assert all(v.dtype == torch.float32 for k, v in ck["model"].items() if v.is_floating_point())


@pytest.mark.parametrize("order", ["model-first", "optimizer-first"])
def test_o2_resume_needs_the_masters_in_the_optimizer_checkpoint(order, tmp_path):
    """Control for the bit-for-bit test: rebuilt from the half model alone (its weights widened,
    no masters in the optimizer checkpoint: what Apex saved), the FP32 masters lose their low
    bits, and the run diverges (so the exact comparison can fail)."""
    reference = uninterrupted("O2")
    path = tmp_path / "ck.pt"
    save_mid_run("O2", path)
    model, opt = resume("O2", path, order, strip_masters=True)
    with pytest.raises(AssertionError):
        assert_same(state(model, opt)["masters"], reference[SAVE_AFTER - 1]["masters"])
    x, y = data()[SAVE_AFTER]
    train_step(model, opt, x, y, poison=False)
    with pytest.raises(AssertionError):
        assert_same(state(model, opt)["model"], reference[SAVE_AFTER]["model"])


@pytest.mark.parametrize("order", ["model-first", "optimizer-first"])
@pytest.mark.parametrize("level", ["O2", "O5"])
def test_the_models_weights_alone_carry_the_masters(level, order, tmp_path):
    """`model.state_dict()` holds the FP32 masters: an optimizer checkpoint without ampatch's
    entry (a plain torch optimizer loaded it, or a framework dropped it) still resumes exactly."""
    reference = uninterrupted(level)
    path = tmp_path / "ck.pt"
    save_mid_run(level, path)
    model, opt = resume(level, path, order, strip_masters=True, widen=False)
    assert_same(state(model, opt), reference[SAVE_AFTER - 1], "after load")
    for i, (x, y) in enumerate(data()[SAVE_AFTER:], start=SAVE_AFTER):
        train_step(model, opt, x, y, poison=False)
        assert_same(state(model, opt), reference[i], f"step {i}")


def make_pair(seed: int):
    (m0, o0), (m1, o1) = make(seed), make(seed + 1)
    return [m0, m1], [o0, o1]


def pair_step(models, opts, x, y, poison: bool) -> None:
    """Two models, two optimizers, two losses with their own scalers; loss 1 may overflow."""
    for o in opts:
        o.zero_grad()
    for lid, (m, o) in enumerate(zip(models, opts)):
        with amp.scale_loss(F.mse_loss(m(x), y) * 0.125, o, loss_id=lid) as sl:
            sl.backward()
            if poison and lid == 1:
                next(m.parameters()).grad.view(-1)[0] = float("nan")
    for o in opts:
        o.step()


def pair_state(models, opts) -> list[dict]:
    return [state(m, o) for m, o in zip(models, opts)]


@pytest.mark.parametrize("level", ["O1", "O2", "O5"])
def test_resume_two_models_two_optimizers_two_scalers(level, tmp_path):
    def start():
        models, opts = make_pair(0)
        return amp.initialize(models, opts, opt_level=level, num_losses=2, verbosity=0,
                              half_dtype=FP16 if level != "O5" else None)

    steps = data()
    models, opts = start()
    reference = []
    for i, (x, y) in enumerate(steps):
        pair_step(models, opts, x, y, poison=i == POISON_AT)
        reference.append(pair_state(models, opts))
    amp.deinitialize()

    models, opts = start()
    for i, (x, y) in enumerate(steps[:SAVE_AFTER]):
        pair_step(models, opts, x, y, poison=i == POISON_AT)
    torch.save({"models": [m.state_dict() for m in models], "optimizers": [o.state_dict() for o in opts],
                "amp": amp.state_dict()}, tmp_path / "ck.pt")
    amp.deinitialize()

    models, opts = make_pair(50)
    models, opts = amp.initialize(models, opts, opt_level=level, num_losses=2, verbosity=0,
                                  half_dtype=FP16 if level != "O5" else None)
    ck = torch.load(tmp_path / "ck.pt", weights_only=True)
    for m, sd in zip(models, ck["models"]):
        m.load_state_dict(sd)
    for o, sd in zip(opts, ck["optimizers"]):
        o.load_state_dict(sd)
    amp.load_state_dict(ck["amp"])
    if level != "O5":  # loss 1's scaler backed off once, loss 0's did not
        assert [amp.loss_scale(0), amp.loss_scale(1)] == [65536.0, 32768.0]
    for i, (x, y) in enumerate(steps[SAVE_AFTER:], start=SAVE_AFTER):
        pair_step(models, opts, x, y, poison=False)
        assert_same(pair_state(models, opts), reference[i], f"step {i}")
