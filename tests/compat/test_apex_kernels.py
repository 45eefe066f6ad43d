"""`amp_C` and `apex_C` under the alias: Apex's compiled kernels on foreach
ops, called as Apex's callers call them (`multi_tensor_applier(op, noop_flag, lists, *args)`),
against the results written out here: the flag buffer set on inf/NaN, skipped work where Apex's
kernel returned early, per-tensor norms, and the loss-scale update with hysteresis."""
from __future__ import annotations

import importlib.util
import math
import sys

import pytest
import torch

from ampatch import compat
from ampatch.compat.extensions import amp_C as amp_c
from ampatch.compat.extensions import apex_C as apex_c
from ampatch.compat.extensions import kernels
from ampatch.compat.multi_tensor_apply import MultiTensorApply
from ampatch.compat.multi_tensor_apply import multi_tensor_applier as applier

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _flag(value: int = 0) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int)


def test_the_modules_import_under_the_alias_only(apex_alias) -> None:
    import amp_C
    import apex_C
    from amp_C import multi_tensor_l2norm
    from apex.extensions import amp_C as amp_C2
    from apex.multi_tensor_apply import multi_tensor_applier

    assert amp_C is amp_c and apex_C is apex_c and amp_C2 is amp_c and multi_tensor_l2norm is amp_c.multi_tensor_l2norm
    assert multi_tensor_applier.available is True
    assert importlib.util.find_spec("amp_C") is not None and importlib.util.find_spec("apex_C") is not None
    compat.uninstall_apex_alias()
    assert "amp_C" not in sys.modules and "apex_C" not in sys.modules
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("amp_C")


def test_apex_calling_convention() -> None:
    seen = []
    out = MultiTensorApply(333)(lambda *args: seen.append(args) or "result", "flag", [["t"]], 2.0)
    assert out == "result" and seen == [(333, "flag", [["t"]], 2.0)]


# ------------------------------------------------------------------ scale, axpby
@pytest.mark.parametrize("in_dtype, out_dtype", [(F32, F32), (F32, F16), (F16, F32), (BF16, F32), (F32, BF16)])
def test_scale_writes_in_times_scale_and_flags_non_finite_inputs(in_dtype, out_dtype) -> None:
    ins = [torch.full((5,), 4.0, dtype=in_dtype), torch.full((333,), 8.0, dtype=in_dtype)]
    outs = [torch.zeros(5, dtype=out_dtype), torch.zeros(333, dtype=out_dtype)]
    flag = _flag()
    applier(amp_c.multi_tensor_scale, flag, [ins, outs], 0.25)
    assert flag.item() == 0 and (outs[0] == 1).all() and (outs[1] == 2).all()
    assert outs[0].dtype == out_dtype and (ins[0] == 4).all()  # the input is left as it was
    for bad in (float("nan"), float("inf"), -float("inf")):
        ins[1][100] = bad
        flag.zero_()
        applier(amp_c.multi_tensor_scale, flag, [ins, outs], 0.25)
        assert flag.item() == 1
        assert not math.isfinite(outs[1][100].item()) and outs[1][0].item() == 2  # still written, as in Apex
        ins[1][100] = 8.0


def test_scale_in_place_and_a_set_flag_stays_set() -> None:
    grads = [torch.full((4,), 6.0)]
    flag = _flag(1)
    applier(amp_c.multi_tensor_scale, flag, [grads, grads], 0.5)
    assert (grads[0] == 3).all() and flag.item() == 1  # Apex's scale kernel does not skip on the flag


@pytest.mark.parametrize("arg_to_check, flagged", [(-1, True), (0, False), (1, True), (2, False)])
def test_axpby_checks_the_argument_it_is_told_to(arg_to_check, flagged) -> None:
    xs, ys = [torch.full((3,), 2.0)], [torch.tensor([1.0, 1.0, float("inf")], dtype=F16)]
    outs = [torch.zeros(3)]
    flag = _flag()
    applier(amp_c.multi_tensor_axpby, flag, [xs, ys, outs], 3.0, 0.5, arg_to_check)
    assert bool(flag.item()) is flagged
    assert outs[0][:2].tolist() == [6.5, 6.5] and outs[0][2].item() == float("inf")


# ------------------------------------------------------------------ norms
def test_l2norm_total_and_per_tensor() -> None:
    xs = [torch.full((7777,), 4.0, dtype=F16), torch.full((555,), 4.0), torch.zeros(0), torch.arange(5.0)]
    flag = _flag()
    total, per = applier(amp_c.multi_tensor_l2norm, flag, [xs], True)
    want = [4.0 * math.sqrt(7777), 4.0 * math.sqrt(555), 0.0, math.sqrt(30.0)]
    assert total.shape == (1,) and total.dtype == F32 and per.shape == (4,) and per.dtype == F32
    torch.testing.assert_close(per, torch.tensor(want))
    torch.testing.assert_close(total, torch.tensor([math.sqrt(sum(w * w for w in want))]))
    _, empty = applier(amp_c.multi_tensor_l2norm, flag, [xs], False)
    _, default = applier(amp_c.multi_tensor_l2norm, flag, [xs])
    assert empty.numel() == 0 and default.numel() == 0 and flag.item() == 0
    xs[1][3] = float("nan")
    total, _ = applier(amp_c.multi_tensor_l2norm, flag, [xs])
    assert flag.item() == 1 and math.isnan(total.item())


def test_the_mixed_precision_norm_skips_when_the_flag_is_set() -> None:
    xs = [torch.full((4,), 3.0)]
    total, per = applier(amp_c.multi_tensor_l2norm_mp, _flag(), [xs], True)
    assert total.item() == 6.0 and per.tolist() == [6.0]
    total, per = applier(amp_c.multi_tensor_l2norm_mp, _flag(1), [xs], True)
    assert total.item() == 0.0 and per.tolist() == [0.0]  # skipped (Apex left them unwritten)
    assert applier(amp_c.multi_tensor_l2norm, _flag(1), [xs])[0].item() == 6.0  # the plain one does not skip


def test_l2norm_scale_and_unscale_l2norm() -> None:
    ins, outs = [torch.full((4,), 2.0, dtype=F16), torch.full((9,), 1.0)], [torch.zeros(4), torch.zeros(9)]
    flag = _flag()
    total, per = applier(amp_c.multi_tensor_l2norm_scale, flag, [ins, outs], 0.5, True)
    assert per.tolist() == [4.0, 3.0] and total.item() == 5.0  # the norms of the inputs
    assert outs[0].tolist() == [1.0] * 4 and outs[1].tolist() == [0.5] * 9
    total, per = applier(amp_c.multi_tensor_unscale_l2norm, flag, [ins], torch.tensor([0.5]), True)
    assert per.tolist() == [2.0, 1.5] and total.item() == 2.5  # of in * inv_scale; `ins` untouched
    assert ins[0].tolist() == [2.0] * 4 and flag.item() == 0


# ------------------------------------------------------------------ optimizer kernels
def test_sgd_kernel_skips_when_flagged_and_writes_the_model_copy() -> None:
    g, w, mom, w16 = [torch.full((3,), 2.0)], [torch.ones(3)], [torch.zeros(3)], [torch.zeros(3, dtype=F16)]
    applier(amp_c.multi_tensor_sgd, _flag(1), [g, w, mom], 0.0, 0.9, 0.0, 0.1, False, True, False, 1.0)
    assert w[0].tolist() == [1.0] * 3  # an overflowed step: nothing happens
    applier(amp_c.multi_tensor_sgd, _flag(), [g, w, mom, w16], 0.0, 0.9, 0.0, 0.1, False, True, False, 0.5)
    # grads * 0.5 = 1; the first run's momentum is the gradient; w = 1 - 0.1 * 1
    assert mom[0].tolist() == [1.0] * 3 and torch.allclose(w[0], torch.full((3,), 0.9))
    assert w16[0].dtype == F16 and torch.allclose(w16[0].float(), torch.full((3,), 0.9), atol=1e-3)
    applier(amp_c.multi_tensor_sgd, _flag(), [g, w, mom], 0.1, 0.9, 0.0, 0.1, False, False, True, 1.0)
    # momentum: 0.9 * 1 + 2 = 2.9; weight decay after momentum: d = 2.9 + 0.1 * 0.9
    torch.testing.assert_close(mom[0], torch.full((3,), 2.9))
    torch.testing.assert_close(w[0], torch.full((3,), 0.9 - 0.1 * (2.9 + 0.09)))


def test_sgd_kernel_rounds_the_step_of_a_half_weight_to_half_before_adding_it() -> None:
    """Apex's `weight += -lr * d` on an FP16 weight converts the step to FP16 first (c10's
    Half += Half), so two roundings, not one (Apex's FusedSGD test_half matches torch's SGD
    bit for bit only this way)."""
    torch.manual_seed(0)
    g, w = [torch.rand(4096).half()], [(torch.rand(4096) * 4).half()]
    want = (w[0].float() + (-0.3 * g[0].float()).half().float()).half()
    once = (w[0].float() - 0.3 * g[0].float()).half()
    assert not torch.equal(want, once)  # the case tells the two apart
    applier(amp_c.multi_tensor_sgd, _flag(), [g, w, [torch.zeros(4096, dtype=F16)]], 0.0, 0.0, 0.0, 0.3, False,
            True, False, 1.0)
    assert torch.equal(w[0], want)


def test_l2norm_is_the_correctly_rounded_norm_as_apex_returns_it() -> None:
    """Apex's kernel (FP32 fused multiply-adds per lane, then pairwise trees) lands on the
    correctly rounded norm; an FP32 running sum on CPU is off by ulps, biased low."""
    torch.manual_seed(1)
    xs = [torch.rand(65536 * 3 + 5), torch.rand(65536)]
    want = [x.double().square().sum().sqrt().float() for x in xs]
    total, per = applier(amp_c.multi_tensor_l2norm, _flag(), [xs], True)
    assert per.tolist() == [w.item() for w in want]
    exact = math.sqrt(sum(float(x.double().square().sum()) for x in xs))
    assert abs(total.item() / exact - 1) < 1.2e-7  # within an ulp


def test_lamb_trust_ratio_is_lr_times_the_norm_ratio_in_apex_order() -> None:
    """Stage 2 takes `lr * (|p| / |u|)` in FP32, in that order (3/7 and 10/3 round differently
    from `(lr * |p|) / |u|`)."""
    for pn, un in ((3.0, 7.0), (10.0, 3.0)):
        p, u = [torch.full((4,), 1e-3)], [torch.ones(4)]  # p small enough to show an ulp of the step
        ratio = torch.tensor(5e-4) * (torch.tensor(pn) / torch.tensor(un))
        assert ratio != torch.tensor(5e-4) * torch.tensor(pn) / torch.tensor(un)
        applier(amp_c.multi_tensor_lamb_stage2_cuda, _flag(), [p, u], torch.tensor([pn]), torch.tensor([un]), 5e-4,
                0.01)
        assert torch.equal(p[0], torch.full((4,), 1e-3) - ratio)


@pytest.mark.parametrize("mode, bias_correction", [(0, 1), (1, 1), (1, 0)])
def test_adam_kernel_against_the_formula(mode, bias_correction) -> None:
    torch.manual_seed(0)
    p, m, v = torch.randn(6), torch.zeros(6), torch.zeros(6)
    ref_p, ref_m, ref_v = p.double(), m.double(), v.double()
    lr, b1, b2, eps, wd = 0.01, 0.8, 0.95, 1e-6, 0.1
    for step in range(1, 4):
        g = torch.randn(6)
        applier(amp_c.multi_tensor_adam, _flag(), [[g], [p], [m], [v]], lr, b1, b2, eps, step, mode, bias_correction,
                wd)
        gg = g.double() + (wd * ref_p if mode == 0 else 0)
        ref_m = b1 * ref_m + (1 - b1) * gg
        ref_v = b2 * ref_v + (1 - b2) * gg * gg
        bc1, bc2 = (1 - b1 ** step, 1 - b2 ** step) if bias_correction else (1.0, 1.0)
        update = (ref_m / bc1) / ((ref_v / bc2).sqrt() + eps) + (wd * ref_p if mode == 1 else 0)
        ref_p = ref_p - lr * update
        torch.testing.assert_close(p, ref_p.float(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(v, ref_v.float(), rtol=1e-5, atol=1e-7)


def test_capturable_adam_skips_when_flagged_and_leaves_unscaled_grads() -> None:
    g, p, m, v = [torch.full((2,), 8.0)], [torch.ones(2)], [torch.zeros(2)], [torch.zeros(2)]
    args = (torch.tensor(0.1), 0.9, 0.999, 1e-8, torch.tensor([1], dtype=torch.int), 1, 1, 0.0, torch.tensor([0.25]))
    applier(amp_c.multi_tensor_adam_capturable, _flag(1), [g, p, m, v], *args)
    assert g[0].tolist() == [8.0, 8.0] and p[0].tolist() == [1.0, 1.0]
    applier(amp_c.multi_tensor_adam_capturable, _flag(), [g, p, m, v], *args)
    assert g[0].tolist() == [2.0, 2.0]  # unscaled in place
    torch.testing.assert_close(p[0], torch.full((2,), 0.9))  # the first bias-corrected step is lr * sign(g)
    half, master = [torch.ones(2, dtype=F16)], [torch.ones(2)]
    applier(amp_c.multi_tensor_adam_capturable_master, _flag(), [[torch.full((2,), 8.0, dtype=F16)], half,
                                                                 [torch.zeros(2)], [torch.zeros(2)], master], *args)
    torch.testing.assert_close(master[0], torch.full((2,), 0.9))
    assert half[0].dtype == F16 and torch.equal(half[0], master[0].half())


def test_lamb_kernel_leaves_its_update_in_the_grads_and_flags_a_non_finite_param() -> None:
    g, p, m, v = [torch.full((4,), 2.0)], [torch.full((4,), 3.0)], [torch.zeros(4)], [torch.zeros(4)]
    flag = _flag()
    applier(amp_c.multi_tensor_lamb, flag, [g, p, m, v], 0.1, 0.9, 0.999, 1e-6, 1, 1, 0.0, 1, 1,
            torch.tensor([4.0]), 1.0, False)
    # clipped by |G| / max = 4: g' = 0.5; the first bias-corrected update is 1 (up to eps); no decay: no trust ratio
    torch.testing.assert_close(g[0], torch.ones(4), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(p[0], torch.full((4,), 2.9), rtol=1e-5, atol=1e-5)
    assert flag.item() == 0
    p[0][0] = float("inf")
    applier(amp_c.multi_tensor_lamb, flag, [g, p, m, v], 0.1, 0.9, 0.999, 1e-6, 2, 1, 0.0, 1, 1,
            torch.tensor([1.0]), 1.0, False)
    assert flag.item() == 1


def test_novograd_kernel_blends_per_tensor_norms() -> None:
    g, p, m = [torch.full((4,), 3.0)], [torch.ones(4)], [torch.zeros(4)]
    norms = torch.tensor([2.0])
    applier(amp_c.multi_tensor_novograd, _flag(), [g, p, m], norms, 0.1, 0.9, 0.5, 0.0, 1, 0, 0.0, 1, 1, 2)
    assert math.isclose(norms.item(), math.sqrt(0.5 * 4 + 0.5 * 36), rel_tol=1e-6)  # |g| = 6
    norms_inf = torch.tensor([2.0])
    applier(amp_c.multi_tensor_novograd, _flag(), [g, [torch.ones(4)], [torch.zeros(4)]], norms_inf, 0.1, 0.9, 0.5,
            0.0, 1, 0, 0.0, 1, 1, 0)
    assert math.isclose(norms_inf.item(), 0.5 * 2 + 0.5 * 3)  # max norm: b2 * n + (1 - b2) * max|g|
    # decoupled mode, no bias correction: m = 0.1 * 3; p = 1 - 0.1 * m / n
    torch.testing.assert_close(p[0], torch.full((4,), 1 - 0.1 * 0.3 / norms.item()))


# ------------------------------------------------------------------ the loss scale
def test_update_scale_hysteresis() -> None:
    scale, growth, hyst = torch.tensor([1024.0]), torch.tensor([0], dtype=torch.int), torch.tensor([2], dtype=torch.int)
    inf, clean = torch.tensor([1.0]), torch.tensor([0.0])
    call = lambda found: amp_c.update_scale_hysteresis(scale, growth, hyst, found, 2.0, 0.5, 3, 2)  # noqa: E731
    assert call(inf) is scale and scale.item() == 1024 and hyst.item() == 1  # hysteresis absorbs the first
    call(inf)
    assert scale.item() == 512 and hyst.item() == 0 and growth.item() == 0
    call(clean), call(clean)
    assert scale.item() == 512 and growth.item() == 2 and hyst.item() == 2  # a clean step refills it
    call(clean)
    assert scale.item() == 1024 and growth.item() == 0  # the third clean step in a row grows it
    scale.fill_(2.0 ** 127)
    call(clean), call(clean), call(clean)
    assert scale.item() == 2.0 ** 127  # never grown to inf
    scale.fill_(2.0 ** -126)  # FP32's smallest normal: backing off gives a denormal, flushed to 0 as in Apex
    hyst.fill_(1)
    call(inf)
    assert scale.item() == 0.0


# ------------------------------------------------------------------ apex_C, the rest
def test_apex_c_flatten_unflatten() -> None:
    tensors = [torch.arange(6.0).view(2, 3), torch.tensor([7.0])]
    flat = apex_c.flatten(tensors)
    assert flat.tolist() == [0, 1, 2, 3, 4, 5, 7]
    back = apex_c.unflatten(flat * 2, tensors)
    assert [t.shape for t in back] == [(2, 3), (1,)] and back[1].item() == 14


def test_kernels_without_an_equivalent_raise_when_called_and_bad_lists_are_refused() -> None:
    from ampatch.compat.extensions.amp_C import multi_tensor_lans  # importable

    with pytest.raises(NotImplementedError, match="amp_C.multi_tensor_lans"):
        multi_tensor_lans(2048, _flag(), [[torch.ones(1)]])
    with pytest.raises(AttributeError, match="provides multi_tensor_scale"):
        amp_c.no_such_kernel  # noqa: B018
    for lists, message in (([[torch.ones(2)]], "depth"), ([[], []], "is not > 0"),
                           ([[torch.ones(2)], []], "Size mismatch among"), ([[torch.ones(2)], [torch.ones(3)]],
                                                                           "Size mismatch")):
        with pytest.raises(RuntimeError, match=message):
            applier(amp_c.multi_tensor_scale, _flag(), lists, 1.0)
    with pytest.raises(RuntimeError, match="depth"):
        kernels.check_lists("k", [[torch.ones(1)]] * 3, (4, 5))
