"""Advice that mixed-precision guides give in prose, given by ampatch where a run meets the
problem (the advice `initialize` gives up front is `hardware`'s).

- `skipping_warning(...)`: why many optimizer steps in a row were skipped (the session's
  warning when they pile up).
- `explain_dtype_error(exc, op_name, model_dtype)`: when a dtype-mismatch error escapes a call
  under mixed precision, what fixes it: at O1/O4 the registration for the op; inside the
  forward of a model cast to half (O2/O3/O5, `model_dtype`), the tensor the cast did not reach
  (registrations change nothing there). `attach_hint` adds it to the error, and
  `hint_dtype_error` does both (for an `except` clause in a patched call or forward).

Pure helpers: nothing here patches anything or keeps session state.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

import torch

logger = logging.getLogger("ampatch")

__all__ = ["skipping_warning", "explain_dtype_error", "attach_hint", "add_note", "changed_model_hint",
           "hint_dtype_error", "qualified_name"]


def skipping_warning(count: int, loss: torch.Tensor | None, scalers: Sequence[Any], optimizer: int | None) -> str:
    """Why `count` optimizer steps in a row were skipped, as far as the last `loss` tells;
    `scalers` are the session's loss scalers, `optimizer` the index of the optimizer that
    skipped (None when it is the only one)."""
    finite = None if loss is None else torch.isfinite(loss)
    if loss is not None and finite is not None and not bool(finite.all()):
        bad = float(loss[~finite].flatten()[0])
        cause = (f"the loss itself is {bad}: no loss scale can fix that. Look for inf/NaN in the data or the "
                 "labels, a log/sqrt/division of zero in the loss, or a learning rate that made the weights diverge")
    else:
        cause = ("the gradients hold inf/NaN at every scale tried. Look for a learning rate that is too high, an op "
                 "that overflows in half precision (amp.register_float_function runs it in FP32), or inf/NaN in "
                 "the data")
    scales = ", ".join(f"loss scaler {i}: {s.scale:g}" + (" (its floor)" if s.dynamic and s.scale <= s.floor else "")
                       for i, s in enumerate(scalers))
    which = f"optimizer {optimizer}: " if optimizer is not None else ""
    return (f"ampatch: {which}{count} optimizer steps in a row were skipped because the gradients were not finite "
            f"({scales}); {cause}.")


# Messages of dtype-mismatch errors from torch (checked against torch 2.x CPU and CUDA).
_MISMATCH = re.compile("|".join([
    r"expected scalar type",
    r"expected object of scalar type",
    r"same dtype",                       # "must have the same dtype", "expected both inputs to have same dtype"
    r"same scalar type",
    r"to have the same type as",
    r"type \(.*\) and \w+ type \(.*\) should be the same",
    r"dtypes match",
    r"self\.dtype to be equal to src\.dtype",
    r"expected dtype \w+ for .* but got dtype",
    r"type promoting not supported",
    r"does not match weight dtype",
    r"mixed dtype",
]), re.IGNORECASE)
_HALF_WORDS = re.compile(r"half|float16|bfloat16|mixed dtype", re.IGNORECASE)
_TYPE_WORDS = re.compile(r"float|double|long\b|\bint\d*\b|short|byte|bool|complex", re.IGNORECASE)
_HINTED = "_ampatch_hint"


def explain_dtype_error(exc: BaseException, op_name: str | None = None,
                        model_dtype: Any = None) -> str | None:
    """A hint for a mixed-precision dtype mismatch, or None when `exc` is not such an error:
    its message must match a dtype-mismatch pattern and, if it names types at all, name a
    half type (a Long/Int or Float/Double mismatch is not mixed precision's doing).

    With `model_dtype` (the half dtype an O2/O3/O5 model was cast to; the error escaped its
    forward) the hint names what helps there: the FP32 tensor the model cast did not reach
    (cast it, or register it as a buffer), a module kept in FP32 on purpose (cast its input),
    or O1. Otherwise it names the registration of `op_name` (``"torch.index_put"``,
    ``"my_ext.fused_op"``) that fixes it under O1/O4."""
    if not isinstance(exc, (RuntimeError, ValueError, TypeError)) or getattr(exc, _HINTED, False):
        return None
    message = str(exc)
    if not _MISMATCH.search(message) or (_TYPE_WORDS.search(message) and not _HALF_WORDS.search(message)):
        return None
    if model_dtype is not None:
        return _model_hint(str(model_dtype).removeprefix("torch."))
    if op_name:
        module, _, name = op_name.rpartition(".")
        module = module or "module"
        what = f"`{op_name}`"
    else:
        module, name, what = "module", "function_name", "the failing function"
    return (f"ampatch: {what} got tensors of different float dtypes, which mixed precision (O1/O4) makes "
            f"when it casts some ops to half. Before amp.initialize, register it: "
            f"amp.register_promote_function({module}, \"{name}\") to cast its inputs to the widest dtype, or "
            f"amp.register_float_function({module}, \"{name}\") to run it in FP32 "
            f"(or run the code under `with amp.disable_casts():`).")


def changed_model_hint(changes: Sequence[str], half: Any) -> str:
    """The note on a dtype error of a cast model changed after `initialize` (`changes`: what
    changed, e.g. "'head.weight' is float32", "'head' was replaced")."""
    shown = "; ".join(changes[:3]) + (f"; and {len(changes) - 3} more" if len(changes) > 3 else "")
    return (f"ampatch: the model was changed after amp.initialize cast it to {str(half).removeprefix('torch.')} "
            f"({shown}). To change a model's dtypes or modules, call amp.deinitialize() first (it gives the FP32 "
            "model back), change it, then call amp.initialize again; to run a module in FP32, name it in "
            "amp.initialize(..., keep_fp32=[...]).")


def _model_hint(half: str) -> str:
    return (f"ampatch: inside the model's forward a {half} tensor met an FP32 one. At O2/O3/O5 the model's "
            f"parameters, buffers and forward inputs are cast to {half}, and tensors created inside its forward "
            f"without a dtype are {half}; a tensor the cast does not reach stays FP32: one made FP32 on purpose "
            "(`.float()`, `dtype=torch.float32`), kept as a plain attribute, or reaching the model other than "
            "through forward's arguments. Fixes: cast it to the activations' dtype (`t.to(x.dtype)`, or create "
            "it with `dtype=x.dtype`), or make it a buffer (`self.register_buffer(\"name\", t)`) so the model "
            "cast converts it; for a layer that must run in FP32, keep its module in FP32 "
            "(`amp.initialize(..., keep_fp32=[\"name\"])`: its inputs are upcast, its outputs cast back); "
            "or use opt_level=\"O1\", which casts op by op. The model's outputs come back FP32 by default "
            "(`cast_model_outputs=` picks another dtype), so code after the model needs no change. "
            "(amp.register_*_function and amp.disable_casts act on O1/O4's patches: they change nothing here.)")


def add_note(exc: BaseException, note: str) -> None:
    """Add `note` to `exc`'s message (as a note on Python 3.11+, else in its args), whatever
    hints it has."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    elif exc.args and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0]}\n{note}",) + exc.args[1:]
    else:
        exc.args = exc.args + (note,)


def attach_hint(exc: BaseException, hint: str) -> None:
    """Add `hint` to `exc`'s message once (as a note on Python 3.11+, else in its args)."""
    if getattr(exc, _HINTED, False):
        return
    try:
        setattr(exc, _HINTED, True)
    except AttributeError:  # exceptions without a __dict__
        return
    add_note(exc, hint)


def hint_dtype_error(exc: BaseException, op_name: str | None = None, model_dtype: Any = None) -> None:
    """`attach_hint(exc, explain_dtype_error(exc, op_name, model_dtype))` when there is a hint; for
    ``except (RuntimeError, ValueError, TypeError) as exc: hint_dtype_error(exc, name); raise``."""
    hint = explain_dtype_error(exc, op_name, model_dtype)
    if hint is not None:
        attach_hint(exc, hint)


def qualified_name(owner: Any, name: str) -> str:
    """``"torch.nn.functional.linear"``, ``"torch.Tensor.index_put_"``: how a user names
    `owner.name` in a registration."""
    if isinstance(owner, type):
        module = owner.__module__
        prefix = owner.__qualname__ if module in ("builtins", None) else f"{module}.{owner.__qualname__}"
    else:
        prefix = getattr(owner, "__name__", None) or type(owner).__name__
    return f"{prefix}.{name}"
