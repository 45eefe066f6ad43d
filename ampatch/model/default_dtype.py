"""torch's default dtype while a cast model runs (O2/O3/O5).

Model code creates float tensors inside its own forward: `torch.zeros(...)` for a lazily
built positional encoding (Lightning's `demos.Transformer`), masks, noise. Under
`torch.autocast` the next matmul casts them; under Lightning's `bf16-true` they are made
half because the default dtype is half while the model runs. A cast model does the same:
its forward (`forwards.HalfForward`) runs inside `default_dtype(half)`, so those tensors
reach its half modules as half. One context per model forward, nothing per op (O2's
per-op cost stays zero).

torch's default dtype is one setting for the whole process, not per thread, so this is its
one owner for ampatch:

- nesting: each thread keeps a stack of what it asked for; leaving a context gives back
  what the enclosing one asked for (a module kept in FP32 inside a cast model asks for
  FP32, a cast model inside it for half again), and leaving the last gives back the
  default from before the first, even when the forward raised;
- threads (`nn.DataParallel` replicas run the same cast model in several threads): the
  dtype from before is restored when the last thread leaves, not when the first does;
  while several threads are inside, requests for the half dtype win over the "weak" FP32
  requests of kept modules (one thread cannot make another's cast model build FP32
  tensors; a kept module's own new tensors then follow the model's dtype, its inputs and
  weights are FP32 regardless);
- torch.compile: a compiled forward sets and restores the dtype plainly (Dynamo traces
  `torch.set_default_dtype`; a lock cannot be traced), without the process-wide count.

Like Lightning's `bf16-true`, other threads that create float tensors while a cast model
runs get the half dtype too.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["DefaultDtype", "DEFAULT_DTYPE", "default_dtype", "fp32_default", "RecomputeAlike"]


class _Stack(threading.local):
    def __init__(self) -> None:
        self.requests: list[tuple[torch.dtype, bool]] = []


class DefaultDtype:
    """The process's default dtype, set for the threads running cast models (see the module
    docstring); `enter`/`leave` pair up per thread (`default_dtype` is the context manager)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stack = _Stack()
        self._threads = 0  # threads with a request open
        self._before: torch.dtype | None = None  # the default before the first thread entered
        self._strong: torch.dtype | None = None  # the dtype the cast models asked for last

    def active(self) -> bool:
        """Whether this thread is inside a context (a cast model's forward, a framework step)."""
        return bool(self._stack.requests)

    def enter(self, dtype: torch.dtype, weak: bool = False) -> None:
        """Ask for `dtype` as the default until the matching `leave`; `weak` (a module kept in
        FP32): only while no other thread is inside a context."""
        requests = self._stack.requests
        with self._lock:
            if not requests:
                if self._threads == 0:
                    self._before = torch.get_default_dtype()
                self._threads += 1
            requests.append((dtype, weak))
            self._apply(dtype, weak)

    def leave(self) -> None:
        """Close this thread's innermost request: the enclosing request's dtype again, or,
        leaving the last one of the process, the default from before."""
        requests = self._stack.requests
        with self._lock:
            requests.pop()
            if requests:
                self._apply(*requests[-1])
                return
            self._threads -= 1
            if self._threads == 0:
                target, self._before, self._strong = self._before, None, None
            else:  # other threads still run cast models: theirs, not a kept module's FP32
                target = self._strong
            if target is not None and torch.get_default_dtype() != target:
                torch.set_default_dtype(target)

    def _apply(self, dtype: torch.dtype, weak: bool) -> None:
        if weak and self._threads > 1:
            return
        if not weak:
            self._strong = dtype
        if torch.get_default_dtype() != dtype:
            torch.set_default_dtype(dtype)


DEFAULT_DTYPE = DefaultDtype()  # the process's one owner of torch's default dtype


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype, weak: bool = False) -> Iterator[None]:
    """Inside the block, float tensors created without a dtype are `dtype` (see the module
    docstring for threads and nesting; `weak`: a kept module's FP32)."""
    if torch.compiler.is_compiling():  # traced by Dynamo: plain set and restore
        before = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(before)
        return
    DEFAULT_DTYPE.enter(dtype, weak)
    try:
        yield
    finally:
        DEFAULT_DTYPE.leave()


def fp32_default() -> contextlib.AbstractContextManager:
    """FP32 as the default dtype again for ampatch's own work (loss scaling, the optimizer
    step) when it runs inside a context that made it half (a framework's step: manual
    optimization steps inside `training_step`); nothing to do elsewhere."""
    return default_dtype(torch.float32, weak=True) if DEFAULT_DTYPE.active() else contextlib.nullcontext()


class RecomputeAlike:
    """A checkpoint function (`torch.utils.checkpoint.checkpoint`, or a partial of it) whose
    recompute in backward runs under the default dtype its forward ran under. torch restores
    the RNG and autocast state for a recompute, not the default dtype: inside a cast model
    the forward made a tensor from Python numbers in the half dtype (T5's float16 clamp) and
    the recompute, in backward, in FP32, which torch refuses ("Recomputed values ... have
    different metadata"). Outside a cast model it changes nothing. A plain object, so a
    model that holds it stays picklable and copyable."""

    def __init__(self, checkpoint: Callable[..., Any]) -> None:
        self.__wrapped__ = checkpoint

    def __call__(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self.__wrapped__(_UnderDtype(function, torch.get_default_dtype()), *args, **kwargs)


class _UnderDtype:
    """`function` called under `dtype` as the default dtype (a no-op where it already is)."""

    def __init__(self, function: Callable[..., Any], dtype: torch.dtype) -> None:
        self.function, self.dtype = function, dtype

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.get_default_dtype() == self.dtype:
            return self.function(*args, **kwargs)
        with default_dtype(self.dtype):
            return self.function(*args, **kwargs)
