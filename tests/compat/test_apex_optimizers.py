"""`apex.optimizers` with Apex's math: each Fused* optimizer against its
update rule written out here (Apex's documented formulas, in float64), step by step for several
steps, with FP32 parameters and at O2 through `amp.initialize`; Apex's arguments and refusals;
state that round-trips through `state_dict()`."""
from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
import torch
from torch import nn

import ampatch as amp
from ampatch.compat import optimizers as O  # noqa: N812

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
STEPS = 4

Ref = Callable[[list[torch.Tensor], list[torch.Tensor], dict, int], list[torch.Tensor]]


# ------------------------------------------------------------------ the update rules, in float64
def adam_ref(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adam_w_mode=True, bias_correction=True) -> Ref:
    b1, b2 = betas

    def step(ps, gs, st, k):
        out = []
        for i, (p, g) in enumerate(zip(ps, gs)):
            g = g + weight_decay * p if not adam_w_mode else g
            m = st[i, "m"] = b1 * st.get((i, "m"), 0) + (1 - b1) * g
            v = st[i, "v"] = b2 * st.get((i, "v"), 0) + (1 - b2) * g * g
            bc1, bc2 = (1 - b1 ** k, 1 - b2 ** k) if bias_correction else (1.0, 1.0)
            update = (m / bc1) / ((v / bc2).sqrt() + eps) + (weight_decay * p if adam_w_mode else 0)
            out.append(p - lr * update)
        return out
    return step


def legacy_adam_ref(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, eps_inside_sqrt=False,
                    max_grad_norm=0.0, bias_correction=True) -> Ref:
    """The pre-2019 FusedAdam: clip by the group's gradient norm, step size lr * sqrt(bc2) / bc1."""
    b1, b2 = betas

    def step(ps, gs, st, k):
        norm = math.sqrt(sum(float((g * g).sum()) for g in gs))
        clip = (norm + 1e-6) / max_grad_norm if max_grad_norm > 0 else 0.0
        scale = clip if clip > 1 else 1.0
        bc1, bc2 = (1 - b1 ** k, 1 - b2 ** k) if bias_correction else (1.0, 1.0)
        out = []
        for i, (p, g) in enumerate(zip(ps, gs)):
            g = g / scale
            m = st[i, "m"] = b1 * st.get((i, "m"), 0) + (1 - b1) * g
            v = st[i, "v"] = b2 * st.get((i, "v"), 0) + (1 - b2) * g * g
            denom = (v + eps).sqrt() if eps_inside_sqrt else v.sqrt() + eps
            out.append(p - lr * math.sqrt(bc2) / bc1 * (m / denom + weight_decay * p))
        return out
    return step


def lamb_ref(lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, adam_w_mode=True, grad_averaging=True,
             max_grad_norm=1.0, use_nvlamb=False, bias_correction=True, update_dtype=torch.float64) -> Ref:
    """`update_dtype`: Apex's kernel keeps the update in the gradients, so it is rounded to their dtype."""
    b1, b2 = betas
    b3 = 1 - b1 if grad_averaging else 1.0

    def step(ps, gs, st, k):
        global_norm = math.sqrt(sum(float((g * g).sum()) for g in gs))
        clip = global_norm / max_grad_norm if global_norm > max_grad_norm else 1.0
        bc1, bc2 = (1 - b1 ** k, 1 - b2 ** k) if bias_correction else (1.0, 1.0)
        out = []
        for i, (p, g) in enumerate(zip(ps, gs)):
            g = g / clip + (weight_decay * p if not adam_w_mode else 0)
            m = st[i, "m"] = b1 * st.get((i, "m"), 0) + b3 * g
            v = st[i, "v"] = b2 * st.get((i, "v"), 0) + (1 - b2) * g * g
            u = (m / bc1) / ((v / bc2).sqrt() + eps) + (weight_decay * p if adam_w_mode else 0)
            u = u.to(update_dtype).double()
            p_norm, u_norm = float(p.norm()), float(u.norm())
            trust = p_norm / u_norm if (use_nvlamb or weight_decay != 0) and p_norm and u_norm else 1.0
            out.append(p - lr * trust * u)
        return out
    return step


def novograd_ref(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, reg_inside_moment=False,
                 grad_averaging=True, norm_type=2, init_zero=False, bias_correction=True) -> Ref:
    b1, b2 = betas
    b3 = 1 - b1 if grad_averaging else 1.0

    def step(ps, gs, st, k):
        bc1, bc2 = (1 - b1 ** k, math.sqrt(1 - b2 ** k)) if bias_correction else (1.0, 1.0)
        out = []
        for i, (p, g) in enumerate(zip(ps, gs)):
            fresh = float(g.abs().max()) if norm_type == 0 else float(g.norm())
            n = st.get((i, "n"), 0.0 if init_zero else fresh)
            n = st[i, "n"] = b2 * n + (1 - b2) * fresh if norm_type == 0 else math.sqrt(
                b2 * n * n + (1 - b2) * fresh * fresh)
            d = n / bc2 + eps
            if reg_inside_moment:
                m = st[i, "m"] = b1 * st.get((i, "m"), 0) + b3 * (g / d + weight_decay * p)
                out.append(p - lr * m / bc1)
            else:
                m = st[i, "m"] = b1 * st.get((i, "m"), 0) + b3 * g
                out.append(p - lr * ((m / bc1) / d + weight_decay * p))
        return out
    return step


def sgd_ref(lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, wd_after_momentum=False) -> Ref:
    def step(ps, gs, st, k):
        out = []
        for i, (p, g) in enumerate(zip(ps, gs)):
            d = g + weight_decay * p if not wd_after_momentum else g
            if momentum:
                buf = st[i, "buf"] = d if k == 1 else momentum * st[i, "buf"] + (1 - dampening) * d
                d = d + momentum * buf if nesterov else buf
            d = d + weight_decay * p if wd_after_momentum else d
            out.append(p - lr * d)
        return out
    return step


def adagrad_ref(lr=1e-2, eps=1e-10, weight_decay=0.0, adagrad_w_mode=False) -> Ref:
    def step(ps, gs, st, k):
        out = []
        for i, (p, g) in enumerate(zip(ps, gs)):
            g = g + weight_decay * p if not adagrad_w_mode else g
            h = st[i, "h"] = st.get((i, "h"), 0) + g * g
            out.append(p - lr * (g / (h.sqrt() + eps) + (weight_decay * p if adagrad_w_mode else 0)))
        return out
    return step


CASES = {
    "adam": (O.FusedAdam, dict(lr=1e-2, weight_decay=0.1), adam_ref),
    "adam-l2-no-bias-correction": (O.FusedAdam, dict(lr=1e-2, weight_decay=0.1, adam_w_mode=False,
                                                      bias_correction=False, betas=(0.8, 0.9)), adam_ref),
    "adam-pre-2019": (O.FusedAdam, dict(lr=1e-2, weight_decay=0.01, eps_inside_sqrt=True, max_grad_norm=0.5,
                                        bias_correction=False), legacy_adam_ref),
    # eps outside the un-corrected sqrt(v), sqrt(bc2) in the step size (not torch.optim.Adam's since
    # PyTorch 1.6): with gradients clipped to ~1e-5 that placement moves each step by ~2%
    "adam-pre-2019-eps-outside": (O.FusedAdam, dict(lr=1.0, max_grad_norm=1e-4), legacy_adam_ref),
    "lamb": (O.FusedLAMB, dict(lr=1e-2, weight_decay=0.01, max_grad_norm=0.5), lamb_ref),
    "lamb-l2-nvlamb": (O.FusedLAMB, dict(lr=1e-2, weight_decay=0.0, adam_w_mode=False, use_nvlamb=True,
                                         grad_averaging=False, bias_correction=False), lamb_ref),
    "mixed-precision-lamb": (O.FusedMixedPrecisionLamb, dict(lr=1e-2, weight_decay=0.01, max_grad_norm=0.5),
                             lamb_ref),
    "novograd": (O.FusedNovoGrad, dict(lr=1e-2, weight_decay=0.01, betas=(0.9, 0.5)), novograd_ref),
    "novograd-inside-maxnorm": (O.FusedNovoGrad, dict(lr=1e-2, weight_decay=0.01, reg_inside_moment=True,
                                                      norm_type=0, init_zero=True, grad_averaging=False),
                                novograd_ref),
    "sgd-nesterov": (O.FusedSGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True), sgd_ref),
    "sgd-wd-after-momentum": (O.FusedSGD, dict(lr=0.1, momentum=0.9, dampening=0.2, weight_decay=0.01,
                                               wd_after_momentum=True), sgd_ref),
    "adagrad": (O.FusedAdagrad, dict(lr=0.1, weight_decay=0.01), adagrad_ref),
    "adagrad-w-mode": (O.FusedAdagrad, dict(lr=0.1, weight_decay=0.01, adagrad_w_mode=True), adagrad_ref),
}


def _check_steps(opt: torch.optim.Optimizer, params: list[torch.Tensor], ref: Ref, backward: Callable[[int], None],
                 atol: float = 1e-6) -> None:
    """Each step: the params after `opt.step()` equal the rule applied to the params and grads before it."""
    state: dict = {}
    for k in range(1, STEPS + 1):
        backward(k)
        before = [p.detach().double() for p in params]
        grads = [p.grad.detach().double() for p in params]
        opt.step()
        want = ref(before, grads, state, k)
        for p, w in zip(params, want):
            torch.testing.assert_close(p.detach().double(), w, rtol=1e-5, atol=atol)


@pytest.mark.parametrize("name", list(CASES))
def test_fp32_steps_follow_the_formula(name) -> None:
    cls, kw, ref = CASES[name]
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(7, 5)), nn.Parameter(torch.randn(5))]
    opt = cls(params, **kw)

    def backward(k: int) -> None:
        for p in params:
            p.grad = torch.randn_like(p)

    _check_steps(opt, params, ref(**kw), backward)


@pytest.mark.parametrize("name", ["adam", "adam-l2-no-bias-correction", "lamb", "mixed-precision-lamb",
                                  "novograd", "sgd-nesterov", "adagrad-w-mode"])
def test_o2_steps_the_fp32_masters_by_the_formula(name) -> None:
    """At O2 the optimizer sees FP32 masters with unscaled FP32 grads; each step follows the rule."""
    cls, kw, ref = CASES[name]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = cls(model.parameters(), **kw)
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=BF16, verbosity=0)
    try:
        masters = list(amp.master_params(opt))
        assert {p.dtype for p in masters} == {F32} and model[0].weight.dtype == BF16

        def backward(k: int) -> None:
            opt.zero_grad()
            with amp.scale_loss(model(torch.randn(5, 6)).float().pow(2).mean(), opt) as scaled:
                scaled.backward()

        _check_steps(opt, masters, ref(**kw), backward, atol=1e-5)
        assert torch.equal(model[0].weight, masters[0].to(BF16))
    finally:
        amp.deinitialize()


def test_fused_adam_under_o2_in_float16_with_a_loss_scale() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 3))
    opt = O.FusedAdam(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=F16, loss_scale=128.0, verbosity=0)
    try:
        masters = list(amp.master_params(opt))

        def backward(k: int) -> None:
            opt.zero_grad()
            with amp.scale_loss(model(torch.randn(5, 6, dtype=F16)).float().pow(2).mean(), opt) as scaled:
                scaled.backward()

        _check_steps(opt, masters, adam_ref(lr=1e-2), backward, atol=1e-5)
    finally:
        amp.deinitialize()


# ------------------------------------------------------------------ capturable, master weights, GradScaler
@pytest.mark.filterwarnings("ignore:GradScaler is going to stop passing itself")  # Apex's step(grad_scaler=)
def test_capturable_adam_with_master_weights_and_a_grad_scaler() -> None:
    """`FusedAdam(capturable=True, master_weights=True)` keeps FP32 copies of half params and
    steps them; with `torch.amp.GradScaler` it unscales inside the step and skips an overflow."""
    torch.manual_seed(0)
    half = nn.Parameter(torch.randn(4, 3).to(F16))
    opt = O.FusedAdam([half], lr=1e-2, capturable=True, master_weights=True)
    assert opt._step_supports_amp_scaling and isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    master = opt.param_groups_master[0]["params"][0]
    assert master.dtype == F32 and torch.equal(master.half(), half.detach())
    scaler = torch.amp.GradScaler("cpu", init_scale=64.0)
    ref, state = adam_ref(lr=1e-2), {}
    step = 0
    for inject in (False, True, False):
        half.grad = None
        loss = (half.float() * torch.randn(4, 3)).sum()
        scaler.scale(loss).backward()
        if inject:
            half.grad[0, 0] = float("inf")
        before, grad = master.detach().double(), half.grad.detach().double() / scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        if inject:
            assert torch.equal(master.double(), before) and opt.param_groups[0]["step"].item() == step
            continue
        step += 1
        (want,) = ref([before], [grad], state, step)
        torch.testing.assert_close(master.double(), want, rtol=1e-5, atol=1e-6)
        assert torch.equal(half.detach(), master.half()) and opt.param_groups[0]["step"].item() == step
        torch.testing.assert_close(half.grad.double(), grad, rtol=1e-3, atol=1e-3)  # left unscaled, as in Apex


def test_mixed_precision_lamb_keeps_fp32_masters_for_reduced_params() -> None:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(6, 4).to(BF16)), nn.Parameter(torch.randn(4).to(BF16))]
    opt = O.FusedMixedPrecisionLamb(params, lr=1e-2, reduced_precision_dtype=BF16)
    ref, state = lamb_ref(lr=1e-2, update_dtype=BF16), {}
    for k in range(1, STEPS + 1):
        for p in params:
            p.grad = torch.randn_like(p)
        masters = [m if m is not None else p for m, p in zip(opt.param_groups_full_precision[0]["params"], params)] \
            if k > 1 else [p.detach().float() for p in params]
        before, grads = [m.detach().double() for m in masters], [p.grad.double() for p in params]
        opt.step()
        masters = opt.param_groups_full_precision[0]["params"]
        for m, w, p in zip(masters, ref(before, grads, state, k), params):
            assert m.dtype == F32 and opt.state[p]["exp_avg"].dtype == F32
            torch.testing.assert_close(m.double(), w, rtol=1e-5, atol=1e-6)
            assert torch.equal(p.detach(), m.to(BF16))


# ------------------------------------------------------------------ arguments, refusals, state
def test_apex_arguments_and_refusals() -> None:
    params = [nn.Parameter(torch.randn(3))]
    for cls in (O.FusedAdam, O.FusedLAMB, O.FusedNovoGrad, O.FusedMixedPrecisionLamb):
        with pytest.raises(RuntimeError, match="AMSGrad"):
            cls(params, amsgrad=True)
    with pytest.raises(RuntimeError, match="only supported with the capturable version"):
        O.FusedAdam(params, master_weights=True)
    with pytest.raises(RuntimeError, match="step\\(\\) with no arguments"):
        O.FusedAdam(params).step(scale=128.0)
    assert O.FusedSGD([{"params": params, "lr": 0.5}]).param_groups[0]["lr"] == 0.5  # lr may be left out
    with pytest.raises(ValueError, match="lr"):
        O.FusedSGD(params)  # unless no group sets it
    groups = [{"params": (p for p in params), "lr": 0.1}]
    assert len(O.FusedAdam(groups).param_groups[0]["params"]) == 1  # generators read once
    for cls, none in ((O.FusedAdam, True), (O.FusedLAMB, True), (O.FusedSGD, False), (O.FusedAdagrad, True)):
        opt = cls(params, lr=0.1)
        params[0].grad = torch.ones(3)
        opt.zero_grad()
        assert (params[0].grad is None) is none  # set_grad_none: Apex's default per optimizer
    opt = O.FusedLAMB(params, set_grad_none=False)
    params[0].grad = torch.ones(3)
    opt.zero_grad()
    assert params[0].grad is not None and not params[0].grad.any()


def test_the_pre_2019_step_arguments() -> None:
    """Old FusedAdam scripts (under Apex's FP16_Optimizer) passed `scale` and `grad_norms` to step."""
    p = nn.Parameter(torch.ones(4))
    opt = O.FusedAdam([p], lr=0.1, max_grad_norm=1.0)
    p.grad = torch.full((4,), 64.0)
    opt.step(scale=64.0, grad_norms=[128.0])  # |g| / scale = 2 > 1: the grads are divided by 64 * 2
    assert torch.allclose(opt.state[p]["exp_avg"], torch.full((4,), 0.1 * 0.5), atol=1e-6)
    assert opt.state[p]["step"] == 1


@pytest.mark.parametrize("name", ["adam", "adam-pre-2019", "lamb", "mixed-precision-lamb", "novograd",
                                  "sgd-nesterov", "adagrad"])
def test_state_dict_round_trips(name) -> None:
    cls, kw, _ = CASES[name]
    torch.manual_seed(0)
    a = [nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(3))]
    b = [nn.Parameter(p.detach().clone()) for p in a]
    opt_a = cls(a, **kw)
    grads = [[torch.randn_like(p) for p in a] for _ in range(4)]
    for g in grads[:2]:
        for p, gp in zip(a, g):
            p.grad = gp.clone()
        opt_a.step()
    for p, q in zip(a, b):
        q.data.copy_(p.data)
    opt_b = cls(b, **kw)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    for g in grads[2:]:
        for ps in (a, b):
            for p, gp in zip(ps, g):
                p.grad = gp.clone()
        opt_a.step(), opt_b.step()
    for p, q in zip(a, b):
        assert torch.equal(p, q)


def test_half_params_keep_fp32_moments_through_load_state_dict() -> None:
    p = nn.Parameter(torch.randn(4).to(F16))
    opt = O.FusedAdam([p], lr=1e-3)
    p.grad = torch.randn(4).to(F16)
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == F32  # Apex: FP32 moments for a half param
    opt2 = O.FusedAdam([nn.Parameter(p.detach().clone())], lr=1e-3)
    opt2.load_state_dict(opt.state_dict())
    assert next(iter(opt2.state.values()))["exp_avg"].dtype == F32  # torch would have made them float16
