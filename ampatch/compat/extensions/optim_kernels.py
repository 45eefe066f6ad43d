"""Apex's `amp_C` optimizer kernels on torch's foreach ops: Adam (plain, capturable, with FP32
master weights), SGD, Adagrad, NovoGrad and LAMB (plain, mixed precision, and the older
two-stage form), with Apex's argument order and update rules.

Conventions are those of `kernels` (the flag buffer, FP32 math, results in each tensor's own
dtype). Where Apex's kernel wrote into a list the caller passed, so does this one: LAMB leaves
its update in the gradient list, the capturable Adams leave the unscaled gradients there, and
SGD and the master-weight Adam write the new weights into the extra model-weight list.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .kernels import TensorLists, check_lists, norms, raise_flag, skipped, store, total_norm, upcast

__all__ = ["multi_tensor_adam", "multi_tensor_adam_capturable", "multi_tensor_adam_capturable_master",
           "multi_tensor_sgd", "multi_tensor_adagrad", "multi_tensor_novograd", "multi_tensor_lamb",
           "multi_tensor_lamb_mp", "multi_tensor_lamb_stage1_cuda", "multi_tensor_lamb_stage2_cuda"]

ADAM_L2, ADAM_W = 0, 1  # Apex's `mode`: L2 regularization, or decoupled weight decay (AdamW)


def _item(value: float | Tensor) -> float:
    return float(value.reshape(-1)[0].item()) if isinstance(value, Tensor) else float(value)


def _corrections(beta1: float, beta2: float, step: int, bias_correction: int | bool) -> tuple[float, float]:
    """Apex's bias corrections `1 - beta ** step`, in FP32 (1.0 each without bias correction)."""
    if not bias_correction:
        return 1.0, 1.0
    bc = torch.tensor([1 - beta1 ** step, 1 - beta2 ** step], dtype=torch.float32).tolist()
    return bc[0], bc[1]


def _adam(g: list[Tensor], p: list[Tensor], m: list[Tensor], v: list[Tensor], lr: float, beta1: float,
          beta2: float, eps: float, bc1: float, bc2: float, mode: int, decay: float) -> None:
    """One Adam step on math-type lists, in place on p, m and v (g is read only)."""
    if mode == ADAM_L2 and decay:
        g = list(torch._foreach_add(g, p, alpha=decay))
    torch._foreach_mul_(m, beta1)
    torch._foreach_add_(m, g, alpha=1 - beta1)
    torch._foreach_mul_(v, beta2)
    torch._foreach_addcmul_(v, g, g, value=1 - beta2)
    denom = torch._foreach_div(v, bc2)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    update = torch._foreach_div(m, bc1)
    torch._foreach_div_(update, denom)
    if mode != ADAM_L2 and decay:
        torch._foreach_add_(update, p, alpha=decay)
    torch._foreach_add_(p, update, alpha=-lr)


@torch.no_grad()
def multi_tensor_adam(chunk_size: int, noop_flag: Tensor, tensor_lists: TensorLists, lr: float, beta1: float,
                      beta2: float, epsilon: float, step: int, mode: int, bias_correction: int,
                      weight_decay: float) -> None:
    """Adam on lists `[grads, params, exp_avgs, exp_avg_sqs]`; `mode` 0 adds `weight_decay * p`
    to the gradient (L2), 1 to the update (AdamW)."""
    g, p, m, v = check_lists("multi_tensor_adam", tensor_lists, 4)
    bc1, bc2 = _corrections(beta1, beta2, int(step), bias_correction)
    p32, m32, v32 = upcast(p), upcast(m), upcast(v)
    _adam(upcast(g), p32, m32, v32, _item(lr), beta1, beta2, epsilon, bc1, bc2, mode, weight_decay)
    store(p, p32)
    store(m, m32)
    store(v, v32)


def _adam_capturable(noop_flag: Tensor, lists: list[list[Tensor]], lr: Tensor, beta1: float,
                     beta2: float, epsilon: float, step: Tensor, mode: int, bias_correction: int,
                     weight_decay: float, inv_scale: Tensor) -> None:
    if skipped(noop_flag):
        return
    g, p, m, v = lists[:4]
    g32 = list(torch._foreach_mul(upcast(g), inv_scale.reshape(-1)[0].float()))
    store(g, g32)  # the kernel leaves the unscaled gradients behind
    master = lists[4] if len(lists) == 5 else p
    p32, m32, v32 = upcast(master), upcast(m), upcast(v)
    bc1, bc2 = _corrections(beta1, beta2, int(_item(step)), bias_correction)
    _adam(g32, p32, m32, v32, _item(lr), beta1, beta2, epsilon, bc1, bc2, mode, weight_decay)
    store(master, p32)
    store(m, m32)
    store(v, v32)
    if master is not p:
        store(p, p32)


@torch.no_grad()
def multi_tensor_adam_capturable(chunk_size: int, noop_flag: Tensor, tensor_lists: TensorLists, lr: Tensor,
                                 beta1: float, beta2: float, epsilon: float, step: Tensor, mode: int,
                                 bias_correction: int, weight_decay: float, inv_scale: Tensor) -> None:
    """Adam with `lr` and `step` as tensors and the gradients multiplied by `inv_scale` first;
    nothing happens when the flag is set (an overflowed step)."""
    lists = check_lists("multi_tensor_adam_capturable", tensor_lists, 4)
    _adam_capturable(noop_flag, lists, lr, beta1, beta2, epsilon, step, mode,
                     bias_correction, weight_decay, inv_scale)


@torch.no_grad()
def multi_tensor_adam_capturable_master(chunk_size: int, noop_flag: Tensor, tensor_lists: TensorLists, lr: Tensor,
                                        beta1: float, beta2: float, epsilon: float, step: Tensor, mode: int,
                                        bias_correction: int, weight_decay: float, inv_scale: Tensor) -> None:
    """The capturable Adam on `[grads, params, exp_avgs, exp_avg_sqs, fp32_master_params]`: the
    step runs on the masters and the params receive them in their own dtype."""
    lists = check_lists("multi_tensor_adam_capturable_master", tensor_lists, 5)
    _adam_capturable(noop_flag, lists, lr, beta1, beta2, epsilon, step, mode, bias_correction, weight_decay,
                     inv_scale)


@torch.no_grad()
def multi_tensor_sgd(chunk_size: int, noop_flag: Tensor, tensor_lists: TensorLists, wd: float, momentum: float,
                     dampening: float, lr: float, nesterov: bool, first_run: bool, wd_after_momentum: bool,
                     scale: float = 1.0) -> None:
    """SGD on `[grads, weights, momentum_buffers]` (plus `[model_weights]`, which receive the new
    weights): grads times `scale`, weight decay before momentum (or after, with
    `wd_after_momentum`), a `first_run` momentum buffer starts as the gradient. Nothing happens
    when the flag is set."""
    lists = check_lists("multi_tensor_sgd", tensor_lists, (3, 4))
    if skipped(noop_flag):
        return
    grads, weights, moms = lists[:3]
    w32 = upcast(weights)
    d = list(torch._foreach_mul(upcast(grads), scale))
    if wd and not wd_after_momentum:
        torch._foreach_add_(d, w32, alpha=wd)
    if momentum:
        if first_run:
            m32 = [t.clone() for t in d]
        else:
            m32 = upcast(moms)
            torch._foreach_mul_(m32, momentum)
            torch._foreach_add_(m32, d, alpha=1 - dampening)
        if nesterov:
            torch._foreach_add_(d, m32, alpha=momentum)
        else:
            d = [t.clone() for t in m32]
        store(moms, m32)
    if wd and wd_after_momentum:
        torch._foreach_add_(d, w32, alpha=wd)
    if any(w is not w_ for w, w_ in zip(weights, w32)):
        # Apex's `weight += -lr * d` on a half weight converts the step to the weight's type first
        # (c10's Half += Half), so the FP16 step rounds before it is added, not only the sum.
        d = [(t * -lr).to(w.dtype).float() if w is not w_ else t * -lr for t, w, w_ in zip(d, weights, w32)]
        torch._foreach_add_(w32, d)
    else:
        torch._foreach_add_(w32, d, alpha=-lr)
    store(weights, w32)
    if len(lists) == 4:
        store(lists[3], w32)


@torch.no_grad()
def multi_tensor_adagrad(chunk_size: int, noop_flag: Tensor, tensor_lists: TensorLists, lr: float, epsilon: float,
                         mode: int, weight_decay: float) -> None:
    """Adagrad on `[grads, params, state_sums]`: `mode` 0 adds `weight_decay * p` to the
    gradient (L2), 1 to the update (decoupled)."""
    g, p, h = check_lists("multi_tensor_adagrad", tensor_lists, 3)
    p32, h32, g32 = upcast(p), upcast(h), upcast(g)
    if mode == 0 and weight_decay:
        g32 = list(torch._foreach_add(g32, p32, alpha=weight_decay))
    torch._foreach_addcmul_(h32, g32, g32)
    denom = torch._foreach_sqrt(h32)
    torch._foreach_add_(denom, epsilon)
    update = torch._foreach_div(g32, denom)
    if mode != 0 and weight_decay:
        torch._foreach_add_(update, p32, alpha=weight_decay)
    torch._foreach_add_(p32, update, alpha=-lr)
    store(p, p32)
    store(h, h32)


@torch.no_grad()
def multi_tensor_novograd(chunk_size: int, noop_flag: Tensor, tensor_lists: TensorLists, grad_norms: Tensor,
                          lr: float, beta1: float, beta2: float, epsilon: float, step: int, bias_correction: int,
                          weight_decay: float, grad_averaging: int, moment_mode: int, norm_type: int) -> None:
    """NovoGrad on `[grads, params, exp_avgs]`. `grad_norms` (one per tensor, updated in place)
    blends in this step's norms: L2 `sqrt(b2 * n^2 + (1 - b2) * |g|^2)`, or `norm_type=0` (max
    norm) `b2 * n + (1 - b2) * max|g|`. `moment_mode` 0 normalizes the gradient and adds weight
    decay before the momentum; 1 (decoupled) after."""
    g, p, m = check_lists("multi_tensor_novograd", tensor_lists, 3)
    step = int(step)
    bc1 = 1 - beta1 ** step if bias_correction else 1.0
    bc2 = (1 - beta2 ** step) ** 0.5 if bias_correction else 1.0
    beta3 = 1 - beta1 if grad_averaging else 1.0
    fresh = norms(g, float("inf") if norm_type == 0 else 2.0)
    raise_flag(noop_flag, ~fresh.isfinite().all())
    fresh = fresh.to(grad_norms.device)
    if norm_type == 0:
        grad_norms.mul_(beta2).add_(fresh, alpha=1 - beta2)
    else:
        grad_norms.copy_((beta2 * grad_norms.square() + (1 - beta2) * fresh.square()).sqrt())
    denoms = list((grad_norms.float() / bc2 + epsilon).to(g[0].device).unbind())
    p32, m32, g32 = upcast(p), upcast(m), upcast(g)
    if moment_mode == 0:
        g32 = list(torch._foreach_div(g32, denoms))
        if weight_decay:
            torch._foreach_add_(g32, p32, alpha=weight_decay)
        torch._foreach_mul_(m32, beta1)
        torch._foreach_add_(m32, g32, alpha=beta3)
        update = torch._foreach_div(m32, bc1)
    else:
        torch._foreach_mul_(m32, beta1)
        torch._foreach_add_(m32, g32, alpha=beta3)
        update = torch._foreach_div(m32, bc1)
        torch._foreach_div_(update, denoms)
        if weight_decay:
            torch._foreach_add_(update, p32, alpha=weight_decay)
    torch._foreach_add_(p32, update, alpha=-lr)
    store(p, p32)
    store(m, m32)


# --------------------------------------------------------------------------- LAMB
def _trust_ratios(lr: float, param_norms: Tensor, update_norms: Tensor, decay: float, use_nvlamb: bool) -> Tensor:
    """Per tensor, `lr * |p| / |update|` (where both norms are non-zero and the tensor gets the
    trust ratio: every tensor with `use_nvlamb`, else those with weight decay), else `lr`."""
    lr_t = torch.full_like(param_norms, lr)
    if not (use_nvlamb or decay != 0.0):
        return lr_t
    ok = (param_norms != 0) & (update_norms != 0)
    return torch.where(ok, lr_t * (param_norms / torch.where(ok, update_norms, 1.0)), lr_t)  # Apex's order


def _lamb_update(g32: list[Tensor], p32: list[Tensor], m32: list[Tensor], v32: list[Tensor], beta1: float,
                 beta2: float, beta3: float, bc1: float, bc2: float, epsilon: float, mode: int,
                 decay: float) -> list[Tensor]:
    """LAMB's first stage, in place on m and v: the Adam-style update, with L2 (mode 0) or
    decoupled (mode 1) weight decay. Returns the updates."""
    if mode == 0 and decay:
        g32 = list(torch._foreach_add(g32, p32, alpha=decay))
    torch._foreach_mul_(m32, beta1)
    torch._foreach_add_(m32, g32, alpha=beta3)
    torch._foreach_mul_(v32, beta2)
    torch._foreach_addcmul_(v32, g32, g32, value=1 - beta2)
    denom = torch._foreach_div(v32, bc2)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, epsilon)
    update = torch._foreach_div(m32, bc1)
    torch._foreach_div_(update, denom)
    if mode != 0 and decay:
        torch._foreach_add_(update, p32, alpha=decay)
    return list(update)


def _lamb(noop_flag: Tensor, lists: list[list[Tensor]], lr: float, beta1: float, beta2: float, epsilon: float,
          step: int, bias_correction: int, weight_decay: float, grad_averaging: int, mode: int, clip: float,
          use_nvlamb: bool, inv_scale: Tensor | None, model_params: list[Tensor] | None) -> None:
    g, p, m, v = lists
    param_norms = norms(p)
    raise_flag(noop_flag, ~total_norm(param_norms).isfinite()[0])
    if inv_scale is not None and skipped(noop_flag):
        return
    g32 = upcast(g)
    if inv_scale is not None:
        g32 = list(torch._foreach_mul(g32, inv_scale.reshape(-1)[0].float()))
    if clip != 1.0:
        g32 = list(torch._foreach_div(g32, clip))
    bc1, bc2 = _corrections(beta1, beta2, step, bias_correction)
    p32, m32, v32 = upcast(p), upcast(m), upcast(v)
    update = _lamb_update(g32, p32, m32, v32, beta1, beta2, 1 - beta1 if grad_averaging else 1.0, bc1, bc2,
                          epsilon, mode, weight_decay)
    store(m, m32)
    store(v, v32)
    store(g, update)  # Apex's kernel keeps the update in the gradients, and takes its norm from there
    update_norms = norms(g)
    raise_flag(noop_flag, ~total_norm(update_norms).isfinite()[0])
    if inv_scale is not None and skipped(noop_flag):
        return
    ratios = _trust_ratios(lr, param_norms, update_norms, weight_decay, bool(use_nvlamb))
    torch._foreach_sub_(p32, torch._foreach_mul(upcast(g), list(ratios.to(g[0].device).unbind())))
    store(p, p32)
    if model_params is not None:
        store(model_params, p32)


def _clip_ratio(global_grad_norm: float, max_grad_norm: float) -> float:
    return global_grad_norm / max_grad_norm if global_grad_norm > max_grad_norm else 1.0


@torch.no_grad()
def multi_tensor_lamb(chunk_size: int, noop_flag: Tensor, tensor_lists: TensorLists, lr: float, beta1: float,
                      beta2: float, epsilon: float, step: int, bias_correction: int, weight_decay: float,
                      grad_averaging: int, mode: int, global_grad_norm: Tensor, max_grad_norm: float,
                      use_nvlamb: bool | None = None) -> None:
    """LAMB on `[grads, params, exp_avgs, exp_avg_sqs]`: gradients divided by
    `global_grad_norm / max_grad_norm` when that exceeds 1, the Adam-style update (momentum
    weight `1 - beta1`, or 1 without `grad_averaging`), then each tensor steps by
    `lr * |p| / |update|` (only with weight decay, unless `use_nvlamb`)."""
    lists = check_lists("multi_tensor_lamb", tensor_lists, 4)
    _lamb(noop_flag, lists, _item(lr), beta1, beta2, epsilon, int(step), bias_correction, weight_decay,
          grad_averaging, mode, _clip_ratio(_item(global_grad_norm), _item(max_grad_norm)), bool(use_nvlamb),
          None, None)


@torch.no_grad()
def multi_tensor_lamb_mp(chunk_size: int, noop_flag: Tensor, tensor_lists: TensorLists, lr: Tensor, beta1: float,
                         beta2: float, epsilon: float, step: Tensor, bias_correction: int, weight_decay: float,
                         grad_averaging: int, mode: int, global_grad_norm: Tensor, max_grad_norm: Tensor,
                         use_nvlamb: bool | None, found_inf: Tensor, inv_scale: Tensor) -> None:
    """LAMB for mixed precision: `lr`, `step` and the norms are tensors, the gradients are
    multiplied by `inv_scale`, nothing happens when the flag is set; with five lists
    `[grads, fp32_params, exp_avgs, exp_avg_sqs, model_params]` the model params receive the
    new FP32 params in their own dtype."""
    lists = check_lists("multi_tensor_lamb_mp", tensor_lists, (4, 5))
    if skipped(noop_flag):
        return
    _lamb(noop_flag, lists[:4], _item(lr), beta1, beta2, epsilon, int(_item(step)), bias_correction, weight_decay,
          grad_averaging, mode, _clip_ratio(_item(global_grad_norm), _item(max_grad_norm)), bool(use_nvlamb),
          inv_scale, lists[4] if len(lists) == 5 else None)


@torch.no_grad()
def multi_tensor_lamb_stage1_cuda(chunk_size: int, noop_flag: Tensor, tensor_lists: TensorLists,
                                  per_tensor_decay: Tensor, step: int, beta1: float, beta2: float, epsilon: float,
                                  global_grad_norm: Tensor, max_global_grad_norm: float) -> None:
    """Apex's older two-stage LAMB, stage 1, on `[grads, params, exp_avgs, exp_avg_sqs, updates]`:
    the AdamW-style update with each tensor's own decay, bias-corrected for step `step + 1`."""
    g, p, m, v, out = check_lists("multi_tensor_lamb_stage1_cuda", tensor_lists, 5)
    clip = _clip_ratio(_item(global_grad_norm), max_global_grad_norm)
    bc1, bc2 = _corrections(beta1, beta2, int(step) + 1, True)
    p32, m32, v32 = upcast(p), upcast(m), upcast(v)
    update = _lamb_update(list(torch._foreach_div(upcast(g), clip)), p32, m32, v32, beta1, beta2, 1 - beta1, bc1, bc2,
                          epsilon, mode=1, decay=0.0)
    decays = per_tensor_decay.float().to(p[0].device)
    torch._foreach_add_(update, torch._foreach_mul(p32, list(decays.unbind())))
    store(m, m32)
    store(v, v32)
    store(out, update)


@torch.no_grad()
def multi_tensor_lamb_stage2_cuda(chunk_size: int, noop_flag: Tensor, tensor_lists: TensorLists,
                                  per_tensor_param_norm: Tensor, per_tensor_update_norm: Tensor, lr: float,
                                  weight_decay: float, use_nvlamb: bool | None = None) -> None:
    """Stage 2 on `[params, updates]`: each param steps by its trust-ratio learning rate."""
    p, updates = check_lists("multi_tensor_lamb_stage2_cuda", tensor_lists, 2)
    ratios = _trust_ratios(float(lr), per_tensor_param_norm.float(), per_tensor_update_norm.float(), weight_decay,
                           bool(use_nvlamb))
    p32 = upcast(p)
    torch._foreach_sub_(p32, torch._foreach_mul(upcast(updates), list(ratios.to(p[0].device).unbind())))
    store(p, p32)
