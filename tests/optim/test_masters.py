"""FP32 master weights under O2/O5: masters track the half model after every
step for every kind of optimizer, really accumulate in FP32, add_param_group, state made
before initialize, zeroing grads every usual way, closures, convergence against O0,
deinitialize, initializing twice, and an O2 resume that continues bit-for-bit.
"""
from __future__ import annotations

import copy
import io
import logging
import warnings

import pytest
import torch
from torch import nn

import ampatch as amp

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
MASTER_LEVELS = [("O2", F16), ("O2", BF16), ("O5", BF16)]
MASTER_IDS = ["O2-fp16", "O2-bf16", "O5"]



class SignSGD(torch.optim.Optimizer):
    """A user optimizer with its own state."""

    def __init__(self, params, lr: float = 1e-2) -> None:
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                st["n"] = st.get("n", 0) + 1
                st["last"] = p.grad.sign()
                p.sub_(st["last"], alpha=group["lr"])
        return loss


OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    "user_subclass": lambda ps: SignSGD(ps, lr=1e-2),
}


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 4, generator=g), torch.randn(16, 2, generator=g)) for _ in range(n)]


def train_step(model, opt, x, y, scale_loss=True):
    opt.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    if scale_loss:
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
    else:
        loss.backward()
    opt.step()
    return loss


def check_masters(model: nn.Module, opt: torch.optim.Optimizer, half: torch.dtype) -> None:
    """Half params have separate FP32 masters equal to them; FP32 params are their own."""
    params, masters = list(model.parameters()), list(amp.master_params(opt))
    assert len(params) == len(masters)
    for p, m in zip(params, masters):
        assert m.dtype == F32
        if p.dtype == F32:  # batch norm
            assert m is p
        else:
            assert p.dtype == half and m is not p
            assert torch.equal(p, m.to(half))
        assert m.grad is None or p.dtype == F32  # master grads dropped after the step


# ------------------------------------------------------------------ masters track the model
@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("level,half", MASTER_LEVELS, ids=MASTER_IDS)
def test_masters_equal_model_after_every_step(name, level, half):
    model = mlp()
    opt = OPTIMIZERS[name](model.parameters())
    model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=half)
    initial = [m.detach().clone() for m in amp.master_params(opt)]
    check_masters(model, opt, half)
    for x, y in batches(3):
        train_step(model, opt, x, y)
        check_masters(model, opt, half)
    final = list(amp.master_params(opt))
    assert all(not torch.equal(a, b) for a, b in zip(initial, final))  # every param was stepped
    for p, st in opt.state.items():
        assert p.dtype == F32  # state is keyed by masters
        for k, v in st.items():
            if torch.is_tensor(v) and v.is_floating_point() and k != "step":
                assert v.dtype == F32, (name, k)


@pytest.mark.parametrize("half", [F16, BF16])
def test_masters_accumulate_below_half_resolution(half):
    """1 - 2**-12 rounds to 1.0 in both half types: the master keeps it, O3 loses it."""
    def run(level: str) -> tuple[list[float], list[float]]:
        model = nn.Linear(4, 1, bias=False)
        with torch.no_grad():
            model.weight.fill_(1.0)
        opt = torch.optim.SGD(model.parameters(), lr=2.0 ** -14)  # grad of sum over 4 rows: 4
        amp.initialize(model, opt, opt_level=level, half_dtype=half, loss_scale=1.0)
        model_vals, master_vals = [], []
        for _ in range(16):
            opt.zero_grad()
            with amp.scale_loss(model(torch.ones(4, 4)).sum(), opt) as scaled:
                scaled.backward()
            opt.step()
            model_vals.append(model.weight[0, 0].item())
            master_vals.append(next(iter(amp.master_params(opt)))[0, 0].item())
        return model_vals, master_vals

    model_vals, master_vals = run("O2")
    assert master_vals[0] == 1.0 - 2.0 ** -12
    assert model_vals[0] == 1.0
    assert master_vals[-1] == 1.0 - 2.0 ** -8 == model_vals[-1]
    o3_vals, _ = run("O3")
    assert o3_vals[-1] == 1.0  # without masters every update rounds away


def test_optimizer_step_count_and_state_are_fp32_under_o5():
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    amp.initialize(model, opt, opt_level="O5")
    for x, y in batches(2):
        train_step(model, opt, x, y)
    st = opt.state[next(iter(amp.master_params(opt)))]
    assert st["exp_avg"].dtype == F32 and st["exp_avg_sq"].dtype == F32 and int(st["step"]) == 2


def test_o3_with_master_weights():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    amp.initialize(model, opt, opt_level="O3", master_weights=True)
    assert model[1].weight.dtype == BF16  # O3 casts batch norm too, so it gets a master as well
    assert all(m.dtype == F32 and m is not p for p, m in zip(model.parameters(), amp.master_params(opt)))
    for x, y in batches(2):
        train_step(model, opt, x, y)
        check_masters(model, opt, BF16)


def test_o2_without_master_weights_steps_the_half_params():
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    amp.initialize(model, opt, opt_level="O2", master_weights=False)
    assert all(m is p for p, m in zip(model.parameters(), amp.master_params(opt)))
    before = model[0].weight.detach().clone()
    for x, y in batches(2):
        train_step(model, opt, x, y)
    assert model[0].weight.dtype == BF16 and not torch.equal(before, model[0].weight)
    assert opt.state[model[0].weight]["exp_avg"].dtype == BF16
    assert opt.state[model[1].weight]["exp_avg"].dtype == F32  # FP32 batch norm


# ------------------------------------------------------------------ add_param_group
@pytest.mark.parametrize("level,half", MASTER_LEVELS, ids=MASTER_IDS)
def test_add_param_group_after_initialize_makes_masters(level, half):
    model = mlp()
    opt = torch.optim.SGD(model[0].parameters(), lr=0.05, momentum=0.9)
    amp.initialize(model, opt, opt_level=level, half_dtype=half)
    opt.add_param_group({"params": list(model[1].parameters()) + list(model[3].parameters()), "lr": 0.1})
    group = opt.param_groups[1]
    assert group["lr"] == 0.1 and group["momentum"] == 0.9
    assert group["params"][0] is model[1].weight and group["params"][1] is model[1].bias  # FP32 BN
    for p, m in zip(model[3].parameters(), group["params"][2:]):
        assert m is not p and m.dtype == F32 and torch.equal(m.to(half), p)
    before = model[3].weight.detach().clone()
    for x, y in batches(3):
        train_step(model, opt, x, y)
        check_masters(model, opt, half)
    assert not torch.equal(model[3].weight, before)
    # a single tensor as "params" works too
    extra = nn.Linear(2, 2).to(half)
    opt.add_param_group({"params": extra.weight})
    assert opt.param_groups[2]["params"][0].dtype == F32


def test_add_param_group_without_masters_keeps_params():
    model = mlp()
    opt = torch.optim.SGD(model[0].parameters(), lr=0.05)
    amp.initialize(model, opt, opt_level="O3")
    opt.add_param_group({"params": model[3].parameters()})
    assert opt.param_groups[1]["params"][0] is model[3].weight


# ------------------------------------------------------------------ state made before initialize
@pytest.mark.parametrize("level,half", MASTER_LEVELS + [("O3", BF16), ("O3", F16)],
                         ids=MASTER_IDS + ["O3-bf16", "O3-fp16"])
def test_existing_optimizer_state_is_recast(level, half):
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for x, y in batches(2):
        train_step(model, opt, x, y, scale_loss=False)  # plain FP32 steps: state exists
    saved = {name: {k: v.clone() for k, v in opt.state[p].items()} for name, p in model.named_parameters()}
    amp.initialize(model, opt, opt_level=level, half_dtype=half)
    masters = list(amp.master_params(opt))
    assert len(opt.state) == len(masters)
    for (name, p), m in zip(model.named_parameters(), masters):
        st = opt.state[m]
        assert int(st["step"]) == 2
        state_dtype = p.dtype if level == "O3" else F32  # O3: no masters, state follows the half param
        for k in ("exp_avg", "exp_avg_sq"):
            assert st[k].dtype == state_dtype, (name, k)
            assert torch.equal(st[k], saved[name][k].to(state_dtype)), (name, k)
    x, y = batches(1, seed=7)[0]
    train_step(model, opt, x, y)
    assert all(int(opt.state[m]["step"]) == 3 for m in masters)
    if level != "O3":
        check_masters(model, opt, half)


# ------------------------------------------------------------------ zeroing grads
ZEROERS = {
    "model.zero_grad": lambda model, opt: model.zero_grad(),
    "optimizer.zero_grad": lambda model, opt: opt.zero_grad(),
    "optimizer.zero_grad(set_to_none=False)": lambda model, opt: opt.zero_grad(set_to_none=False),
    "model.zero_grad(set_to_none=False)": lambda model, opt: model.zero_grad(set_to_none=False),
    "model grad = None": lambda model, opt: [setattr(p, "grad", None) for p in model.parameters()],
}


@pytest.mark.parametrize("zero", list(ZEROERS))
@pytest.mark.parametrize("level,half", MASTER_LEVELS[:2], ids=MASTER_IDS[:2])
def test_master_grads_never_leak(zero, level, half):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)  # no momentum: a zero grad means no change
    amp.initialize(model, opt, opt_level=level, half_dtype=half)
    x, y = batches(1)[0]
    for _ in range(2):  # large grads in the first steps
        ZEROERS[zero](model, opt)
        with amp.scale_loss(((model(x) - y) ** 2).sum(), opt) as scaled:
            scaled.backward()
        opt.step()
    ZEROERS[zero](model, opt)
    masters = [m.detach().clone() for m in amp.master_params(opt)]
    params = [p.detach().clone() for p in model.parameters()]
    with amp.scale_loss(model(x).sum() * 0.0, opt) as scaled:  # zero grads
        scaled.backward()
    for m in amp.master_params(opt):
        assert m.grad is None or not m.grad.any()
    for p in model.parameters():
        assert p.grad is None or not p.grad.any()
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(masters, amp.master_params(opt)))
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))


def test_overflowed_grads_do_not_leak_into_the_next_step():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    amp.initialize(model, opt, opt_level="O2", half_dtype=F16)
    x, y = batches(1)[0]
    masters = [m.detach().clone() for m in amp.master_params(opt)]
    opt.zero_grad()
    with amp.scale_loss(model(x).sum() * float("inf"), opt) as scaled:
        scaled.backward()
    opt.step()  # skipped
    assert amp.loss_scale() == 2.0 ** 15
    assert all(torch.equal(a, b) for a, b in zip(masters, amp.master_params(opt)))
    assert all(m.grad is None for m, p in zip(amp.master_params(opt), model.parameters()) if p.dtype == F16)
    opt.zero_grad()
    with amp.scale_loss(model(x).sum() * 0.0, opt) as scaled:
        scaled.backward()
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(masters, amp.master_params(opt)))


def test_grads_accumulate_over_two_scale_loss_blocks():
    """Two backward passes before one step: the masters get the sum (compared with O0)."""
    def run(level):
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        amp.initialize(model, opt, opt_level=level, half_dtype=F16)
        (x1, y1), (x2, y2) = batches(2)
        opt.zero_grad()
        for x, y in ((x1, y1), (x2, y2)):
            with amp.scale_loss(((model(x) - y) ** 2).mean(), opt) as scaled:
                scaled.backward()
        opt.step()
        out = [m.detach().clone() for m in amp.master_params(opt)]
        amp.deinitialize()
        return out

    ref, got = run("O0"), run("O2")
    for a, b in zip(ref, got):
        assert torch.allclose(a, b, rtol=0.02, atol=2e-3), (a - b).abs().max()


# ------------------------------------------------------------------ closures
def _closure(model, opt, x, y, calls):
    def closure():
        calls.append(1)
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        return loss
    return closure


@pytest.mark.parametrize("level,half", [("O2", BF16), ("O5", BF16), ("O1", F16), ("O2", F16)])
def test_closure_refused_with_masters_or_scaling(level, half):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level=level, half_dtype=half)
    before = [m.detach().clone() for m in amp.master_params(opt)]
    calls: list = []
    with pytest.raises(NotImplementedError, match="scale_loss"):
        opt.step(_closure(model, opt, *batches(1)[0], calls))
    with pytest.raises(NotImplementedError):
        opt.step(closure=_closure(model, opt, *batches(1)[0], calls))
    assert calls == []
    assert all(torch.equal(a, b) for a, b in zip(before, amp.master_params(opt)))


@pytest.mark.parametrize("level,half", [("O0", BF16), ("O3", BF16), ("O1", BF16), ("O4", BF16)])
def test_closure_works_without_masters_or_scaling(level, half):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level=level, half_dtype=half)
    before = [model[0].weight.detach().clone(), model[3].weight.detach().clone()]
    calls: list = []
    loss = opt.step(_closure(model, opt, *batches(1)[0], calls))
    assert calls == [1] and torch.is_tensor(loss) and loss.dtype == F32
    assert not torch.equal(before[0], model[0].weight) and not torch.equal(before[1], model[3].weight)


def test_lbfgs_at_o0_is_plain_lbfgs():
    ref = mlp()
    model = copy.deepcopy(ref)
    x, y = batches(1)[0]
    ref_opt = torch.optim.LBFGS(ref.parameters(), lr=0.5, max_iter=4)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    amp.initialize(model, opt, opt_level="O0")
    for _ in range(2):
        ref_opt.step(_closure(ref, ref_opt, x, y, []))
        opt.step(_closure(model, opt, x, y, []))
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), model.parameters()))


# ------------------------------------------------------------------ convergence vs O0
def regression_data():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(256, 8, generator=g)
    w = torch.randn(8, 1, generator=g)
    y = torch.tanh(x @ w) + 0.5 * x[:, :1] + 0.05 * torch.randn(256, 1, generator=g)
    return x, y


REG_OPTS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=1e-2),
}


def train_regression(opt_name: str, level: str, half, steps: int = 120) -> float:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = REG_OPTS[opt_name](model.parameters())
    model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=half, verbosity=0)
    x, y = regression_data()
    for step in range(steps):
        idx = slice((step % 4) * 64, (step % 4 + 1) * 64)
        train_step(model, opt, x[idx], y[idx])
    with torch.no_grad():
        final = ((model(x).float() - y) ** 2).mean().item()
    amp.deinitialize()
    return final


@pytest.mark.parametrize("opt_name", list(REG_OPTS))
def test_regression_matches_o0(opt_name):
    baseline = train_regression(opt_name, "O0", None)
    start = ((regression_data()[1]) ** 2).mean().item()
    assert baseline < 0.1 * start  # it learned something
    for level, half in [("O1", BF16), ("O2", BF16), ("O5", BF16), ("O1", F16), ("O2", F16)]:
        final = train_regression(opt_name, level, half)
        assert abs(final - baseline) <= 0.03 * baseline, (opt_name, level, half, final, baseline)


# ------------------------------------------------------------------ deinitialize / twice
def test_deinitialize_after_o2_restores_fp32_model_and_optimizer():
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    params = list(model.parameters())
    amp.initialize(model, opt, opt_level="O2", half_dtype=F16)
    for x, y in batches(3):
        train_step(model, opt, x, y)
    masters = [m.detach().clone() for m in amp.master_params(opt)]
    state = [{k: v.clone() for k, v in opt.state[m].items()} for m in amp.master_params(opt)]
    amp.deinitialize()
    assert list(model.parameters()) == params  # same objects
    for p, m, st in zip(params, masters, state):
        assert p.dtype == F32 and torch.equal(p, m)
        assert p.grad is None or any(p is q for q in model[1].parameters())  # BN keeps its FP32 grads
        assert opt.state[p]["exp_avg"].dtype == F32 and torch.equal(opt.state[p]["exp_avg"], st["exp_avg"])
    assert opt.param_groups[0]["params"] == params
    assert all(name not in vars(opt) for name in ("step", "zero_grad", "add_param_group", "state_dict"))
    assert "forward" not in vars(model)
    assert model.state_dict(keep_vars=True)["0.weight"] is params[0]
    assert all(t.dtype == F32 for t in model.buffers() if t.is_floating_point())
    # plain FP32 training continues on the model's own params
    x, y = batches(1, seed=9)[0]
    train_step(model, opt, x, y, scale_loss=False)
    assert not torch.equal(params[0], masters[0])
    assert int(opt.state[params[0]]["step"]) == 4


@pytest.mark.parametrize("second", ["O2", "O1"])
def test_initialize_twice(second):
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    forward = model.forward
    amp.initialize(model, opt, opt_level="O2", half_dtype=BF16)
    for x, y in batches(2):
        train_step(model, opt, x, y)
    masters = [m.detach().clone() for m in amp.master_params(opt)]
    exp_avg = [opt.state[m]["exp_avg"].clone() for m in amp.master_params(opt)]
    model, opt = amp.initialize(model, opt, opt_level=second, half_dtype=BF16)
    new_masters = list(amp.master_params(opt))
    assert len(new_masters) == len(masters) == len(list(model.parameters()))
    for m_old, m_new, ea in zip(masters, new_masters, exp_avg):
        assert m_new.dtype == F32 and torch.equal(m_old, m_new)  # exact FP32 values carried over
        assert torch.equal(opt.state[m_new]["exp_avg"], ea)
    if second == "O2":
        check_masters(model, opt, BF16)
        assert model.forward.__wrapped__ == forward  # wrapped once, around the original
    else:
        assert "forward" not in vars(model)
        assert all(p.dtype == F32 for p in model.parameters())
        assert all(m is p for m, p in zip(new_masters, model.parameters()))
    for x, y in batches(2, seed=4):
        loss = train_step(model, opt, x, y)
        assert torch.isfinite(loss)
    if second == "O2":
        check_masters(model, opt, BF16)
    assert all(int(opt.state[m]["step"]) == 4 for m in amp.master_params(opt))
    amp.deinitialize()
    assert "step" not in vars(opt) and "forward" not in vars(model)


# ------------------------------------------------------------------ resume
@pytest.mark.parametrize("level,half", MASTER_LEVELS[:2], ids=MASTER_IDS[:2])
def test_o2_resume_is_bitwise(level, half):
    data = batches(6)

    def fresh(seed):
        model = mlp(seed)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return amp.initialize(model, opt, opt_level=level, half_dtype=half)

    model, opt = fresh(0)
    for x, y in data[:3]:
        train_step(model, opt, x, y)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "amp": amp.state_dict()}, buf)
    for x, y in data[3:]:
        train_step(model, opt, x, y)
    ref_masters = [m.detach().clone() for m in amp.master_params(opt)]
    ref_params = [p.detach().clone() for p in model.parameters()]

    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    assert all(v.dtype != half for v in ckpt["model"].values())
    model, opt = fresh(1)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    amp.load_state_dict(ckpt["amp"])
    for x, y in data[3:]:
        train_step(model, opt, x, y)
    assert all(torch.equal(a, b) for a, b in zip(ref_masters, amp.master_params(opt)))
    assert all(torch.equal(a, b) for a, b in zip(ref_params, model.parameters()))


def test_fp32_checkpoint_loaded_after_initialize_gives_exact_masters():
    """Fine-tuning from FP32 weights loaded after initialize: the masters take the exact FP32
    values, not the half-rounded model values."""
    torch.manual_seed(0)
    pretrained = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    fp32 = {k: v.clone() for k, v in pretrained.state_dict().items()}
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O5", verbosity=0)
    model.load_state_dict(fp32)
    masters = list(amp.master_params(opt))
    assert torch.equal(masters[0], fp32["0.weight"])  # exact, not bf16-rounded
    assert not torch.equal(fp32["0.weight"].bfloat16().float(), fp32["0.weight"])  # the test can fail
    assert torch.equal(model[0].weight, fp32["0.weight"].bfloat16())
    # the model's own (half-precision) state dict loaded back keeps the better masters
    model.load_state_dict(model.state_dict())
    assert torch.equal(list(amp.master_params(opt))[0], fp32["0.weight"])


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_lr_scheduler_works_and_deinitialize_is_quiet(level, caplog):
    """Schedulers wrap `optimizer.step.__func__`: the patched step must be a bound method,
    and undoing it under a scheduler's wrapper is expected (no warning)."""
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()" would raise
        for _ in range(2):
            opt.zero_grad()
            with amp.scale_loss(model(torch.randn(2, 4)).float().sum(), opt) as s:
                s.backward()
            opt.step()
            sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ampatch"):
        amp.deinitialize()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "step" not in vars(opt)


# ============================================================== a handle without a session
def _standalone(model: nn.Module, opt: torch.optim.Optimizer, **context):
    """What Apex's FP16_Optimizer builds: masters for the model's params, made from its FP32
    weights before the model goes to half; the optimizer patched; no Session anywhere."""
    from ampatch.base.patcher import Patcher
    from ampatch.optim.context import HandleContext
    from ampatch.optim.handle import OptimizerHandle
    handle = OptimizerHandle(opt, master_ids={id(p) for p in model.parameters()},
                             context=HandleContext(**context))
    model.half()
    patcher = Patcher()
    handle.install(patcher)
    return handle, patcher


def test_a_handle_trains_and_skips_without_a_session():
    """OptimizerHandle + LossScaler + Verdict, no Session: the scaled backward is unscaled
    into FP32 masters, the step updates them and the half model, an overflow skips the step
    (masters and optimizer state untouched) and halves the scale."""
    from ampatch.optim.context import GradStage
    from ampatch.optim.scaler import LossScaler, Verdict
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    fp32 = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = LossScaler("dynamic")
    handle, patcher = _standalone(model, opt, scales_loss=lambda: not scaler.is_identity)
    masters = list(amp.master_params(opt))
    pairs = list(handle.pairs())
    assert len(pairs) == 2 and all(mp is p for (mp, _), p in zip(pairs, model.parameters()))
    assert handle.stage is GradStage.FRESH
    assert all(m.dtype == F32 for m in masters) and torch.equal(masters[0], fp32.weight)  # not the rounded copy
    x, y = torch.randn(8, 4), torch.randn(8, 2)

    def backward(poison: bool = False) -> None:
        handle.run_deferred()
        handle.before_backward(scaler.scale)
        (nn.functional.mse_loss(model(x.half()).float(), y) * scaler.scale).backward()
        if poison:
            model.weight.grad.view(-1)[0] = float("inf")
        found = handle.after_backward(scaler.scale, None, delay_unscale=False)
        Verdict(scaler, found, on_overflow=lambda before, after: handle.skip_next_step())()

    backward()
    assert model.weight.grad is None and masters[0].grad.dtype == F32 and handle.stage is GradStage.READY
    ref = copy.deepcopy(fp32)
    with torch.no_grad():
        for rp, mp in zip(ref.parameters(), model.parameters()):
            rp.copy_(mp.float())
    nn.functional.mse_loss(ref(x.half().float()), y).backward()
    for m, r in zip(masters, ref.parameters()):
        assert torch.allclose(m.grad, r.grad, rtol=1e-2, atol=1e-4)
    opt.step()
    assert not torch.equal(masters[0], fp32.weight) and torch.equal(model.weight, masters[0].half())
    state = copy.deepcopy(opt.state_dict())
    opt.zero_grad()
    backward(poison=True)
    assert handle.stage is GradStage.OVERFLOWED and scaler.scale == 2.0 ** 15
    opt.step()
    assert handle.stage is GradStage.READY and handle.steps == 2 and handle.consecutive_skips == 1
    saved = opt.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(saved["ampatch_masters"], state["ampatch_masters"]))
    assert torch.equal(saved["state"][0]["momentum_buffer"], state["state"][0]["momentum_buffer"])
    patcher.restore_all()
    assert "step" not in vars(opt)


def test_a_handle_reports_its_skip_streak_with_back_off():
    """50 skipped steps in a row are reported, then 100, 200; a step that runs starts over.
    Without a callback the handle warns by itself."""
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    streaks = []
    handle, _ = _standalone(model, opt, on_skips=lambda h, n: streaks.append(n))

    def skip(n: int) -> None:
        for _ in range(n):
            handle.skip_next_step()
            opt.step()

    skip(200)
    opt.step()
    skip(60)
    assert streaks == [50, 100, 200, 50] and handle.consecutive_skips == 60
    quiet = nn.Linear(2, 2)
    opt2 = torch.optim.SGD(quiet.parameters(), lr=0.1)
    handle2, _ = _standalone(quiet, opt2)
    with pytest.warns(RuntimeWarning, match="50 optimizer steps in a row were skipped"):
        for _ in range(50):
            handle2.skip_next_step()
            opt2.step()
