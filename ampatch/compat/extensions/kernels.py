"""Apex's `amp_C` multi-tensor kernels, computed with torch's foreach ops: the calling
convention, the flag buffer and the results of Apex's CUDA kernels, on any device.

Every kernel takes Apex's arguments in Apex's order, `chunk_size` first (what
`multi_tensor_applier(op, noop_flag, tensor_lists, *args)` passes; it only sized Apex's CUDA
launches and is ignored here). `noop_flag` is Apex's one-element int buffer: a kernel that
checked for inf/NaN sets it to 1 when it finds one, and the kernels that returned early when
it was already set (SGD, the capturable Adams, the mixed-precision LAMB and L2 norm) do
nothing then. Arithmetic is in FP32 (FP64 for double tensors), as in Apex's kernels, and
results are written back in each tensor's own dtype.

This module holds the shared helpers, the element-wise kernels, the norms and the loss-scale
update; `optim_kernels` holds the optimizer kernels.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ampatch.errors import ConfigTypeError, InvalidCallError

__all__ = ["check_lists", "skipped", "raise_flag", "has_inf_or_nan", "nonfinite", "upcast", "store", "norms",
           "total_norm", "multi_tensor_scale", "multi_tensor_axpby", "multi_tensor_l2norm", "multi_tensor_l2norm_mp",
           "multi_tensor_l2norm_scale", "multi_tensor_unscale_l2norm", "update_scale_hysteresis"]

TensorLists = Sequence[Sequence[Tensor]]
_FLT_MIN = torch.finfo(torch.float32).tiny  # smallest normal FP32: Apex's build flushes smaller results to 0
CHUNK = 2048 * 32  # elements per partial norm (Apex's default chunk size)


# --------------------------------------------------------------------------- helpers
def check_lists(name: str, tensor_lists: TensorLists, depth: int | tuple[int, ...]) -> list[list[Tensor]]:
    """Apex's multi_tensor_apply checks, with its messages: `depth` lists (or one of the
    depths in a tuple), the first one non-empty, all of one length, matching sizes. Returns
    the lists as lists."""
    depths = depth if isinstance(depth, tuple) else (depth,)
    lists = [list(lst) for lst in tensor_lists]
    if len(lists) not in depths:
        raise InvalidCallError(f"{name}: tensor_lists.size() != depth (got {len(lists)} lists, expected "
                               f"{' or '.join(map(str, depths))})")
    if not lists[0]:
        raise InvalidCallError(f"{name}: tensor_lists[0].size() is not > 0")
    for lst in lists:
        if len(lst) != len(lists[0]):
            raise InvalidCallError(f"{name}: Size mismatch among tensor lists")
        for t, first in zip(lst, lists[0]):
            if not isinstance(t, Tensor):
                raise ConfigTypeError(f"{name}: tensor_lists must hold tensors, got {type(t).__name__}")
            if t.numel() != first.numel():
                raise InvalidCallError(f"{name}: Size mismatch (a tensor of {t.numel()} elements next to one of "
                                       f"{first.numel()})")
    return lists


def skipped(noop_flag: Tensor) -> bool:
    """Whether the flag is set: the kernels that returned early in Apex do nothing then."""
    return bool(noop_flag.reshape(-1)[0].item())


def raise_flag(noop_flag: Tensor, bad: Tensor) -> None:
    """Set the flag buffer to 1 where `bad` (a 0-dim bool tensor) is true, without a host sync."""
    noop_flag.masked_fill_(bad.to(noop_flag.device), 1)


def has_inf_or_nan(x: Tensor) -> bool:
    """Whether `x` holds an inf or a NaN (Apex's one-tensor check, read on the host)."""
    return not bool(torch.isfinite(x).all())


def nonfinite(tensors: Sequence[Tensor]) -> Tensor:
    """A 0-dim bool tensor: whether any element of `tensors` is inf or NaN."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return torch.zeros((), dtype=torch.bool)
    device = tensors[0].device
    peaks = torch._foreach_norm(tensors, float("inf"))  # max |x|: inf or NaN exactly when one is there
    return ~torch.stack([p.to(device, torch.float32) for p in peaks]).isfinite().all()


def upcast(tensors: Sequence[Tensor]) -> list[Tensor]:
    """The tensors in Apex's math type: FP32 ones (and FP64) as they are, others as FP32 copies
    (give the copies back with `store`)."""
    return [t if t.dtype in (torch.float32, torch.float64) else t.float() for t in tensors]


def store(targets: Sequence[Tensor], values: Sequence[Tensor]) -> None:
    """Write `values` into `targets`, each in its own dtype, skipping a value that is its target."""
    pairs = [(t, v) for t, v in zip(targets, values) if t is not v]
    if pairs:
        torch._foreach_copy_([t for t, _ in pairs], [v for _, v in pairs])


def norms(tensors: Sequence[Tensor], ord: float = 2.0) -> Tensor:
    """Per-tensor norms (L2 or, with `ord=inf`, max |x|), as one FP32 tensor.

    An L2 norm is accumulated in FP64 per chunk of `CHUNK` elements and the chunks' squares
    summed in FP64, then rounded once to FP32: the correctly rounded norm, which is what
    Apex's kernel (FP32 fused multiply-adds over 32 elements per lane, then a pairwise tree)
    returns in practice. torch's FP32 norm on CPU is off by several ulps even on one chunk
    (biased low), enough to move a LAMB trust ratio."""
    tensors = list(tensors)
    device = tensors[0].device
    if ord == float("inf"):
        out = [torch._foreach_norm([t], ord)[0].float() if t.numel()
               else torch.zeros((), dtype=torch.float32, device=t.device) for t in tensors]
        return torch.stack([n.to(device) for n in out])
    pieces: list[torch.Tensor] = []
    owner: list[int] = []
    for i, t in enumerate(tensors):
        chunks = t.reshape(-1).split(CHUNK) if t.numel() > CHUNK else (t,)
        pieces.extend(chunks)
        owner.extend([i] * len(chunks))
    squares = torch.stack([n.to(device) for n in torch._foreach_norm(pieces, 2, dtype=torch.float64)]).square()
    index = torch.tensor(owner, device=device)
    total = torch.zeros(len(tensors), dtype=torch.float64, device=device).index_add_(0, index, squares)
    return total.sqrt().float()


def total_norm(per_tensor: Tensor) -> Tensor:
    """The L2 norm of all the tensors, from their norms, as Apex's one-element FP32 tensor."""
    return per_tensor.double().square().sum().sqrt().float().reshape(1)


def _norm_results(noop_flag: Tensor, per: Tensor, per_tensor: bool | None) -> tuple[Tensor, Tensor]:
    total = total_norm(per)
    raise_flag(noop_flag, ~total.isfinite()[0])
    return total, (per if per_tensor else per.new_empty(0))


# --------------------------------------------------------------------------- element-wise kernels
@torch.no_grad()
def multi_tensor_scale(chunk_size: int, noop_flag: Tensor, tensor_lists: TensorLists, scale: float) -> None:
    """`out = in * scale` for lists `[in, out]` (in place when they are the same tensors); sets the
    flag when an input is inf/NaN (the output still gets the product, as in Apex)."""
    ins, outs = check_lists("multi_tensor_scale", tensor_lists, 2)
    raise_flag(noop_flag, nonfinite(ins))
    store(outs, torch._foreach_mul(upcast(ins), scale))


@torch.no_grad()
def multi_tensor_axpby(chunk_size: int, noop_flag: Tensor, tensor_lists: TensorLists, a: float, b: float,
                       arg_to_check: int) -> None:
    """`out = a * x + b * y` for lists `[x, y, out]`; sets the flag when the checked input has an
    inf/NaN (`arg_to_check`: -1 both, 0 x, 1 y)."""
    xs, ys, outs = check_lists("multi_tensor_axpby", tensor_lists, 3)
    checked = {-1: xs + ys, 0: xs, 1: ys}.get(arg_to_check, [])
    raise_flag(noop_flag, nonfinite(checked))
    out = torch._foreach_mul(upcast(xs), a)
    torch._foreach_add_(out, upcast(ys), alpha=b)
    store(outs, out)


# --------------------------------------------------------------------------- norms
@torch.no_grad()
def multi_tensor_l2norm(chunk_size: int, noop_flag: Tensor, tensor_lists: TensorLists,
                        per_tensor: bool | None = None) -> tuple[Tensor, Tensor]:
    """`(total, per_tensor)`: the L2 norm of all the tensors of `[x]` as a one-element FP32
    tensor, and with `per_tensor=True` each tensor's norm (else an empty tensor). Sets the flag
    when the norm is inf/NaN."""
    (xs,) = check_lists("multi_tensor_l2norm", tensor_lists, 1)
    return _norm_results(noop_flag, norms(xs), per_tensor)


@torch.no_grad()
def multi_tensor_l2norm_mp(chunk_size: int, noop_flag: Tensor, tensor_lists: TensorLists,
                           per_tensor: bool | None = None) -> tuple[Tensor, Tensor]:
    """`multi_tensor_l2norm` that does nothing when the flag is already set (Apex's kernel left
    its results unwritten then; here they are zeros)."""
    (xs,) = check_lists("multi_tensor_l2norm_mp", tensor_lists, 1)
    if skipped(noop_flag):
        zeros = torch.zeros(len(xs) if per_tensor else 0, dtype=torch.float32, device=xs[0].device)
        return torch.zeros(1, dtype=torch.float32, device=xs[0].device), zeros
    return _norm_results(noop_flag, norms(xs), per_tensor)


@torch.no_grad()
def multi_tensor_l2norm_scale(chunk_size: int, noop_flag: Tensor, tensor_lists: TensorLists, scale: float,
                              per_tensor: bool | None = None) -> tuple[Tensor, Tensor]:
    """`out = in * scale` for lists `[in, out]`, returning the norms of the inputs (as
    `multi_tensor_l2norm`)."""
    ins, outs = check_lists("multi_tensor_l2norm_scale", tensor_lists, 2)
    per = norms(ins)
    store(outs, torch._foreach_mul(upcast(ins), scale))
    return _norm_results(noop_flag, per, per_tensor)


@torch.no_grad()
def multi_tensor_unscale_l2norm(chunk_size: int, noop_flag: Tensor, tensor_lists: TensorLists, inv_scale: Tensor,
                                per_tensor: bool | None = None) -> tuple[Tensor, Tensor]:
    """The norms of `[x]` multiplied by `inv_scale` (a one-element tensor), without writing the
    unscaled values anywhere: the true gradient norm of loss-scaled gradients."""
    (xs,) = check_lists("multi_tensor_unscale_l2norm", tensor_lists, 1)
    factor = inv_scale.reshape(-1)[0].to(xs[0].device, torch.float32).abs()
    return _norm_results(noop_flag, norms(xs) * factor, per_tensor)


# --------------------------------------------------------------------------- the loss scale
def _fp32(value: float) -> float:
    """`value` rounded to FP32, flushed to zero below the smallest normal (Apex built its
    kernels with fast math, which flushes denormal results)."""
    out = torch.tensor(value, dtype=torch.float32).item()
    return 0.0 if abs(out) < _FLT_MIN else out


@torch.no_grad()
def update_scale_hysteresis(current_scale: Tensor, growth_tracker: Tensor, hysteresis_tracker: Tensor,
                            found_inf: Tensor, growth_factor: float, backoff_factor: float, growth_interval: int,
                            hysteresis: int) -> Tensor:
    """Apex's dynamic loss-scale update with hysteresis, in place on its one-element tensors:
    an overflow first uses up the hysteresis (the scale stays), then backs the scale off
    (a scale below FP32's smallest normal becomes 0); `growth_interval` clean steps in a row
    grow it (never to inf); a clean step refills the hysteresis. Returns `current_scale`."""
    inf = float(found_inf.reshape(-1)[0].item())
    if inf > 0:
        left = int(hysteresis_tracker.reshape(-1)[0].item()) - 1
        hysteresis_tracker.fill_(left)
        if left > 0:  # hysteresis left: the scale stays, the growth count restarts
            growth_tracker.fill_(0)
            return current_scale
    scale = float(current_scale.reshape(-1)[0].item())
    if inf:
        current_scale.fill_(_fp32(scale * backoff_factor))
        growth_tracker.fill_(0)
    else:
        successful = int(growth_tracker.reshape(-1)[0].item()) + 1
        if successful == growth_interval:
            grown = _fp32(scale * growth_factor)
            if grown != float("inf"):
                current_scale.fill_(grown)
            growth_tracker.fill_(0)
        else:
            growth_tracker.fill_(successful)
    if inf <= 0:
        hysteresis_tracker.fill_(hysteresis)
    return current_scale
