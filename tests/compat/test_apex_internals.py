"""Apex's loss-scaler and optimizer internals that real scripts touch, each
a view over the live session: GNMT's `_scale_seq_len`; NVIDIA BERT pretraining's gradient
accumulation with its own all-reduce (`_loss_scale`, `loss_scale()`, `_overflow_buf`,
`update_scale()`, `optimizer._amp_stash`, `amp_C.multi_tensor_scale`) and its resume
(`_lazy_init_maybe_master_weights`, `lazy_init_called`, the saved master params)."""
from __future__ import annotations

import copy
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _cli import ampatch_main
from torch import nn

import ampatch as amp
from ampatch.compat import optimizers
from ampatch.compat.extensions import amp_C as amp_c
from ampatch.compat.extensions import apex_C as apex_c

F32, F16 = torch.float32, torch.float16


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def _loss(model: nn.Module, i: int) -> torch.Tensor:
    x, y = _batch(i)
    return nn.functional.mse_loss(model(x).float(), y)


def _o2(model: nn.Module, opt: torch.optim.Optimizer):
    return amp.initialize(model, opt, opt_level="O2", half_dtype=F16, loss_scale="dynamic", verbosity=0)


def _clean_step(model: nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    with amp.scale_loss(_loss(model, i), opt) as scaled:
        scaled.backward()
    opt.step()
    opt.zero_grad()


def test_gnmt_sets_the_growth_interval_and_it_takes_effect() -> None:
    """GNMT's fp_optimizers: `loss_scaler._loss_scale = 8192; loss_scaler._scale_seq_len = 128`."""
    model, opt = _o2(_model(), torch.optim.SGD(_model().parameters(), lr=0.01))
    loss_scaler = amp._amp_state.loss_scalers[0]
    loss_scaler._loss_scale = 8192
    loss_scaler._scale_seq_len = 3
    assert loss_scaler._scale_seq_len == 3 and amp._amp_state.loss_scalers[0] is loss_scaler
    for i in range(6):
        _clean_step(model, opt, i)
        assert amp.loss_scale() == 8192 * 2 ** ((i + 1) // 3)
    with pytest.raises(ValueError, match="positive int"):
        loss_scaler._scale_seq_len = 0
    with pytest.raises(AttributeError, match="cannot be set"):
        loss_scaler._max_loss_scale = 2.0 ** 30


def test_the_amp_stash_is_a_view_of_the_masters() -> None:
    model = _model()
    model, opt = _o2(model, torch.optim.SGD(model.parameters(), lr=0.1))
    stash = opt._amp_stash
    assert stash.all_fp16_params == list(model.parameters())
    assert stash.all_fp32_from_fp16_params == list(amp.master_params(opt))
    assert all(p.dtype == F16 for p in stash.all_fp16_params)
    assert all(m.dtype == F32 for m in stash.all_fp32_from_fp16_params) and stash.all_fp32_from_fp32_params == []
    assert stash.fp16_groups == [stash.all_fp16_params] and stash.lazy_init_called
    stash.lazy_init_called = True  # BERT's resume sets it
    with pytest.raises(AttributeError, match="view"):
        stash.all_fp16_params = []
    with torch.no_grad():
        stash.all_fp32_from_fp16_params[0].fill_(0.5)
    opt._master_params_to_model_params()
    assert (model[0].weight == 0.5).all()
    assert opt._amp_stash.dummy_overflow_buf.dtype == torch.int32
    amp.deinitialize()
    assert not hasattr(opt, "_amp_stash") and not hasattr(opt, "_lazy_init_maybe_master_weights")
    o1_model = _model()
    _, o1_opt = amp.initialize(o1_model, torch.optim.SGD(o1_model.parameters(), lr=0.1), opt_level="O1",
                               half_dtype=F16, verbosity=0)
    assert o1_opt._amp_stash.all_fp32_params == list(o1_model.parameters()) and o1_opt._amp_stash.all_fp16_params == []


def _take_optimizer_step(optimizer, model, overflow_buf, accumulation: int, world_size: int = 1) -> bool:
    """BERT's `take_optimizer_step` with `allreduce_post_accumulation` (the all-reduce of a
    world of one left out): the unscaled master grads are scaled back up and divided into a
    flat buffer, then unscaled into the master grads; the scaler settles the overflow."""
    _amp_state = amp._amp_state
    loss_scale = _amp_state.loss_scalers[0].loss_scale()
    master_grads = [p.grad for p in amp.master_params(optimizer) if p.grad is not None]
    flat_grad_size = sum(p.numel() for p in master_grads)
    flat_raw = torch.empty(flat_grad_size, dtype=torch.float32)
    allreduced_views = apex_c.unflatten(flat_raw, master_grads)
    overflow_buf.zero_()
    amp_c.multi_tensor_scale(65536, overflow_buf, [master_grads, allreduced_views],
                             loss_scale / (world_size * accumulation))
    overflow_buf.zero_()
    amp_c.multi_tensor_scale(65536, overflow_buf, [allreduced_views, master_grads], 1. / loss_scale)
    scaler = _amp_state.loss_scalers[0]
    old_overflow_buf = scaler._overflow_buf
    scaler._overflow_buf = overflow_buf
    had_overflow = scaler.update_scale()
    scaler._overfloat_buf = old_overflow_buf  # (sic: BERT's typo; the attribute is only kept)
    if had_overflow == 0:
        optimizer.step()
    else:
        if _amp_state.opt_properties.master_weights:
            for param in optimizer._amp_stash.all_fp32_from_fp16_params:
                param.grad = None
    for param in model.parameters():
        param.grad = None
    return bool(had_overflow)


def test_bert_accumulation_with_its_own_all_reduce() -> None:
    """BERT pretraining's `allreduce_post_accumulation` path at O2: three micro-batches under
    `scale_loss(delay_overflow_check=True)`, then its own rescale/unscale and `update_scale()`.
    The step applies the mean of the micro-batch gradients, unscaled once; an overflow in any
    micro-batch skips exactly that step (params and state untouched), halves the scale once,
    and the next clean accumulation steps."""
    accumulation, lr = 3, 0.05
    model = _model()
    fp32 = copy.deepcopy(model)
    model, opt = _o2(model, torch.optim.SGD(model.parameters(), lr=lr))
    amp._amp_state.loss_scalers[0]._loss_scale = 2.0 ** 10
    overflow_buf = torch.IntTensor([0])
    hook = {"on": False}
    model[0].weight.register_hook(lambda g: g * float("inf") if hook["on"] else g)

    def accumulate(it: int, poison: int = -1) -> None:
        for micro in range(accumulation):
            hook["on"] = micro == poison
            with amp.scale_loss(_loss(model, 10 * it + micro), opt, delay_overflow_check=True) as scaled:
                scaled.backward()
        hook["on"] = False

    # 1. a clean accumulation: the mean gradient of the FP32 model at the same weights, stepped once
    accumulate(0)
    with torch.no_grad():
        for r, m in zip(fp32.parameters(), amp.master_params(opt)):
            r.copy_(m)
    sum(_loss(fp32, micro) for micro in range(accumulation)).backward()
    masters = [m.detach().clone() for m in amp.master_params(opt)]
    assert _take_optimizer_step(opt, model, overflow_buf, accumulation) is False
    for m, before, r in zip(amp.master_params(opt), masters, fp32.parameters()):
        torch.testing.assert_close(m.detach(), before - lr * r.grad / accumulation, rtol=1e-2, atol=2e-5)
    assert amp.loss_scale() == 2.0 ** 10
    # 2. an overflow in the middle micro-batch: no step, one halving, grads cleared
    masters = [m.detach().clone() for m in amp.master_params(opt)]
    accumulate(1, poison=1)
    assert _take_optimizer_step(opt, model, overflow_buf, accumulation) is True
    assert amp.loss_scale() == 2.0 ** 9 and amp._amp_state.loss_scalers[0]._has_overflow
    assert all(torch.equal(a, b) for a, b in zip(masters, amp.master_params(opt)))
    assert all(m.grad is None for m in amp.master_params(opt))
    # 3. the next clean accumulation steps (the skip was taken by the script, not carried over)
    accumulate(2)
    assert _take_optimizer_step(opt, model, overflow_buf, accumulation) is False
    assert not all(torch.equal(a, b) for a, b in zip(masters, amp.master_params(opt)))
    assert amp.report().skipped_steps == [1] and amp.loss_scale() == 2.0 ** 9


def test_an_overflow_only_the_script_saw_skips_and_halves() -> None:
    """`_overflow_buf` set by the script (an FP16 all-reduce that overflowed) where ampatch's
    unscale was clean: `update_scale()` halves the scale and says skip; a flag ampatch set
    itself (the view's own buffer after an overflowed unscale) is not counted twice."""
    model = _model()
    model, opt = _o2(model, torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = amp._amp_state.loss_scalers[0]
    with amp.scale_loss(_loss(model, 0), opt) as scaled:
        scaled.backward()
    assert scaler._overflow_buf.tolist() == [0] and not scaler._has_overflow
    scaler._overflow_buf.fill_(1)  # a kernel the script ran on ampatch's buffer
    before = [m.detach().clone() for m in amp.master_params(opt)]
    assert scaler.update_scale() is True and amp.loss_scale() == 2.0 ** 15
    opt.step()  # a script that steps anyway: the grads were dropped with the skip
    assert all(torch.equal(a, b) for a, b in zip(before, amp.master_params(opt)))
    scaler.clear_overflow_state()
    assert scaler.update_scale() is False
    scaler._has_overflow = True
    assert scaler.update_scale() is True and amp.loss_scale() == 2.0 ** 14


def test_bert_resume_continues_bit_for_bit() -> None:
    """BERT's resume at O2 with FusedLAMB: the model loaded before `initialize`, the starting
    scale set through `_amp_state`, the optimizer loaded twice around
    `_lazy_init_maybe_master_weights()`, and the saved master params copied in."""
    def train(model: nn.Module, opt, steps: range) -> None:
        for i in steps:
            with amp.scale_loss(_loss(model, i), opt) as scaled:
                scaled.backward()
            opt.step()
            for param in model.parameters():
                param.grad = None

    def prepare(checkpoint: dict | None):
        model = _model(seed=0 if checkpoint is None else 1)
        if checkpoint is not None:
            model.load_state_dict(checkpoint["model"], strict=False)
        opt = optimizers.FusedLAMB(model.parameters(), lr=1e-2)
        model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=F16, loss_scale="dynamic", verbosity=0)
        amp._amp_state.loss_scalers[0]._loss_scale = 2.0 ** 10
        if checkpoint is not None:
            opt.load_state_dict(checkpoint["optimizer"])
            opt._lazy_init_maybe_master_weights()
            opt._amp_stash.lazy_init_called = True
            opt.load_state_dict(checkpoint["optimizer"])
            for param, saved_param in zip(amp.master_params(opt), checkpoint["master params"]):
                param.data.copy_(saved_param.data)
        return model, opt

    model, opt = prepare(None)
    train(model, opt, range(3))
    checkpoint = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict(),
                                "master params": list(amp.master_params(opt))})
    train(model, opt, range(3, 6))
    straight = [p.detach().clone() for p in model.parameters()]
    model, opt = prepare(checkpoint)
    train(model, opt, range(3, 6))
    assert all(torch.equal(a, b) for a, b in zip(straight, model.parameters()))


BERT_PRETRAINING = textwrap.dedent('''
    """NVIDIA BERT run_pretraining.py's fp16 path, in miniature, on one gloo rank: imports as
    written, FusedLAMB, flat_dist_call, allreduce_post_accumulation with its own all-reduce."""
    import os
    import sys
    import torch
    from apex import amp
    from apex.optimizers import FusedLAMB
    from apex.parallel.distributed import flat_dist_call
    import amp_C
    import apex_C
    from apex.amp import _amp_state

    torch.distributed.init_process_group(backend="gloo", init_method="file://" + os.path.abspath("rdzv"),
                                         rank=0, world_size=1)
    get_world_size = torch.distributed.get_world_size
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
    optimizer = FusedLAMB(model.parameters(), lr=1e-2)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", loss_scale="dynamic",
                                      cast_model_outputs=torch.float16)
    init_loss_scale = int(sys.argv[1])
    amp._amp_state.loss_scalers[0]._loss_scale = init_loss_scale
    flat_dist_call([param.data for param in model.parameters()], torch.distributed.broadcast, (0,))
    gradient_accumulation_steps, skipped_steps, global_step = 4, 0, 0
    overflow_buf = torch.IntTensor([0])
    poison = {"on": False}
    model[0].weight.register_hook(lambda g: g * float("inf") if poison["on"] else g)

    def take_optimizer_step(optimizer, model, overflow_buf, global_step):
        global skipped_steps
        loss_scale = _amp_state.loss_scalers[0].loss_scale()
        master_grads = [p.grad for p in amp.master_params(optimizer) if p.grad is not None]
        flat_grad_size = sum(p.numel() for p in master_grads)
        flat_raw = torch.empty(flat_grad_size, device="cpu", dtype=torch.float16)
        allreduced_views = apex_C.unflatten(flat_raw, master_grads)
        overflow_buf.zero_()
        amp_C.multi_tensor_scale(65536, overflow_buf, [master_grads, allreduced_views],
                                 loss_scale / (get_world_size() * gradient_accumulation_steps))
        torch.distributed.all_reduce(flat_raw)
        overflow_buf.zero_()
        amp_C.multi_tensor_scale(65536, overflow_buf, [allreduced_views, master_grads], 1. / loss_scale)
        scaler = _amp_state.loss_scalers[0]
        old_overflow_buf = scaler._overflow_buf
        scaler._overflow_buf = overflow_buf
        had_overflow = scaler.update_scale()
        scaler._overfloat_buf = old_overflow_buf
        if had_overflow == 0:
            optimizer.step()
            global_step += 1
        else:
            skipped_steps += 1
            print("overflow, loss scale", scaler.loss_scale())
            if _amp_state.opt_properties.master_weights:
                for param in optimizer._amp_stash.all_fp32_from_fp16_params:
                    param.grad = None
        for param in model.parameters():
            param.grad = None
        return global_step

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 6, generator=g), torch.randn(64, 3, generator=g)
    losses = []
    for training_steps in range(1, 4 * 12 + 1):
        batch = slice((training_steps % 8) * 8, (training_steps % 8) * 8 + 8)
        poison["on"] = training_steps == 6
        loss = torch.nn.functional.mse_loss(model(x[batch]).float(), y[batch])
        with amp.scale_loss(loss, optimizer, delay_overflow_check=True) as scaled_loss:
            scaled_loss.backward()
        losses.append(loss.item())
        if training_steps % gradient_accumulation_steps == 0:
            global_step = take_optimizer_step(optimizer, model, overflow_buf, global_step)
    print(f"global_step {global_step} skipped {skipped_steps} scale {amp._amp_state.loss_scalers[0].loss_scale():g}")
    assert (global_step, skipped_steps) == (11, 1), (global_step, skipped_steps)
    assert sum(losses[-8:]) < sum(losses[:8]), losses
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)
''')


def test_a_bert_pretraining_style_script_runs_unmodified(tmp_path: Path, capfd: pytest.CaptureFixture,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "run_pretraining.py"
    script.write_text(BERT_PRETRAINING)
    # `ampatch run` through cli.main in this process (tests/_cli.py); the script is its child process
    proc = ampatch_main(capfd, monkeypatch, "run", "--apex-alias", "--", sys.executable, str(script), str(2 ** 8),
                        cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "global_step 11 skipped 1 scale 128" in out and "overflow, loss scale 128" in out, out
