"""The rest of Apex under the alias: one test per adapter. Each is PyTorch's
implementation with Apex's names, keyword arguments and defaults; what PyTorch cannot honestly
provide raises an error naming the alternative."""
from __future__ import annotations

import copy
import logging
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampatch as amp
from ampatch.compat import fp16_utils, multi_tensor_apply, normalization, optimizers, parallel
from ampatch.compat.parallel import LARC as larc

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
HALVES = pytest.mark.parametrize("half", [F16, BF16], ids=["fp16", "bf16"])


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


# ------------------------------------------------------------------ apex.optimizers
# (the Fused* optimizers' math: tests/compat/test_apex_optimizers.py; FP16_Optimizer:
# tests/compat/test_apex_fp16_utils.py)


# ------------------------------------------------------------------ apex.parallel
def test_larc_scales_each_gradient_by_its_trust_ratio() -> None:
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(4, 4))
    w.grad = torch.randn(4, 4)
    ref = w.detach().clone()
    inner = torch.optim.SGD([w], lr=0.1, weight_decay=0.01)
    opt = larc.LARC(inner, trust_coefficient=0.02, clip=True)
    assert isinstance(opt, torch.optim.Optimizer) and opt.param_groups is inner.param_groups
    g = w.grad.clone()
    rate = 0.02 * ref.norm() / (g.norm() + ref.norm() * 0.01 + 1e-8)
    rate = min(rate / 0.1, 1.0)
    opt.step()
    torch.testing.assert_close(w.detach(), ref - 0.1 * (g + 0.01 * ref) * rate)
    assert inner.param_groups[0]["weight_decay"] == 0.01  # given back after the step
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.step()
    scheduler.step()
    assert inner.param_groups[0]["lr"] == 0.05


@HALVES
def test_larc_through_amp_initialize(half) -> None:
    model = _net()
    opt = larc.LARC(torch.optim.SGD(model.parameters(), lr=0.25, momentum=0.125))
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=half, verbosity=0)
    amp._amp_state.loss_scalers[0]._loss_scale = 128.0  # 2**16 would overflow float16 grads at the first step
    before = model[0].weight.detach().clone()
    opt.zero_grad()
    with amp.scale_loss(model(torch.randn(5, 6)).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert not torch.equal(before, model[0].weight)
    assert {p.dtype for p in amp.master_params(opt)} == {F32}


def test_sync_batch_norm_and_convert_syncbn_model() -> None:
    model = nn.Sequential(nn.Conv2d(2, 4, 1), nn.BatchNorm2d(4), nn.Sequential(nn.BatchNorm2d(4, affine=False)))
    weight, running_mean = model[1].weight, model[1].running_mean
    converted = parallel.convert_syncbn_model(model)
    bns = [m for m in converted.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert len(bns) == 2 and all(isinstance(m, parallel.SyncBatchNorm) for m in bns)
    assert isinstance(bns[0], nn.SyncBatchNorm)
    assert bns[0].weight is weight and bns[0].running_mean is running_mean  # shared, as torch's convert does
    x = torch.randn(3, 2, 5, 5)
    torch.testing.assert_close(converted(x), model[2](F.batch_norm(
        model[0](x), torch.zeros(4), torch.ones(4), weight, model[1].bias, training=True)))
    relu_bn = parallel.SyncBatchNorm(4, fuse_relu=True)
    assert (relu_bn(torch.randn(3, 4, 2)) >= 0).all()
    with pytest.raises(NotImplementedError, match="channels_last"):
        parallel.SyncBatchNorm(4, channel_last=True)


@pytest.mark.distributed
def test_ddp_and_cpu_sync_batch_norm_in_a_process_group(tmp_path) -> None:
    """Apex's DDP keywords on torch's DDP; the CPU SyncBatchNorm path against F.batch_norm
    (one rank: the all-reduce is the identity). In a subprocess that leaves with os._exit,
    as gloo may abort at interpreter teardown."""
    code = textwrap.dedent(f'''
        import logging, os, sys, torch, torch.distributed as dist, torch.nn.functional as F
        from torch import nn
        from ampatch.compat import parallel
        logging.basicConfig(level=logging.INFO, stream=sys.stdout)
        dist.init_process_group("gloo", init_method="file://{tmp_path}/rdzv", rank=0, world_size=1)
        model = nn.Sequential(nn.Linear(4, 4), parallel.SyncBatchNorm(4))
        ddp = parallel.DistributedDataParallel(model, delay_allreduce=True, num_allreduce_streams=2,
                                               message_size=2 ** 20, gradient_predivide_factor=2.0)
        assert isinstance(ddp, nn.parallel.DistributedDataParallel) and ddp.module is model
        ddp(torch.randn(3, 4)).sum().backward()
        ddp.disable_allreduce(); assert not ddp.require_backward_grad_sync
        ddp.enable_allreduce(); assert ddp.require_backward_grad_sync
        try:
            parallel.DistributedDataParallel(nn.Linear(2, 2), shared_param=True)
        except ValueError as e:
            print("refused:", e)
        parallel.DistributedDataParallel(nn.Linear(2, 2), delay_allreduce=True, num_allreduce_streams=2)
        bn, ref = parallel.SyncBatchNorm(3, momentum=0.3), nn.BatchNorm2d(3, momentum=0.3)
        x = torch.randn(4, 3, 5, 5, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        out, want = bn._cpu_forward(x), ref(x2)
        torch.testing.assert_close(out, want)
        out.pow(2).sum().backward(); want.pow(2).sum().backward()
        torch.testing.assert_close(x.grad, x2.grad)
        torch.testing.assert_close(bn.weight.grad, ref.weight.grad)
        torch.testing.assert_close(bn.running_mean, ref.running_mean)
        torch.testing.assert_close(bn.running_var, ref.running_var)
        print("ALL OK")
        sys.stdout.flush()
        dist.destroy_process_group()
        os._exit(0)
    ''')
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "ALL OK" in proc.stdout, proc.stdout + proc.stderr
    assert proc.stdout.count("refused:") == 1
    assert "delay_allreduce=True" in proc.stdout and "num_allreduce_streams=2" in proc.stdout  # one log line
    assert proc.stdout.count("have no meaning") == 1  # once, though two DDPs were given the same keywords


# ------------------------------------------------------------------ apex.normalization
def test_fused_layer_norm_and_rms_norm_are_torch_modules() -> None:
    x = torch.randn(3, 4, 8)
    ln = normalization.FusedLayerNorm(8)
    assert isinstance(ln, nn.LayerNorm) and ln.eps == 1e-5 and ln.memory_efficient is False
    torch.testing.assert_close(ln(x), F.layer_norm(x, (8,), ln.weight, ln.bias, 1e-5))
    plain = normalization.FusedLayerNorm([4, 8], elementwise_affine=False, memory_efficient=True)
    assert plain.weight is None and plain.memory_efficient
    torch.testing.assert_close(plain(x), F.layer_norm(x, (4, 8), eps=1e-5))
    rms = normalization.FusedRMSNorm(8)
    assert isinstance(rms, nn.RMSNorm) and rms.eps == 1e-5  # Apex's default, not torch's
    torch.testing.assert_close(rms(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))


@HALVES
def test_mixed_fused_norms_keep_fp32_weights_and_the_input_dtype(half) -> None:
    x = torch.randn(3, 8).to(half)
    for cls, ref in ((normalization.MixedFusedLayerNorm, nn.LayerNorm), (normalization.MixedFusedRMSNorm, nn.RMSNorm)):
        norm = cls(8)
        assert norm.weight.dtype == F32
        out = norm(x)
        assert out.dtype == half
        torch.testing.assert_close(out.float(), ref(8, eps=1e-5)(x.float()), rtol=1e-2, atol=1e-2)
        with pytest.raises(ValueError, match="elementwise_affine"):
            cls(8, elementwise_affine=False)


@HALVES
def test_fused_layer_norm_under_o2_and_o1(half) -> None:
    model = nn.Sequential(nn.Linear(8, 8), normalization.FusedLayerNorm(8))
    amp.initialize(model, opt_level="O2", half_dtype=half, verbosity=0)
    assert model[1].weight.dtype == half and model(torch.randn(2, 8)).dtype == F32
    model = nn.Sequential(nn.Linear(8, 8), normalization.FusedLayerNorm(8))
    amp.initialize(model, opt_level="O1", half_dtype=half, verbosity=0)
    assert model(torch.randn(2, 8)).dtype == F32  # layer norm runs in FP32 under O1


# ------------------------------------------------------------------ apex.fp16_utils
def test_fp16_utils_helpers() -> None:
    assert fp16_utils.to_python_float(torch.tensor(2.5)) == 2.5 and fp16_utils.to_python_float([1.5]) == 1.5
    net = _net()
    half_net = fp16_utils.network_to_half(copy.deepcopy(net))
    assert isinstance(half_net[0], fp16_utils.tofp16)
    dtypes = {type(m).__name__: m.weight.dtype for m in half_net[1] if hasattr(m, "weight")}
    assert dtypes == {"Linear": F16, "BatchNorm1d": F32}
    assert half_net(torch.randn(5, 6)).dtype == F16
    converted = fp16_utils.convert_network(copy.deepcopy(net), BF16)
    assert converted[0].weight.dtype == BF16 and converted[1].weight.dtype == F32

    model = fp16_utils.network_to_half(_net())[1]
    model_params, masters = fp16_utils.prep_param_lists(model)
    assert [m.dtype for m in masters] == [F32] * len(model_params) and all(m.requires_grad for m in masters)
    model(torch.randn(5, 6).half()).float().sum().backward()
    fp16_utils.model_grads_to_master_grads(model_params, masters)
    for p, m in zip(model_params, masters):
        assert torch.equal(m.grad, p.grad.float())
    with torch.no_grad():
        for m in masters:
            m.sub_(0.5)
    fp16_utils.master_params_to_model_params(model_params, masters)
    for p, m in zip(model_params, masters):
        assert torch.equal(p, m.to(p.dtype))

    flat_model = nn.Linear(3, 2).half()
    params, flat = fp16_utils.prep_param_lists(flat_model, flat_master=True)
    assert len(flat) == 1 and flat[0].numel() == 8 and flat[0].dtype == F32
    flat_model(torch.randn(4, 3).half()).float().sum().backward()
    fp16_utils.model_grads_to_master_grads(params, flat, flat_master=True)
    assert torch.equal(flat[0].grad[:6].view(2, 3), flat_model.weight.grad.float())
    with torch.no_grad():
        flat[0].fill_(0.25)
    fp16_utils.master_params_to_model_params(params, flat, flat_master=True)
    assert (flat_model.weight == 0.25).all() and (flat_model.bias == 0.25).all()
    with pytest.raises(TypeError, match="flat_master=False"):
        fp16_utils.prep_param_lists(model, flat_master=True)  # FP32 batch norm next to half linears
    star: dict = {}
    exec("from ampatch.compat.fp16_utils import *", star)
    assert {"to_python_float", "network_to_half", "prep_param_lists", "FP16_Optimizer"} <= set(star)


# ------------------------------------------------------------------ apex.multi_tensor_apply
def test_multi_tensor_applier_calls_the_op_as_apex_did() -> None:
    """`applier(op, flag, lists, *args)` is `op(chunk_size, flag, lists, *args)`; the kernels are
    tested in tests/compat/test_apex_kernels.py."""
    applier = multi_tensor_apply.MultiTensorApply(333)
    assert applier.available is True and applier.chunk_size == 333
    applier.check_avail()
    calls = []
    assert applier(lambda *a: calls.append(a) or "out", "flag", [["t"]], 1.0, "x") == "out"
    assert calls == [(333, "flag", [["t"]], 1.0, "x")]


def test_adapters_log_what_they_ignore(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="ampatch"):
        optimizers.FusedSGD(_net().parameters(), lr=0.1, materialize_master_grads=False)
    assert "materialize_master_grads=False" in caplog.text
