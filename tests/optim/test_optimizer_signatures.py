"""Optimizers that declare their methods their own way (Apex's Fused*, DeepSpeed's FusedAdam:
`zero_grad(self)`, `step(closure=None, grads=None, output_params=None, scale=None,
grad_norms=None)`) work at every level and master mode: ampatch passes each method only
what the user passed, and an argument the optimizer cannot take raises its own error.
"""
from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import ampatch as amp

BF16 = torch.bfloat16
SETUPS = [("O0", None), ("O1", None), ("O2", None), ("O3", None), ("O4", None), ("O5", None),
          ("O5", "stochastic"), ("O5", "kahan")]
SETUP_IDS = [lvl if mode is None else f"{lvl}-{mode}" for lvl, mode in SETUPS]


class FusedLike(torch.optim.SGD):
    """Apex's FusedSGD shape: zero_grad takes nothing, step takes Apex's extra keywords."""

    def __init__(self, params, **kw) -> None:
        super().__init__(params, **kw)
        self.step_calls: list[tuple] = []

    def zero_grad(self):  # noqa: D102 - as Apex and DeepSpeed declare it
        super().zero_grad()

    def step(self, closure=None, grads=None, output_params=None, scale=None, grad_norms=None):
        self.step_calls.append((closure, grads, output_params, scale, grad_norms))
        return super().step(closure)


class DeepSpeedAdamLike(torch.optim.Adam):
    """DeepSpeed's FusedAdam shape: `set_grad_none` decides, zero_grad takes nothing, and step
    refuses the Apex-era arguments with its own error."""

    def __init__(self, params, lr=1e-3, set_grad_none=True) -> None:
        super().__init__(params, lr=lr)
        self.set_grad_none = set_grad_none

    def zero_grad(self):
        super().zero_grad(set_to_none=self.set_grad_none)

    def step(self, closure=None, grads=None, output_params=None, scale=None, grad_norms=None, grad_scaler=None):
        if any(p is not None for p in [grads, output_params, scale, grad_norms]):
            raise RuntimeError("FusedAdam has been updated. Simply initialize it identically to torch.optim.Adam, "
                               "and call step() with no arguments.")
        return super().step(closure)


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 4, generator=g), torch.randn(16, 2, generator=g)) for _ in range(n)]


def init(model, opt, level, mode):
    kw = {} if mode is None else {"master_weights": mode}
    return amp.initialize(model, opt, opt_level=level, verbosity=0, **kw)


def train(model, opt, data, step=lambda o: o.step()) -> list[float]:
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = ((model(x).float() - y) ** 2).mean()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        step(opt)
        losses.append(loss.item())
    return losses


def test_the_issues_snippet_at_o1_o2_o3():
    for level in ("O1", "O2", "O3"):
        class Fused(torch.optim.SGD):
            def zero_grad(self):
                super().zero_grad()
        m = torch.nn.Linear(4, 4)
        o = Fused(m.parameters(), lr=0.1)
        m, o = amp.initialize(m, o, opt_level=level, verbosity=0)
        o.zero_grad()  # raised TypeError: takes 1 positional argument but 2 were given
        amp.deinitialize()


@pytest.mark.parametrize("level,mode", SETUPS, ids=SETUP_IDS)
def test_fused_shaped_optimizer_trains_like_its_torch_parent(level, mode):
    """zero_grad(self) and step with Apex's keywords, called every way a script calls them,
    train exactly like torch.optim.SGD at the same level."""
    data = batches(4)
    ways = [lambda o: o.step(), lambda o: o.step(None), lambda o: o.step(None, None, None, None, None),
            lambda o: o.step(grads=None, scale=None)]

    def run(make, ways):
        model = mlp()
        opt = make(model.parameters())
        model, opt = init(model, opt, level, mode)
        losses = []
        for x_y, way in zip(data, ways):
            losses += train(model, opt, [x_y], way)
        weights = [p.detach().float().clone() for p in model.parameters()]
        amp.deinitialize()
        return losses, weights, opt

    losses, weights, fused = run(lambda ps: FusedLike(ps, lr=0.05, momentum=0.9), ways)
    ref_losses, ref_weights, _ = run(lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), [ways[0]] * 4)
    assert losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(weights, ref_weights))
    calls = set(fused.step_calls)
    assert calls == {(None, None, None, None, None)}  # what each call gave, nothing added


@pytest.mark.parametrize("level,mode", SETUPS, ids=SETUP_IDS)
def test_deepspeed_shaped_adam_at_every_level(level, mode):
    model = mlp()
    opt = DeepSpeedAdamLike(model.parameters(), lr=1e-2)
    model, opt = init(model, opt, level, mode)
    before = [p.detach().float().clone() for p in model.parameters()]
    losses = train(model, opt, batches(3))
    assert all(torch.isfinite(torch.tensor(losses)))
    assert any(not torch.equal(a, p.detach().float()) for a, p in zip(before, model.parameters()))
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    assert all(m.grad is None for m in amp.master_params(opt))
    with pytest.raises(RuntimeError, match="FusedAdam has been updated"):  # its own refusal, reached
        opt.step(grads=[torch.zeros(1)])


@pytest.mark.parametrize("level,mode", SETUPS, ids=SETUP_IDS)
def test_an_argument_the_optimizer_cannot_take_raises_its_own_error(level, mode):
    model = mlp()
    opt = FusedLike(model.parameters(), lr=0.05)
    model, opt = init(model, opt, level, mode)
    with pytest.raises(TypeError, match=r"FusedLike\.zero_grad\(\) got an unexpected keyword argument 'set_to_none'"):
        opt.zero_grad(set_to_none=False)
    with pytest.raises(TypeError, match=r"FusedLike\.zero_grad\(\) takes 1 positional argument but 2 were given"):
        opt.zero_grad(False)
    train(model, opt, batches(1))  # nothing was left half-done
    with pytest.raises(TypeError, match=r"FusedLike\.step\(\) got an unexpected keyword argument 'lr'"):
        opt.step(lr=0.1)
    with pytest.raises(TypeError, match=r"state_dict\(\) takes 1 positional argument but 2 were given"):
        opt.state_dict("extra")


@pytest.mark.parametrize("level,mode", SETUPS, ids=SETUP_IDS)
def test_patched_methods_declare_the_optimizers_own_signatures(level, mode):
    model = mlp()
    opt = FusedLike(model.parameters(), lr=0.05)
    own = {name: inspect.signature(getattr(opt, name)) for name in ("step", "zero_grad", "state_dict",
                                                                      "load_state_dict", "add_param_group")}
    model, opt = init(model, opt, level, mode)
    assert {name: inspect.signature(getattr(opt, name)) for name in own} == own


@pytest.mark.parametrize("level,mode", [("O0", None), ("O2", None), ("O5", "kahan")], ids=["O0", "O2", "O5-kahan"])
def test_keyword_forms_of_add_param_group_and_load_state_dict(level, mode):
    model = mlp()
    extra = nn.Linear(2, 2)
    opt = FusedLike(model.parameters(), lr=0.05, momentum=0.9)
    (model, extra), opt = init([model, extra], opt, level, mode)
    opt.add_param_group(param_group={"params": list(extra.parameters())})
    steps = list(amp.master_params(opt))[-2:]
    if level != "O0":
        assert all(m.dtype == torch.float32 or mode == "kahan" for m in steps)
        assert all(m is not p or mode == "kahan" for m, p in zip(steps, extra.parameters()))
    train(model, opt, batches(1))
    sd = opt.state_dict()
    opt.load_state_dict(state_dict=sd)


def test_set_to_none_false_keeps_the_grad_tensors_zeroed():
    """A torch optimizer's own `set_to_none=False` reaches the masters at O2."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=BF16, verbosity=0)
    x, y = batches(1)[0]
    with amp.scale_loss(((model(x).float() - y) ** 2).mean(), opt) as scaled:
        scaled.backward()
    grads = [m.grad for m in amp.master_params(opt)]
    opt.zero_grad(set_to_none=False)
    assert all(m.grad is g and not g.any() for m, g in zip(amp.master_params(opt), grads))


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("which", ["fp16_utils", "optimizers"])
def test_apex_fp16_optimizers_over_a_fused_shaped_optimizer(which, set_to_none, apex_alias):
    """Apex's FP16_Optimizers zero the grads themselves, whatever the wrapped zero_grad takes."""
    if which == "fp16_utils":
        from apex.fp16_utils import FP16_Optimizer
    else:
        from apex.optimizers import FP16_Optimizer
    torch.manual_seed(0)
    model = nn.Linear(4, 2).half()
    wrapped = FP16_Optimizer(FusedLike(model.parameters(), lr=0.05), static_loss_scale=8.0)
    wrapped.backward(model(torch.randn(3, 4, dtype=torch.float16)).float().sum())
    everything = [*model.parameters(), *(p for g in wrapped.param_groups for p in g["params"])]
    held = [(p, p.grad) for p in everything if p.grad is not None]
    assert held
    wrapped.zero_grad(set_to_none)
    if set_to_none:
        assert all(p.grad is None for p in everything)
    else:
        assert all(p.grad is g and not g.any() for p, g in held)
    wrapped.backward(model(torch.randn(3, 4, dtype=torch.float16)).float().sum())
    wrapped.step()


def test_larc_over_a_fused_shaped_optimizer(apex_alias):
    from apex.parallel.LARC import LARC
    model = mlp()
    opt = LARC(FusedLike(model.parameters(), lr=0.05))
    x, y = batches(1)[0]
    ((model(x) - y) ** 2).mean().backward()
    opt.step()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(TypeError, match=r"FusedLike\.zero_grad\(\)"):
        opt.zero_grad(True)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_step_an_lr_scheduler_wrapped_before_initialize(level):
    """torch's LR schedulers put a wrapper of the class's step on the optimizer: the closure
    is still found where the optimizer's step declares it, and Apex's arguments still pass."""
    model = mlp()
    fused = FusedLike(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(fused, 1, gamma=0.5)
    model, opt = amp.initialize(model, fused, opt_level=level, half_dtype=torch.float16, verbosity=0)
    assert str(inspect.signature(opt.step)) == ("(closure=None, grads=None, output_params=None, scale=None, "
                                                "grad_norms=None)")
    for x_y in batches(2):
        train(model, opt, [x_y], lambda o: o.step(None, None))
        sched.step()
    assert fused.step_calls == [(None,) * 5] * 2 and fused.param_groups[0]["lr"] == 0.05 / 4
    with pytest.raises(NotImplementedError, match="closure"):
        opt.step(lambda: None)
