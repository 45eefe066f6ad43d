"""How the low-memory master modes cut an optimizer step into chunks (`stepper` runs them),
apart from their arithmetic (`rounding`).

- `chunk_numel` / `plan_pieces` / `plan_chunks`: which parameters, or slices of them, step
  together, so the transient FP32 copies of a step never exist for all parameters at once;
- `is_elementwise`: whether an optimizer's update of an element depends on that element only
  (then a parameter larger than a chunk steps in chunk-sized slices);
- `Workspace`: the FP32 buffers every chunk is lifted into, sized by the chunk, kept across
  chunks and steps;
- `narrowed`: an optimizer's param groups cut down to one chunk for one step() call;
- `step_hooks_once`: an optimizer stepped once per chunk still runs its step hooks once.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch.optim import optimizer as torch_optimizer

from ampatch.errors import ConfigError, InvalidCallError

__all__ = ["refuse_lbfgs", "plan_pieces", "plan_chunks", "narrowed", "step_hooks_once", "has_step_hooks", "chunk_numel",
           "CHUNK_NUMEL", "ELEMENTWISE", "is_elementwise", "Workspace"]

_Hook = TypeVar("_Hook")  # an optimizer step hook, pre or post

# Parameter elements stepped together, by device type: each chunk costs 8 bytes per element
# (the workspace: FP32 values and FP32 grads) plus what the optimizer makes on the side while
# it steps. On a CPU a chunk of 512K elements (4 MiB) stays in cache through lift, step and
# rounding: measured 13.7 ms per step of the built-in LM's "large" size against 16.2 ms with
# 4M-element chunks. A GPU wants fewer, larger chunks (each costs kernel launches and one
# optimizer.step() call); 4M elements (a 32 MiB workspace) keep the workspace small beside
# the 2-4 bytes per parameter the modes save, from 25M parameters up.
CHUNK_NUMEL = {"cpu": 1 << 19}
DEFAULT_CHUNK_NUMEL = 1 << 22

# torch.optim's optimizers whose update of an element reads only that element (and per-tensor
# scalars such as the step count): a slice of a parameter steps exactly as the whole would.
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.RMSprop,
               torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam)
OPT_IN = "ampatch_elementwise"  # an optimizer (class or instance) attribute: True declares it elementwise


def is_elementwise(opt: torch.optim.Optimizer) -> bool:
    """Whether `opt` updates each element from that element alone: declared by its
    `ampatch_elementwise` attribute (True or False), else one of `ELEMENTWISE` whose step() is
    torch's own (a subclass that overrides step() may do anything: it steps whole)."""
    declared = getattr(opt, OPT_IN, None)
    if declared is not None:
        return bool(declared)
    return any(isinstance(opt, base) and type(opt).step is base.step for base in ELEMENTWISE)


def chunk_numel(device: torch.device) -> int:
    """The chunk size (`CHUNK_NUMEL`) for parameters on `device`."""
    return CHUNK_NUMEL.get(device.type, DEFAULT_CHUNK_NUMEL)


def plan_pieces(sizes: Sequence[int], splittable: Sequence[bool], budget: int) -> list[tuple[int, int, int]]:
    """(index, start, stop) pieces of the tensors of `sizes` (element counts, in stepping order):
    a splittable tensor larger than `budget` in slices of `budget` elements (the last one
    shorter), every other tensor whole."""
    pieces = []
    for i, (n, split) in enumerate(zip(sizes, splittable)):
        if split and n > budget:
            pieces += [(i, a, min(a + budget, n)) for a in range(0, n, budget)]
        else:
            pieces.append((i, 0, n))
    return pieces


def plan_chunks(sizes: Sequence[int], budget: int) -> list[list[int]]:
    """Indices of `sizes` (element counts, in stepping order) split into consecutive chunks of
    at most `budget` elements each; a single size over the budget is a chunk of its own."""
    chunks: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i, n in enumerate(sizes):
        if current and total + n > budget:
            chunks.append(current)
            current, total = [], 0
        current.append(i)
        total += n
    if current:
        chunks.append(current)
    return chunks


def _set_aside(hooks: dict[int, _Hook]) -> Callable[[], None]:
    """Empty `hooks` now; the function returned puts them back, ahead of any registered
    meanwhile (those stay registered)."""
    saved = dict(hooks)
    hooks.clear()

    def restore() -> None:
        added = dict(hooks)
        hooks.clear()
        hooks.update(saved)
        hooks.update(added)
    return restore


@contextlib.contextmanager
def step_hooks_once(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> Iterator[Callable[[], tuple]]:
    """Around several calls of `opt.step()` that together make one step: the optimizer's step
    pre-hooks (global and its own, `register_step_pre_hook`) run once before, the post-hooks
    once after, and none inside (each call would run them, seeing one chunk). Yields a
    function returning the (args, kwargs) the pre-hooks left, for the calls inside.

    The global hooks are process-wide: another thread stepping an optimizer meanwhile would
    not run them (ampatch steps with casts disabled on this thread only; this is the one
    place a step touches process state)."""
    pre_own, post_own = opt._optimizer_step_pre_hooks, opt._optimizer_step_post_hooks
    pre_global, post_global = torch_optimizer._global_optimizer_pre_hooks, torch_optimizer._global_optimizer_post_hooks
    full_args = (opt, *args)
    for hook in (*pre_global.values(), *pre_own.values()):
        result = hook(opt, full_args, kwargs)
        if result is not None:
            if not (isinstance(result, tuple) and len(result) == 2):
                raise InvalidCallError(f"an optimizer step pre-hook must return None or (args, kwargs), got "
                                       f"{result!r}.")
            full_args, kwargs = result
    restores = [_set_aside(pre_own), _set_aside(post_own), _set_aside(pre_global), _set_aside(post_global)]
    try:
        yield lambda: (tuple(full_args[1:]), kwargs)
    finally:
        for restore in restores:
            restore()
    for hook in (*post_own.values(), *post_global.values()):
        hook(opt, full_args, kwargs)


def has_step_hooks(opt: torch.optim.Optimizer) -> bool:
    """Whether any step hook would run for `opt` (the common case has none: no bookkeeping)."""
    return bool(getattr(opt, "_optimizer_step_pre_hooks", None) or getattr(opt, "_optimizer_step_post_hooks", None)
                or torch_optimizer._global_optimizer_pre_hooks or torch_optimizer._global_optimizer_post_hooks)


class Workspace:
    """The FP32 buffers a chunk is lifted into (its values, and its grads, which the stochastic
    rounding then reuses for its thresholds), one pair per device: made once, as large as the
    largest chunk, and reused by every chunk of every step, so a step allocates nothing of its
    own (fresh buffers every chunk would let malloc keep the freed blocks, raising the process's
    peak)."""

    def __init__(self) -> None:
        self.buffers: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self.scratches: dict[torch.device, torch.Tensor] = {}  # int32: the stochastic rounding's hash
        self.named: dict[tuple[torch.device, str], torch.Tensor] = {}  # the kept optimizer state's (`states`)

    def take(self, device: torch.device, n: int, most: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `n` elements of the values and grads buffers on `device`: made again, `n`
        long, if they are shorter, or longer than both `n` and `most` (the chunk size changed)."""
        have = self.buffers.get(device)
        if have is None or have[0].numel() < n or most is not None and have[0].numel() > max(n, most):
            self.scratches.pop(device, None)
            self.buffers.pop(device, None)  # the old pair goes before the new one is made
            have = self.buffers[device] = (torch.empty(n, dtype=torch.float32, device=device),
                                           torch.empty(n, dtype=torch.float32, device=device))
        return have[0][:n], have[1][:n]

    def scratch(self, device: torch.device, n: int) -> torch.Tensor:
        """The first `n` elements of an int32 buffer on `device` (grown to `n` if smaller)."""
        have = self.scratches.get(device)
        if have is None or have.numel() < n:
            self.scratches.pop(device, None)
            have = self.scratches[device] = torch.empty(max(n, self.buffers[device][0].numel() if device in self.buffers
                                                            else n), dtype=torch.int32, device=device)
        return have[:n]

    def buffer(self, device: torch.device, name: str, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The first `n` elements of the buffer `name` on `device` (made again, `n` long, if shorter)."""
        have = self.named.get((device, name))
        if have is None or have.numel() < n or have.dtype != dtype:
            self.named.pop((device, name), None)
            have = self.named[(device, name)] = torch.empty(n, dtype=dtype, device=device)
        return have[:n]

    def nbytes(self) -> int:
        return (sum(v.numel() * 4 + g.numel() * 4 for v, g in self.buffers.values())
                + sum(s.numel() * 4 for s in self.scratches.values())
                + sum(b.numel() * b.element_size() for b in self.named.values()))


@contextlib.contextmanager
def narrowed(opt: torch.optim.Optimizer, members: dict[int, list[torch.Tensor]]) -> Iterator[None]:
    """Each param group of `opt` holds only the tensors `members` lists under its index (the
    chunk's stand-ins for its params), and groups without any are out of `param_groups`, for one
    step() call; everything back after (the same list and dict objects: what the optimizer wrote
    into a group stays)."""
    groups = opt.param_groups
    everything = list(groups)
    saved = [g["params"] for g in everything]
    kept = []
    for i, g in enumerate(everything):
        sub = members.get(i)
        if sub:
            g["params"] = sub
            kept.append(g)
    groups[:] = kept
    try:
        yield
    finally:
        groups[:] = everything
        for g, params in zip(everything, saved):
            g["params"] = params


def refuse_lbfgs(optimizer: torch.optim.Optimizer, mode: Any) -> None:
    """The low-memory masters step in chunks; LBFGS's closure needs every parameter at once."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ConfigError(f"master_weights={mode.value!r} steps the parameters a chunk at a time, and LBFGS needs "
                          "all of them at once (it re-evaluates a closure over the whole model); use "
                          "master_weights=True (FP32 masters) with LBFGS.")
