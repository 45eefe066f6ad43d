"""The forward wrappers ampatch puts on models, and the one switch that silences them.

- `HalfForward`: a cast model's (O2/O3/O5) `forward`: floating inputs to half, half outputs to
  FP32 (or `cast_model_outputs`), and the half dtype as torch's default dtype while it runs
  (tensors the model creates inside are half: `default_dtype.py`); `wrap_outputs` puts one
  on a model that is not cast (outputs only);
- `KeepForward` / `UncastForward`: the forward of a module `keep_fp32` keeps in FP32 (inputs
  to FP32 at entry, FP32 default dtype inside a cast model; at O2/O3/O5 FP32 outputs back to
  half at exit, at O1/O4 casts off inside);
- `InputCast`: the forward of a part of a cast model that code around the model calls
  directly (a LightningModule's `training_step` calling `self.discriminator(x)`): floating
  inputs to half, outputs as they are;
- `Replicate`: rebinds these wrappers to each `nn.DataParallel` replica;
- `forward_casts_bypassed()`: inside it, in this thread, they all pass everything through
  untouched (a module run as its own FP32 shadow, ampatch.diagnose).

Each is a plain object, not a closure, so a model stays copyable and picklable.
"""
from __future__ import annotations

import contextlib
import copy
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ..base.dtypes import LOW
from ..base.patcher import disable_casts
from ..base.tree import map_tensors
from ..machine.tips import add_note, changed_model_hint, hint_dtype_error
from .default_dtype import DEFAULT_DTYPE
from .weight_table import Weights

__all__ = ["HalfForward", "KeepForward", "UncastForward", "EAGER_UNDER_COMPILE", "InputCast", "Replicate", "cast_tree",
           "wrap_outputs", "install_forward", "keep_in_fp32", "forward_casts_bypassed", "is_wrapped"]


class _Bypass(threading.local):
    active = False


_bypass = _Bypass()


@contextlib.contextmanager
def forward_casts_bypassed() -> Iterator[None]:
    """Inside the block, in this thread, the forward wrappers ampatch put on models pass inputs
    and outputs through untouched: a module can run as its own FP32 shadow (ampatch.diagnose),
    with FP32 parameters swapped in, exactly as its code is written (inside a cast model's
    forward, with FP32 as the default dtype again)."""
    previous = _bypass.active
    _bypass.active = True
    fp32 = DEFAULT_DTYPE.active()
    if fp32:
        DEFAULT_DTYPE.enter(torch.float32, weak=True)
    try:
        yield
    finally:
        _bypass.active = previous
        if fp32:
            DEFAULT_DTYPE.leave()


def cast_tree(x: Any, dtype: torch.dtype, only_low: bool = False) -> Any:
    """Cast floating tensors nested in lists, tuples, namedtuples and dicts to `dtype`, and
    custom batch objects through their `.to(dtype)`; numpy arrays, integer tensors and the
    rest pass untouched. `only_low` casts just float16/bfloat16 tensors (model outputs)."""
    def leaf(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() and t.dtype != dtype and (not only_low or t.dtype in LOW):
            return t.to(dtype)
        return t

    return map_tensors(x, leaf, None if only_low else (lambda batch: batch.to(dtype)))


def wrap_outputs(model: nn.Module, output_dtype: torch.dtype | None, patcher,
                 input_dtype: torch.dtype | None = None) -> None:
    """`cast_model_outputs` at a level that leaves the model alone (O0/O1/O4), as in Apex:
    floating outputs are cast to `output_dtype`, inputs pass untouched. With `input_dtype`
    (FSDP2-sharded models at O2/O3/O5, see fsdp.py) inputs are cast to it and half outputs
    to `output_dtype` or FP32, as `ModelHandle` does."""
    install_forward(model, HalfForward(model.forward, input_dtype, output_dtype), patcher)


def install_forward(module: nn.Module, forward: "HalfForward | KeepForward | InputCast", patcher) -> None:
    """Put `forward` (a wrapper around `module.forward`) on `module`, undone by `patcher`.
    nn.DataParallel copies the instance __dict__ into each replica: each replica gets the
    wrapper bound to itself, or every replica would run the original's weights (Apex's O2 +
    DataParallel device-mismatch bug)."""
    patcher.patch(module, "forward", forward)
    patcher.patch(module, "_replicate_for_data_parallel", Replicate(module._replicate_for_data_parallel))


_nesting = threading.local()  # per thread: how many wrapped forwards are running


class HalfForward:
    """`model.forward` under O2/O3/O5: floating inputs to half, half outputs to FP32 (or
    `cast_model_outputs`), the half dtype torch's default while it runs (one
    `default_dtype` request per forward); with `dtype=None` (see `wrap_outputs`) only the
    outputs are cast.

    With `weights` (a cast model's records, `weights.Weights`), a write to either copy of a
    weight since the last sync point reaches the forward (`Weights.settle`).

    A plain object rather than a closure so the model stays copyable and picklable:
    `copy.deepcopy(model)` (EMA copies) rebinds `__wrapped__`, a bound method, to the copy,
    so the copy runs its own weights, and gives it a table of its own; pickling stores it as
    `getattr(model, "forward")`, which resolves to the class's forward while the model is
    being rebuilt.
    """

    def __init__(self, inner: Callable[..., Any], dtype: torch.dtype | None,
                 output_dtype: torch.dtype | None, nests: bool = True, weights: Weights | None = None) -> None:
        self.__wrapped__ = inner
        self.weights = weights  # the model's records: settled before each forward (not inside a compiled one)
        self.dtype = dtype  # None: inputs pass as they are (outputs-only wrapper)
        self.only_low = output_dtype is None
        self.output_dtype = output_dtype or torch.float32
        # False for an entry point other than forward (generate): the forwards it calls are
        # not nested in it, so they hand it FP32 outputs as they hand the user
        self.nests = nests

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _bypass.active:
            return self.__wrapped__(*args, **kwargs)
        weights = self.weights
        if weights is not None and not torch.compiler.is_compiling():
            weights.settle()  # a write since the last step or forward, through either copy, reaches this one
            if weights.retired():  # a copy made FP32 again (`ema.float()`): an ordinary FP32 model
                return self.__wrapped__(*args, **kwargs)
        if self.dtype is not None:
            args, kwargs = cast_tree(args, self.dtype), cast_tree(kwargs, self.dtype)
        nesting = _nesting.__dict__
        depth = nesting.get("depth", 0)
        nesting["depth"] = depth + 1 if self.nests else depth
        dtype, compiling = self.dtype, torch.compiler.is_compiling()
        before = None
        if dtype is not None:  # tensors made inside are half (see default_dtype.py)
            if compiling:  # Dynamo traces set_default_dtype, not the lock of the process-wide owner
                before = torch.get_default_dtype()
                torch.set_default_dtype(dtype)
            else:
                DEFAULT_DTYPE.enter(dtype)
        try:
            out = self.__wrapped__(*args, **kwargs)
        except BaseException as exc:
            if isinstance(exc, (RuntimeError, TypeError, ValueError)):  # e.g. an FP32 constant meets half
                hint_dtype_error(exc, model_dtype=self.dtype)
                owner = getattr(self.__wrapped__, "__self__", None)  # the model, for its bound forward
                if weights is not None and isinstance(self.__wrapped__, types.MethodType) \
                        and isinstance(owner, nn.Module):
                    changed = weights.changes(owner)
                    if changed:  # the model was changed after initialize: say how to do that
                        add_note(exc, changed_model_hint(changed, self.dtype))
            if not depth and not compiling and _kept_outputs.by_id:
                _kept_outputs.by_id = {}  # a forward that raised: drop what kept modules noted
            raise
        finally:
            nesting["depth"] = depth
            if before is not None:
                torch.set_default_dtype(before)
            elif dtype is not None:
                DEFAULT_DTYPE.leave()
        if depth:  # a model passed to initialize called inside another one: part of its half graph
            return out
        # an output of a module kept in FP32 is the model's own: its FP32 values (never noted
        # in a compiled graph, where the half copy stays: see KeepForward)
        if not torch.compiler.is_compiling() and _kept_outputs.by_id:
            originals, _kept_outputs.by_id = _kept_outputs.by_id, {}
            out = map_tensors(out, lambda t: _fp32_original(t, originals))
        return cast_tree(out, self.output_dtype, self.only_low)

    def bound_to(self, replica: nn.Module) -> "HalfForward":
        """The same wrapper around `replica`'s own forward."""
        return _bound_to(self, replica)


class _KeptOutputs(threading.local):
    """Per thread, while a cast model's forward runs: the FP32 originals of the half outputs
    that modules kept in FP32 returned (id(half) -> (half, its version, FP32 original)). When
    such an output is also what the model returns, unchanged, the model hands its caller the
    FP32 original itself, never a half rounding of an FP32 result (an FP32 output layer whose
    logits overflow the half dtype stays finite)."""

    def __init__(self) -> None:
        self.by_id: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}


_kept_outputs = _KeptOutputs()


def _fp32_original(t: torch.Tensor, originals: dict[int, tuple[torch.Tensor, int, torch.Tensor]]) -> torch.Tensor:
    entry = originals.get(id(t))
    if entry is not None and entry[0] is t and t._version == entry[1]:  # not changed in place since
        return _FP32Values.apply(t, entry[2])
    return t


class _FP32Values(torch.autograd.Function):
    """The FP32 original's values, with the gradient routed through the half copy: hooks on
    that copy (FSDP2's pre-backward hook that gathers the kept unit's weight again, a user's
    `register_hook`) still fire, and the gradient is the one the half output would get."""

    @staticmethod
    def forward(ctx: Any, half: torch.Tensor, original: torch.Tensor) -> torch.Tensor:
        ctx.half_dtype = half.dtype
        return original.view_as(original)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.to(ctx.half_dtype), None


def _bound_to(wrapper: Any, replica: nn.Module) -> Any:
    """A copy of a forward wrapper of ours whose `__wrapped__`, a bound method, is bound to
    `replica` (one module never gets two: a model kept whole has only its keep wrapper)."""
    inner = wrapper.__wrapped__
    if isinstance(inner, types.MethodType):
        inner = types.MethodType(inner.__func__, replica)
    clone = copy.copy(wrapper)
    clone.__wrapped__ = inner
    return clone


_F32 = torch.float32


class KeepForward:
    """`forward` of a module that `keep_fp32` keeps in FP32, where the session does not patch
    torch (O2/O3/O5): its parameters and buffers were left FP32; floating half inputs go to
    FP32 at entry, tensors it creates are FP32 (inside a cast model, whose default dtype is
    half, it asks `default_dtype` for FP32 back), and with `output_dtype` FP32 outputs go to
    it at exit (the model's half dtype, as an FP32 batch norm returns its input's dtype). Dynamo traces it, so under
    torch.compile the casts are nodes of the graph. A plain object, copyable and picklable
    like `HalfForward`."""

    def __init__(self, inner: Callable[..., Any], output_dtype: torch.dtype | None) -> None:
        self.__wrapped__ = inner
        self.output_dtype = output_dtype  # None: outputs leave as they are

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _bypass.active:
            return self.__wrapped__(*args, **kwargs)
        args, kwargs = cast_tree(args, _F32, True), cast_tree(kwargs, _F32, True)
        if torch.compiler.is_compiling():  # traced: plain set and restore (see default_dtype.py)
            before = torch.get_default_dtype()
            torch.set_default_dtype(_F32)
            try:
                out = self.__wrapped__(*args, **kwargs)
            finally:
                torch.set_default_dtype(before)
        elif DEFAULT_DTYPE.active():  # inside a cast model: tensors the kept module makes are FP32 too
            DEFAULT_DTYPE.enter(_F32, weak=True)
            try:
                out = self.__wrapped__(*args, **kwargs)
            finally:
                DEFAULT_DTYPE.leave()
        else:
            out = self.__wrapped__(*args, **kwargs)
        return out if self.output_dtype is None else self.leave(out)

    def leave(self, out: Any) -> Any:
        """`out` with its FP32 tensors in `output_dtype`; inside a cast model's forward each
        FP32 original is noted, in case the model returns the half copy as it is."""
        dtype = self.output_dtype
        # not under torch.compile: a graph cannot hand a Python dict its tensors (there the model
        # returns the half copy, widened)
        noted = (_kept_outputs.by_id if _nesting.__dict__.get("depth", 0) and not torch.compiler.is_compiling()
                 else None)

        def down(t: torch.Tensor) -> torch.Tensor:
            if t.dtype != _F32:
                return t
            half = t.to(dtype)
            if noted is not None:
                noted[id(half)] = (half, half._version, t)
            return half
        return map_tensors(out, down)

    def bound_to(self, replica: nn.Module) -> "KeepForward":
        """The same wrapper around `replica`'s own forward."""
        return _bound_to(self, replica)


class UncastForward(KeepForward):
    """`KeepForward` where the session patches torch (O1/O4): the module's forward, and
    everything it calls in this thread, runs with O1 casts off (`disable_casts`), on inputs
    made FP32 at entry; its outputs stay FP32 (unless `output_dtype`). The O1 counters count
    nothing inside. Under torch.compile it runs eagerly, a graph break (`dynamo.install`
    makes `__call__` a `torch.compiler.disable` function while a session patches torch):
    Dynamo picks the casts it traces when it traces, not where a module runs."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _bypass.active:  # (casts stay on: a shadow sets them itself)
            return self.__wrapped__(*args, **kwargs)
        with disable_casts():  # (the casts at entry and exit are Tensor.to, never patched)
            return KeepForward.__call__(self, *args, **kwargs)


# (class, method) that torch.compile must run eagerly while a session patches torch (`o1.dynamo`)
EAGER_UNDER_COMPILE: tuple[tuple[type, str], ...] = ((UncastForward, "__call__"),)


def keep_in_fp32(module: nn.Module, patcher, output_dtype: torch.dtype | None, casts_off: bool) -> None:
    """Wrap the forward of a module kept in FP32 (see `KeepForward`; `casts_off`: the session
    patches torch, `UncastForward`), undone by `patcher`."""
    cls = UncastForward if casts_off else KeepForward
    install_forward(module, cls(module.forward, output_dtype), patcher)


class InputCast:
    """`forward` of a module inside a cast model (O2/O3/O5) that code outside the model's own
    forward calls directly, e.g. a LightningModule's `training_step` running
    `self.discriminator(self(z))`, where `self(z)` handed back FP32 outputs: floating inputs
    to `dtype`, outputs as they are (half, as from any part of the half model). A plain
    object, copyable and picklable like `HalfForward`."""

    def __init__(self, inner: Callable[..., Any], dtype: torch.dtype) -> None:
        self.__wrapped__ = inner
        self.dtype = dtype

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _bypass.active:
            return self.__wrapped__(*args, **kwargs)
        return self.__wrapped__(*cast_tree(args, self.dtype), **cast_tree(kwargs, self.dtype))

    def bound_to(self, replica: nn.Module) -> "InputCast":
        """The same wrapper around `replica`'s own forward."""
        return _bound_to(self, replica)


def is_wrapped(module: nn.Module) -> bool:
    """Whether `module`'s forward is one of ampatch's wrappers."""
    return isinstance(module.__dict__.get("forward"), (HalfForward, KeepForward, InputCast))


class Replicate:
    """`module._replicate_for_data_parallel` of a module with a forward wrapper of ours (a
    cast model, a kept module): the replica's forward wrapper is rebound to the replica."""

    def __init__(self, inner: Callable[[], nn.Module]) -> None:
        self.inner = inner

    def __call__(self) -> nn.Module:
        replica = self.inner()
        forward = replica.__dict__.get("forward")
        if isinstance(forward, (HalfForward, KeepForward, InputCast)):
            replica.__dict__["forward"] = forward.bound_to(replica)
        replica.__dict__.pop("_replicate_for_data_parallel", None)
        return replica
