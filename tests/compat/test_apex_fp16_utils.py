"""`apex.fp16_utils` and `apex.optimizers.FP16_Optimizer`: Apex's manual
mixed-precision workflow (a half model by hand, the optimizer wrapped) on ampatch's master
weights and loss scaler, with no amp session; and scripts written the way NVIDIA's ConvNets
(`--fp16`) and BERT SQuAD (`--old`) used it, run unmodified through `ampatch run --apex-alias`."""
from __future__ import annotations

import copy
import gc
import io
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _cli import ampatch_main
from torch import nn

import ampatch as amp
from ampatch.compat import fp16_utils, optimizers
from ampatch.compat.fp16_utils import FP16_Optimizer

F32, F16 = torch.float32, torch.float16


def _half_net(seed: int = 0) -> nn.Module:
    """A float16 model with an FP32 batch norm, as `network_to_half` made them."""
    torch.manual_seed(seed)
    return fp16_utils.network_to_half(nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)))


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)


def _loss(model: nn.Module, i: int) -> torch.Tensor:
    x, y = _batch(i)
    return nn.functional.mse_loss(model(x).float(), y)


class Poison:
    """A grad hook that makes one parameter's gradient inf while `on`."""

    def __init__(self, param: torch.Tensor) -> None:
        self.on = False
        param.register_hook(lambda g: g * float("inf") if self.on else g)


def _reference(steps: int, scale: float, dynamic: bool, window: int, poison_at: set[int]) -> tuple:
    """Apex's FP16_Optimizer written out: FP32 masters of the half params; each step the
    scaled half grads go to FP32, are divided by the scale and checked; an overflow skips the
    step and (dynamic) halves the scale; `window` clean steps double it; the half model takes
    the masters' values after each step."""
    model = _half_net()
    half = [p for p in model.parameters() if p.dtype == F16]
    masters = {id(p): p.detach().clone().float().requires_grad_() for p in half}
    stepped = [masters.get(id(p), p) for p in model.parameters()]
    sgd = torch.optim.SGD(stepped, lr=0.1, momentum=0.9)
    poison = Poison(model[1][0].weight)
    clean, scales = 0, []
    for i in range(steps):
        for p in model.parameters():
            p.grad = None
        poison.on = i in poison_at
        (_loss(model, i).float() * scale).backward()
        grads = [p.grad.float() * (1.0 / scale) for p in model.parameters()]
        if not all(torch.isfinite(g).all() for g in grads):
            clean = 0
            scale = scale / 2 if dynamic else scale
        else:
            for s, g in zip(stepped, grads):
                s.grad = g
            sgd.step()
            with torch.no_grad():
                for p in half:
                    p.copy_(masters[id(p)])
            clean += 1
            if dynamic and clean == window:
                scale, clean = scale * 2, 0
        scales.append(scale)
    return model, scales


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_fp16_optimizer_trains_as_apex_computed_it(dynamic: bool) -> None:
    """Bit for bit the written-out algorithm, an overflowed step skipped (at a static scale
    too: Apex applied the inf), the dynamic scale halved on it and doubled after
    `scale_window` clean steps."""
    steps, poison_at = 7, {2}
    ref, ref_scales = _reference(steps, 2.0 ** 10, dynamic, 2, poison_at)
    model = _half_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if dynamic:
        opt = FP16_Optimizer(opt, dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 2.0 ** 10,
                                                                                "scale_window": 2}, verbose=False)
    else:
        opt = FP16_Optimizer(opt, static_loss_scale=2.0 ** 10, verbose=False)
    poison = Poison(model[1][0].weight)
    scales, overflows = [], []
    for i in range(steps):
        opt.zero_grad()
        poison.on = i in poison_at
        before = copy.deepcopy(opt.optimizer.state_dict())
        opt.backward(_loss(model, i))
        overflows.append(opt.overflow)
        opt.step()
        if opt.overflow:
            after = opt.optimizer.state_dict()
            assert torch.equal(after["state"][0]["momentum_buffer"], before["state"][0]["momentum_buffer"])
        scales.append(opt.loss_scale)
    assert overflows == [i in poison_at for i in range(steps)]
    assert scales == ref_scales
    for p, r in zip(model.parameters(), ref.parameters()):
        assert p.dtype == r.dtype and torch.equal(p, r)


def test_dynamic_defaults_are_apexs_amp_scaler() -> None:
    """Apex's last FP16_Optimizer made amp's LossScaler("dynamic", **dynamic_loss_args)."""
    opt = FP16_Optimizer(torch.optim.SGD(_half_net().parameters(), lr=0.1), dynamic_loss_scale=True)
    assert opt.loss_scale == 2.0 ** 16 and opt.loss_scaler.dynamic
    assert opt.loss_scaler._scale_seq_len == 2000 and opt.loss_scaler._max_loss_scale == 2.0 ** 24
    with pytest.raises(TypeError, match=r"unknown keys \['delayed_shift'\].*init_scale"):
        FP16_Optimizer(torch.optim.SGD(_half_net().parameters(), lr=0.1), dynamic_loss_scale=True,
                       dynamic_loss_args={"delayed_shift": 2})
    static = FP16_Optimizer(torch.optim.SGD(_half_net().parameters(), lr=0.1), static_loss_scale=128.0)
    static.loss_scale = 256.0  # Apex: a static scale may be scheduled by hand
    assert static.loss_scale == 256.0 and static.loss_scaler.loss_scale() == 256.0


def test_several_backward_passes_add_up_in_the_masters() -> None:
    """`backward(loss, update_master_grads=False)` twice, then `update_master_grads()`: the
    masters hold the sum, unscaled once; `step()` before the update refuses."""
    model = _half_net()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=64.0, verbose=False)
    ref = copy.deepcopy(model)
    (_loss(ref, 0) + _loss(ref, 1)).backward()
    opt.backward(_loss(model, 0), update_master_grads=False)
    opt.backward(_loss(model, 1), update_master_grads=False)
    with pytest.raises(RuntimeError, match="update_master_grads"):
        opt.step()
    opt.update_master_grads()
    grads = [g for group in opt.inspect_master_grad_data() for g in group]
    assert all(g.dtype == F32 for g in grads)
    half_ids = {id(p) for group in opt.fp16_groups for p in group}
    expected = [p.grad.float() for p in ref.parameters() if id(p) in half_ids]
    got = [m.grad for group in opt.fp32_from_fp16_groups for m in group]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=2e-3, atol=1e-4)  # two half backward passes vs one
    total = opt.clip_master_grads(1e-3)
    assert float(total) > 1e-3
    assert torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])) <= 1e-3 * (1 + 1e-4)


def test_the_master_grads_are_there_for_a_script_to_divide() -> None:
    """ConvNets divides the masters' grads by its batch multiplier between backward and step
    (`optimizer.optimizer.param_groups`), and sets the learning rate through `param_groups`."""
    model = _half_net()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=8.0, verbose=False)
    opt.backward(_loss(model, 0))
    before = [p.detach().clone() for g in opt.optimizer.param_groups for p in g["params"]]
    grads = [p.grad.clone() for g in opt.optimizer.param_groups for p in g["params"]]
    for group in opt.optimizer.param_groups:
        for param in group["params"]:
            param.grad /= 4
    for group in opt.param_groups:
        group["lr"] = 0.5
    opt.step()
    after = [p.detach() for g in opt.optimizer.param_groups for p in g["params"]]
    for b, a, g in zip(before, after, grads):
        torch.testing.assert_close(a, b - 0.5 * g / 4)


def _checkpoint(sd: dict) -> dict:
    """Through torch.save/torch.load with torch's default `weights_only=True`."""
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf)


@pytest.mark.parametrize("wrapper", ["fp16_utils", "optimizers"])
def test_a_resume_continues_bit_for_bit(wrapper: str) -> None:
    """Save after 3 steps, go on for 3; a new model and optimizer loaded from the checkpoint
    make the same 3 steps, loss scale and Adam moments included."""
    def make(model: nn.Module):
        if wrapper == "fp16_utils":
            return FP16_Optimizer(torch.optim.Adam(model.parameters(), lr=1e-2), dynamic_loss_scale=True,
                                  dynamic_loss_args={"init_scale": 2.0 ** 8, "scale_window": 2}, verbose=False)
        return optimizers.FP16_Optimizer(optimizers.FusedAdam(model.parameters(), lr=1e-2, bias_correction=False,
                                                              max_grad_norm=1.0), dynamic_loss_scale=True)

    def train(model: nn.Module, opt, steps: range) -> None:
        for i in steps:
            opt.zero_grad()
            opt.backward(_loss(model, i))
            opt.step()

    model = _half_net()
    opt = make(model)
    train(model, opt, range(3))
    saved = _checkpoint({"model": model.state_dict(), "optimizer": opt.state_dict()})
    train(model, opt, range(3, 6))
    resumed = _half_net(seed=1)
    ropt = make(resumed)
    resumed.load_state_dict(saved["model"])
    ropt.load_state_dict(saved["optimizer"])
    train(resumed, ropt, range(3, 6))
    for p, r in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, r)
    a, b = opt.state_dict(), ropt.state_dict()
    assert a.keys() == b.keys() and a["optimizer_state_dict"]["state"].keys()
    scale_key = "loss_scaler" if wrapper == "fp16_utils" else "cur_scale"
    assert a[scale_key] == b[scale_key]
    for key in a["optimizer_state_dict"]["state"]:
        for name, value in a["optimizer_state_dict"]["state"][key].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(b["optimizer_state_dict"]["state"][key][name]))


def test_a_checkpoint_has_apexs_keys_and_bad_ones_change_nothing() -> None:
    model = _half_net()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), static_loss_scale=4.0)
    opt.backward(_loss(model, 0))
    opt.step()
    sd = opt.state_dict()
    assert set(sd) == {"loss_scaler", "dynamic_loss_scale", "overflow", "first_closure_call_this_step",
                       "optimizer_state_dict", "fp32_from_fp16"}
    assert "ampatch_masters" not in sd["optimizer_state_dict"]
    assert [len(g) for g in sd["fp32_from_fp16"]] == [4] and all(m.dtype == F32 for m in sd["fp32_from_fp16"][0])
    before = [p.detach().clone() for p in model.parameters()]
    other = FP16_Optimizer(torch.optim.SGD(nn.Linear(2, 2).half().parameters(), lr=0.1), static_loss_scale=4.0)
    with pytest.raises(ValueError, match="another model"):
        opt.load_state_dict(other.state_dict())
    with pytest.raises(KeyError, match="loss_scaler"):
        opt.load_state_dict({k: v for k, v in sd.items() if k != "loss_scaler"})
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and opt.loss_scale == 4.0
    fused = optimizers.FP16_Optimizer(optimizers.FusedAdam(_half_net().parameters(), bias_correction=False,
                                                           max_grad_norm=1.0), dynamic_loss_scale=True)
    assert set(fused.state_dict()) == {"dynamic_loss_scale", "cur_scale", "cur_iter", "last_overflow_iter",
                                       "scale_factor", "scale_window", "optimizer_state_dict", "fp32_groups_flat"}


def test_the_fused_wrapper_clips_and_skips_as_apex() -> None:
    """`apex.optimizers.FP16_Optimizer` over the pre-2019 FusedAdam: Apex's formula with the
    group's gradient norm (clip by `max_grad_norm`), no bias correction; an overflow skips the
    step and halves a dynamic scale, which starts at 2**16; `dynamic_loss_args` is refused."""
    with pytest.raises(SystemError):
        optimizers.FP16_Optimizer(optimizers.FusedAdam(_half_net().parameters()), dynamic_loss_scale=True,
                                  dynamic_loss_args={"scale_window": 10})
    model = _half_net()
    ref = copy.deepcopy(model)
    opt = optimizers.FP16_Optimizer(optimizers.FusedAdam(model.parameters(), lr=1e-2, bias_correction=False,
                                                         max_grad_norm=0.1, weight_decay=0.01),
                                    dynamic_loss_scale=True)
    assert opt.cur_scale == 2.0 ** 16 and opt.scale_window == 1000
    opt.zero_grad()
    opt.backward(_loss(model, 0))
    assert model[1][0].weight.grad is not None  # scaled half grads until step(), as in Apex
    opt.step()
    _loss(ref, 0).float().backward()
    grads = [p.grad.float() for p in ref.parameters()]
    norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])).item()
    clip = max((norm + 1e-6) / 0.1, 1.0)
    for p, r, g in zip(model.parameters(), ref.parameters(), grads):
        g = g / clip
        m, v = 0.1 * g, 0.001 * g * g
        expected = r.detach().float() - 1e-2 * (m / (v.sqrt() + 1e-8) + 0.01 * r.detach().float())
        torch.testing.assert_close(p.float(), expected.to(p.dtype).float(), rtol=1e-3, atol=1e-3)
    poison = Poison(model[1][0].weight)
    poison.on = True
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    opt.backward(_loss(model, 1))
    opt.step()
    assert opt.cur_scale == 2.0 ** 15 and opt.last_overflow_iter == 1 and opt.cur_iter == 2
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_the_fused_wrapper_state_dict_keeps_apex_last_overflow_iter_and_refuses_a_bad_window() -> None:
    """`last_overflow_iter` is saved as the wrapper holds it (-1 before any overflow, also after the
    scale grew), and a checkpoint whose `scale_window` is not a positive int is refused."""
    model = _half_net()
    opt = optimizers.FP16_Optimizer(optimizers.FusedAdam(model.parameters(), lr=1e-3), dynamic_loss_scale=True)
    opt.load_state_dict({**opt.state_dict(), "scale_window": 2, "cur_scale": 16.0})  # grow after two clean steps
    for i in range(3):
        opt.zero_grad()
        opt.backward(_loss(model, i))
        opt.step()
    assert opt.last_overflow_iter == -1 and opt.cur_scale == 32.0
    sd = opt.state_dict()
    assert sd["last_overflow_iter"] == -1 and sd["cur_iter"] == 3
    opt.load_state_dict(sd)
    assert opt.last_overflow_iter == -1 and opt.cur_scale == 32.0
    for window in (0, 2.5, -3, True):
        with pytest.raises(ValueError, match="positive int"):
            opt.load_state_dict({**sd, "scale_window": window})
    assert opt.scale_window == 2 and opt.cur_scale == 32.0  # a refused checkpoint changes nothing


def test_a_closure_is_run_again_after_an_overflow() -> None:
    """`step(closure)`: the closure calls `optimizer.backward`; an overflowed one runs again
    at the halved scale before the optimizer uses its gradients."""
    model = _half_net()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True,
                         dynamic_loss_args={"init_scale": 2.0 ** 8}, verbose=False)
    poison = Poison(model[1][0].weight)
    calls = []

    def closure() -> torch.Tensor:
        poison.on = not calls
        calls.append(opt.loss_scale)
        opt.zero_grad()
        loss = _loss(model, 0)
        opt.backward(loss)
        return loss

    before = model[1][0].weight.detach().clone()
    opt.step(closure)
    assert calls == [2.0 ** 8, 2.0 ** 7] and not opt.overflow and opt.first_closure_call_this_step
    assert not torch.equal(before, model[1][0].weight)


def test_no_patches_are_left_behind() -> None:
    """The wrapper patches the optimizer with its own patcher: amp sessions that start and end
    meanwhile leave it alone, and when it is garbage collected the optimizer steps its own
    params again, with its own methods."""
    model = _half_net()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = FP16_Optimizer(inner, static_loss_scale=8.0, verbose=False)
    with pytest.raises(ValueError, match="already wrapped"):
        FP16_Optimizer(inner)
    other = nn.Linear(3, 3)
    amp.initialize(other, torch.optim.SGD(other.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    amp.deinitialize()
    opt.backward(_loss(model, 0))
    opt.step()
    assert "step" in vars(inner) and all(p.dtype == F32 for p in inner.param_groups[0]["params"])
    del opt
    gc.collect()
    assert not {"step", "zero_grad", "state_dict", "_amp_stash"} & set(vars(inner))
    assert [id(p) for p in inner.param_groups[0]["params"]] == [id(p) for p in model.parameters()]
    assert inner.state[model[1][0].weight]["momentum_buffer"].dtype == F16
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    amp_model = nn.Linear(2, 2)
    amp.initialize(amp_model, sgd, opt_level="O0", verbosity=0)
    with pytest.raises(ValueError, match="amp.initialize"):
        FP16_Optimizer(sgd)


def test_bad_arguments_name_the_fix() -> None:
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        FP16_Optimizer(_half_net())
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        FP16_Optimizer(torch.optim.SGD([nn.Parameter(torch.zeros(2, dtype=torch.float64))], lr=0.1))
    with pytest.raises(ValueError, match="static_loss_scale"):
        FP16_Optimizer(torch.optim.SGD(_half_net().parameters(), lr=0.1), static_loss_scale=0.0)
    opt = FP16_Optimizer(torch.optim.SGD(_half_net().parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="state_dict"):
        copy.deepcopy(opt)
    with pytest.raises(TypeError, match="loss tensor"):
        opt.backward(1.0)


def test_the_stand_alone_loss_scalers_follow_apexs_rules() -> None:
    """`DynamicLossScaler(init_scale=2**32, scale_factor=2., scale_window=1000)`: Apex's rule
    (`cur_iter - last_overflow_iter` a multiple of the window doubles, an overflow divides,
    not below 1), written out here, for a long sequence; `LossScaler` is static."""
    flags = [False] * 5 + [True] + [False] * 7 + [True, True] + [False] * 9 + [True] * 40
    ours = fp16_utils.DynamicLossScaler(init_scale=2.0 ** 6, scale_factor=4.0, scale_window=3)
    cur, cur_iter, last = 2.0 ** 6, 0, -1
    for overflow in flags:
        if overflow:
            cur, last = max(cur / 4.0, 1), cur_iter
        elif (cur_iter - last) % 3 == 0:
            cur *= 4.0
        cur_iter += 1
        ours.update_scale(overflow)
        assert ours.loss_scale == ours.cur_scale == cur
    assert ours.cur_iter == len(flags) and ours.last_overflow_iter == len(flags) - 1 and ours.loss_scale == 1.0
    assert fp16_utils.DynamicLossScaler().loss_scale == 2.0 ** 32
    with pytest.raises(ValueError, match="growth_factor must be a number above 1"):
        fp16_utils.DynamicLossScaler(scale_factor=1.0)
    w = nn.Parameter(torch.ones(3))
    ours.backward((w * 2).sum())
    assert torch.equal(w.grad, torch.full((3,), 2.0)) and not ours.has_overflow([w])
    w.grad[1] = float("nan")
    assert ours.has_overflow([w]) and fp16_utils.DynamicLossScaler._has_inf_or_nan(w.grad)
    static = fp16_utils.LossScaler(128)
    static.update_scale(True)
    assert static.loss_scale == 128 and not static.has_overflow([w])
    assert static.scale_gradient(None, (torch.ones(2),), None)[0].tolist() == [128.0, 128.0]


def test_the_model_helpers() -> None:
    """Apex's tests/L0/run_fp16util, and `FP16_Module`: affine batch norms stay FP32."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.BatchNorm2d(3), nn.Conv2d(3, 4, 2), nn.BatchNorm2d(4, affine=False), nn.GRU(5, 5))
    fp16_utils.FP16Model(net)
    assert net[0].weight.dtype == F32 and net[1].weight.dtype == F16 and net[2].running_mean.dtype == F16
    assert net[3].weight_hh_l0.dtype == F16
    conv = fp16_utils.FP16Model(nn.Sequential(nn.BatchNorm2d(3), nn.Conv2d(3, 4, 2)))
    assert conv(torch.randn(2, 3, 6, 6)).dtype == F16
    wrapped = fp16_utils.FP16_Module(nn.Linear(3, 2))
    out = wrapped(torch.randn(4, 3))
    assert wrapped.module.weight.dtype == F16 and out.dtype == F32
    assert fp16_utils.fp32_to_fp16([torch.ones(1), (torch.ones(1, dtype=torch.int64),)])[1][0].dtype == torch.int64
    assert fp16_utils.fp16_to_fp32((torch.ones(1, dtype=F16),))[0].dtype == F32
    assert fp16_utils.BN_convert_float(nn.BatchNorm1d(2, affine=False).half()).running_mean.dtype == F16
    with pytest.raises(NotImplementedError, match="weight_norm"):
        fp16_utils.Fused_Weight_Norm()


# ------------------------------------------------------------------ scripts, through the alias
CONVNETS = textwrap.dedent('''
    """NVIDIA's ConvNets `--fp16` path (2019), in miniature: network_to_half, FP16_Optimizer,
    a batch-size multiplier applied to the master grads, checkpoints."""
    import argparse
    import torch
    import torch.nn as nn
    from apex.fp16_utils import *
    from apex import amp

    parser = argparse.ArgumentParser()
    parser.add_argument("--static-loss-scale", type=float, default=1)
    parser.add_argument("--dynamic-loss-scale", action="store_true")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--stop-at", type=int, default=None)
    parser.add_argument("--checkpoint", default="checkpoint.pth.tar")
    parser.add_argument("--out", default="final.pt")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(8, 5))
    model = network_to_half(model)
    optimizer = torch.optim.SGD(model.parameters(), 0.1, momentum=0.9, weight_decay=1e-4)
    optimizer = FP16_Optimizer(optimizer, static_loss_scale=args.static_loss_scale,
                               dynamic_loss_scale=args.dynamic_loss_scale, verbose=False)
    start = 0
    if args.resume:
        checkpoint = torch.load(args.resume)
        start = checkpoint["step"]
        model.load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer"])
    criterion = nn.CrossEntropyLoss()
    batch_size_multiplier = 2
    for step in range(start, args.stop_at or args.steps):
        for param_group in optimizer.param_groups:
            param_group["lr"] = 0.1 * (step + 1) / args.steps
        for micro in range(batch_size_multiplier):
            g = torch.Generator().manual_seed(1000 * step + micro)
            input, target = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g)
            loss = criterion(model(input).float(), target)
            optimizer.backward(loss)
        opt = optimizer.optimizer if isinstance(optimizer, FP16_Optimizer) else optimizer
        for param_group in opt.param_groups:
            for param in param_group["params"]:
                param.grad /= batch_size_multiplier
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step} loss {to_python_float(loss):.4f} scale {optimizer.loss_scale:g}")
        if step + 1 == args.stop_at:
            torch.save({"step": step + 1, "state_dict": model.state_dict(), "optimizer": optimizer.state_dict()},
                       args.checkpoint)
    torch.save([p.detach() for p in model.parameters()], args.out)
''')

BERT_SQUAD_OLD = textwrap.dedent('''
    """NVIDIA's BERT run_squad.py `--fp16 --old` (2019), in miniature."""
    import sys
    import torch
    import torch.nn as nn
    from apex import amp
    from apex.optimizers import FusedAdam
    from apex.optimizers import FP16_Optimizer

    def warmup_linear(x, warmup=0.002):
        return x / warmup if x < warmup else 1.0 - x

    loss_scale = float(sys.argv[1])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 16), nn.LayerNorm(16), nn.Linear(16, 2))
    model.half()
    param_optimizer = list(model.named_parameters())
    no_decay = ["bias", "LayerNorm.bias", "LayerNorm.weight", "1.weight"]
    optimizer_grouped_parameters = [
        {"params": [p for n, p in param_optimizer if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in param_optimizer if any(nd in n for nd in no_decay)], "weight_decay": 0.0}]
    optimizer = FusedAdam(optimizer_grouped_parameters, lr=5e-3, bias_correction=False, max_grad_norm=1.0)
    if loss_scale == 0:
        optimizer = FP16_Optimizer(optimizer, dynamic_loss_scale=True)
    else:
        optimizer = FP16_Optimizer(optimizer, static_loss_scale=loss_scale)
    g = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, 50, (64, 8), generator=g), torch.randint(0, 2, (64, 8), generator=g)
    gradient_accumulation_steps, num_steps, global_step, losses = 2, 40, 0, []
    for step in range(num_steps * gradient_accumulation_steps):
        batch = slice((step % 8) * 8, (step % 8) * 8 + 8)
        logits = model(ids[batch]).float()
        loss = nn.functional.cross_entropy(logits.view(-1, 2), labels[batch].view(-1))
        losses.append(loss.item())
        loss = loss / gradient_accumulation_steps
        optimizer.backward(loss)
        if (step + 1) % gradient_accumulation_steps == 0:
            lr_this_step = 5e-3 * warmup_linear(global_step / num_steps, 0.1)
            for param_group in optimizer.param_groups:
                param_group["lr"] = lr_this_step
            optimizer.step()
            optimizer.zero_grad()
            global_step += 1
    first, last = sum(losses[:8]) / 8, sum(losses[-8:]) / 8
    print(f"loss {first:.3f} -> {last:.3f}, scale {optimizer.cur_scale:g}")
    assert last < first, (first, last)
''')


@pytest.fixture
def _run(capfd: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch):
    """``ampatch run --apex-alias -- python SCRIPT ARGS`` from ``cwd``, the command through `cli.main`
    in this process (tests/_cli.py: one interpreter start less; the script is a child process, as
    from the command): what it printed, once it succeeded."""
    def run(script: Path, *args: str, cwd: Path) -> str:
        proc = ampatch_main(capfd, monkeypatch, "run", "--apex-alias", "--", sys.executable, str(script), *args,
                            cwd=cwd)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out
        return out
    return run


def test_a_convnets_style_script_resumes_bit_for_bit(tmp_path: Path, _run) -> None:
    scale = ["--dynamic-loss-scale"]
    script = tmp_path / "main.py"
    script.write_text(CONVNETS)
    _run(script, *scale, "--out", "straight.pt", cwd=tmp_path)
    _run(script, *scale, "--stop-at", "2", "--out", "first.pt", cwd=tmp_path)
    out = _run(script, *scale, "--resume", "checkpoint.pth.tar", "--out", "resumed.pt", cwd=tmp_path)
    assert "step 3 loss" in out and "step 1 loss" not in out
    straight, resumed = torch.load(tmp_path / "straight.pt"), torch.load(tmp_path / "resumed.pt")
    assert [p.dtype for p in straight].count(F16) == 4
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed))
    assert not all(torch.equal(a, b) for a, b in zip(straight, torch.load(tmp_path / "first.pt")))


@pytest.mark.parametrize("loss_scale", ["0", "128"], ids=["dynamic", "static"])
def test_a_bert_squad_old_style_script_trains(tmp_path: Path, loss_scale: str, _run) -> None:
    script = tmp_path / "run_squad.py"
    script.write_text(BERT_SQUAD_OLD)
    out = _run(script, loss_scale, cwd=tmp_path)
    assert "loss" in out and "Traceback" not in out
