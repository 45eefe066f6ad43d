"""A module's FP32 shadow: the same call again, on the same inputs upcast to FP32, with FP32
parameters and no casts, so the difference from the real (half) result is the error that
half precision made inside that module alone.

The shadow leaves no trace in training: it runs under `no_grad`, on copies of the
buffers (a batch norm's running statistics are not updated twice), with the random state
the real call started from (dropout draws the same mask) and restored afterwards, with
every ampatch cast off (O1 wrappers, the forward wrappers of cast models and of modules
kept in FP32), and with the diagnosis hooks silent.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..base.patcher import disable_casts
from ..base.tree import map_tensors
from ..model.forwards import forward_casts_bypassed

__all__ = ["RandomState", "upcast", "run_shadow", "quiet", "is_quiet"]

Masters = Callable[[torch.Tensor], "torch.Tensor | None"]


class _Quiet(threading.local):
    depth = 0


_quiet = _Quiet()


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The diagnosis hooks do nothing inside (in this thread): a shadow's own submodule
    calls are not measured."""
    _quiet.depth += 1
    try:
        yield
    finally:
        _quiet.depth -= 1


def is_quiet() -> bool:
    return _quiet.depth > 0


@dataclass
class RandomState:
    """The random state a call started from: the CPU generator's, and the CUDA device's
    the module runs on, if any."""

    cpu: torch.Tensor
    device: torch.device | None = None
    cuda: torch.Tensor | None = None

    @classmethod
    def capture(cls, device: torch.device | None) -> "RandomState":
        if device is not None and device.type == "cuda":
            return cls(torch.get_rng_state(), device, torch.cuda.get_rng_state(device))
        return cls(torch.get_rng_state())

    @contextlib.contextmanager
    def replayed(self) -> Iterator[None]:
        """Inside: the generators start from this state; afterwards they are as before."""
        devices = [self.device] if self.cuda is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None and self.device is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield


def _fp32_copy(t: torch.Tensor) -> torch.Tensor:
    if not t.is_floating_point():
        return t
    return t.detach().to(torch.float32 if t.dtype != torch.float64 else t.dtype, copy=True)


def upcast(x: Any) -> Any:
    """A detached FP32 copy of every floating tensor in `x` (float64 stays float64); other
    values as they are. Always a copy, so an in-place op of the real call cannot change it."""
    return map_tensors(x, _fp32_copy)


@contextlib.contextmanager
def _fp32_state(module: nn.Module, masters: Masters | None) -> Iterator[None]:
    """`module` and its children hold FP32 parameters (the FP32 master where there is one)
    and copies of their buffers (floating ones in FP32) until the block ends; then the
    originals are back, untouched by what the shadow did to the copies."""
    swapped: list[tuple[nn.Module, str, bool, Any]] = []
    made: dict[int, torch.Tensor] = {}  # tied parameters share one FP32 copy
    try:
        for m in module.modules():
            for name, p in list(m._parameters.items()):
                if p is None or not p.is_floating_point():
                    continue
                fp32 = made.get(id(p))
                if fp32 is None:
                    master = masters(p) if masters is not None else None
                    src = master if master is not None and master.shape == p.shape else p
                    fp32 = made[id(p)] = nn.Parameter(src.detach().float(), requires_grad=False)
                swapped.append((m, name, True, p))
                setattr(m, name, fp32)  # through the module's __setattr__: RNNs refresh their flat weights
            for name, b in list(m._buffers.items()):
                if b is not None:  # every buffer, counters too (a batch norm's num_batches_tracked)
                    swapped.append((m, name, False, b))
                    m._buffers[name] = b.detach().to(torch.float32 if b.is_floating_point() else b.dtype, copy=True)
        yield
    finally:
        for m, name, is_param, original in reversed(swapped):
            if is_param:
                setattr(m, name, original)
            else:
                m._buffers[name] = original


def run_shadow(module: nn.Module, args: Any, kwargs: dict, state: RandomState | None,
               masters: Masters | None = None) -> Any:
    """`module(*args, **kwargs)` as its FP32 shadow (see the module docstring); `args` and
    `kwargs` are FP32 already (see `upcast`)."""
    rng = state.replayed() if state is not None else contextlib.nullcontext()
    with quiet(), disable_casts(), forward_casts_bypassed(), torch.no_grad(), _fp32_state(module, masters), rng:
        return module(*args, **kwargs)
