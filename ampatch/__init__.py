"""ampatch: automatic mixed precision for PyTorch in the style of Apex's `amp`.

    model, optimizer = amp.initialize(model, optimizer, opt_level="O1")
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()

This module is the public API and nothing else: `initialize` turns its keywords into one
checked `config.options.Options`, with the environment read once (`session.prepare.outside`);
`session.prepare.prepare` checks the call as a whole before anything changes, and each
function delegates to the live `Session` (`session.session.current()`).
Apex's compatibility names (`_amp_state`, `init`, the optimizers' `_amp_stash`) are lent by
`ampatch.frameworks.apex` (`session.addons`: compat is loaded when one is first used, never
imported here), and diagnose's recorder comes from `ampatch.record` on first use; no
framework is imported here either.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, overload

import torch

from . import types
from .base.notices import set_verbosity
from .config.options import Options
from .config.values import DEFAULT_MAX_LOSS_SCALE
from .errors import OrderError
from .frameworks import apex, hf_conventions, scheduler_guard  # noqa: F401 - they register with the core
from .optim.scaler import check_loss_id as _check_loss_id
from .session import addons
from .session.prepare import outside, prepare, takes_policy
from .session.report import Report
from .session.session import Session
from .session.session import current as _current
from .session.session import set_current as _set_current
from .session.user_casts import (
    bfloat16_function,
    disable_casts,
    float_function,
    half_function,
    promote_function,
    register_bfloat16_function,
    register_float_function,
    register_half_function,
    register_promote_function,
)

if TYPE_CHECKING:  # names only a type checker needs
    from torch.distributed import ProcessGroup
    from typing_extensions import Unpack

    from .types import InitializeKeywords as Keywords
    from .types import ModelT, OptimizerT, Several

__version__ = "0.1.0"
__all__ = [
    "initialize", "scale_loss", "master_params", "state_dict", "load_state_dict", "loss_scale",
    "deinitialize", "last_step_skipped", "disable_casts", "register_half_function", "register_float_function",
    "register_promote_function", "register_bfloat16_function", "half_function", "float_function",
    "promote_function", "bfloat16_function", "report", "init", "_amp_state",
]

logger = logging.getLogger("ampatch")
logger.addHandler(logging.NullHandler())


def _session(what: str) -> Session:
    s = _current()
    if s is None:
        raise OrderError(f"amp.{what}() was called with no ampatch session (before amp.initialize() or after "
                         "amp.deinitialize()): call `amp.initialize(model, optimizer, opt_level=...)` first; "
                         "see docs/integrations.md for the report a framework's session keeps.")
    return s


def _recorder(session: Session, models: Sequence[torch.nn.Module], path: str, eps_lost: Sequence[str]) -> Any:
    """Diagnose's recorder (``AMPATCH_DIAGNOSE``), which sits beside the session, not below it."""
    from .record.child import attach
    return attach(session, models, path, eps_lost)


# What `initialize` returns: the same objects in the shape given (a list for a list or tuple); no optimizers: the models
@overload
def initialize(models: ModelT, optimizers: None = None, **kw: Unpack[Keywords]) -> ModelT: ...
@overload
def initialize(models: Several[ModelT], optimizers: None = None, **kw: Unpack[Keywords]) -> list[ModelT]: ...
@overload
def initialize(models: ModelT, optimizers: OptimizerT, **kw: Unpack[Keywords]) -> tuple[ModelT, OptimizerT]: ...
@overload
def initialize(models: ModelT, optimizers: Several[OptimizerT],
               **kw: Unpack[Keywords]) -> tuple[ModelT, list[OptimizerT]]: ...
@overload
def initialize(models: Several[ModelT], optimizers: OptimizerT,
               **kw: Unpack[Keywords]) -> tuple[list[ModelT], OptimizerT]: ...
@overload
def initialize(models: Several[ModelT], optimizers: Several[OptimizerT],
               **kw: Unpack[Keywords]) -> tuple[list[ModelT], list[OptimizerT]]: ...
@takes_policy  # policy=: its fields set the keywords the call does not give
def initialize(models: Any, optimizers: Any = None, enabled: bool = True, opt_level: types.OptLevel = "O1",
               cast_model_type: types.CastModelType = None, patch_torch_functions: types.Flag = None,
               keep_batchnorm_fp32: types.Flag = None, master_weights: types.MasterWeights = None,
               loss_scale: types.LossScale = None, cast_model_outputs: types.DTypeLike | None = None,
               num_losses: int = 1, verbosity: int = 1, min_loss_scale: float | None = None,
               max_loss_scale: float = DEFAULT_MAX_LOSS_SCALE, half_dtype: types.DTypeLike | None = None,
               allow_banned: bool = False, patch_torch_functions_type: types.DTypeLike | None = None,
               process_group: ProcessGroup | None = None, keep_fp32: types.KeepFP32 = None, fp8: types.FP8 = None,
               fp8_modules: types.FP8Modules = None, optimizer_states: types.OptimizerStates = "float32",
               policy: types.Policy = None) -> Any:
    """Set up mixed precision for `models` and `optimizers` at `opt_level` (O0-O5).

    Every keyword is checked, with the environment's overrides (``AMPATCH_*``), before anything
    changes; a call that passes them first undoes the previous session. The property keywords
    (`cast_model_type` to `loss_scale`) override the level's defaults (the README's table).

    Args:
        models: an `nn.Module` or a list (or tuple) of them, bare: not yet wrapped in DDP.
        optimizers: a `torch.optim.Optimizer`, a list of them, or None (only the models come
            back). Default: None.
        enabled: False: ampatch changes nothing (no casts; `scale_loss` yields the loss as
            is). Default: True.
        opt_level: "O0" FP32, "O1" patched casts, "O2" half model + FP32 masters, "O3" pure
            half, "O4"/"O5" = O1/O2 in bfloat16 (any case). Default: "O1".
        cast_model_type: the dtype the model is cast to (a dtype or its name), or False (leave
            the model as it is). Default: None (the level's).
        patch_torch_functions: True/False (or "True"/"False"): patch torch's functions (O1/O4
            only). Default: None (the level's).
        keep_batchnorm_fp32: True/False (or "True"/"False"): batch norms stay FP32 in a cast
            model. Default: None (the level's).
        master_weights: True (FP32 masters), False (none), or for a bfloat16 model (O2/O3/O5)
            "stochastic" / "kahan" (no FP32 copy; docs/lowmem.md). Default: None (the level's).
        loss_scale: a number between 2**-126 and 2**126, a numeric string, or "dynamic".
            Default: None (the level's: "dynamic" at O1/O2 in float16, else 1.0).
        cast_model_outputs: the dtype of the cast model's floating outputs. Default: None (FP32).
        num_losses: how many losses get their own loss scaler (`scale_loss(loss_id=)`).
            Default: 1.
        verbosity: 0 silences the "ampatch" logger and warnings, 1 info, 2 debug. Default: 1.
        min_loss_scale: the floor of a dynamic loss scale. Default: None (2**-16).
        max_loss_scale: the ceiling of a dynamic loss scale. Default: 2**24.
        half_dtype: the half dtype, torch.float16 or torch.bfloat16 (or their names).
            Default: None (float16 on CUDA, bfloat16 elsewhere; O4/O5 always bfloat16).
        allow_banned: run the functions O1 bans in float16 (binary_cross_entropy) in FP32. Default: False.
        patch_torch_functions_type: ROCm Apex's name for `half_dtype`. Default: None.
        process_group: the `torch.distributed` group whose ranks skip a step together on
            overflow. Default: None (the world).
        keep_fp32: modules that run in FP32 at any level, with everything inside them: names
            as `named_modules()` gives them ("1.head" with several models), `nn.Module`
            classes, callables `(name, module) -> bool`, or a list of these. Default: None.
        fp8: torchao's float8 training on the Linear layers (the `fp8` extra; O4, O5, or
            bfloat16/FP32 levels): True (= "tensorwise"), "rowwise", "rowwise_with_gw_hp", a
            torchao `Float8LinearConfig`, or None/False (off; docs/fp8.md). Default: None.
        fp8_modules: with `fp8`, the layers: names, globs ("blocks.*.mlp.*") or a callable
            `(module, fqn) -> bool`. Default: None (every Linear with dims multiples of 16
            but the output head).
        optimizer_states: what the optimizers' state is stored in between steps: "float32"
            (the optimizer's own), "bfloat16" (rounded stochastically) or "int8" (block-wise
            codes), or that torch dtype (docs/optimizer_states.md). Default: "float32".
        policy: a policy file `ampatch tune` wrote (its path, or its dict): its fields set the
            keywords this call does not give. Default: None.

    Returns:
        The models and optimizers in the shape they came in, the same objects: `model`,
        `[models]`, `(model, optimizer)`, `(model, [optimizers])`, ... (lists come back as
        lists); only the models when `optimizers` is None.

    Raises:
        ValueError: a keyword's value, or a combination the level refuses (the message names
            the fix; Apex's refused overrides are also RuntimeErrors).
        TypeError: a keyword of the wrong type, or models (optimizers) that are not modules
            (optimizers).
        RuntimeError: a model already wrapped in DistributedDataParallel or DataParallel.

    Example::

        >>> model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
        >>> models, optimizers = amp.initialize([gen, disc], [opt_g, opt_d], opt_level="O5",
        ...                                     num_losses=2, keep_fp32=["1.head"])
    """
    keywords = dict(locals())
    options = Options(**{k: v for k, v in keywords.items() if k not in ("models", "optimizers", "policy")})
    prepared = prepare(options, models, optimizers, outside(options.verbosity))
    deinitialize()  # first: a model cast by the previous session is back in FP32
    set_verbosity(options.verbosity)
    prepared.announce()
    _set_current(Session.open(prepared, attributes=addons.optimizer_attributes, recorder=_recorder))
    return prepared.returned()


def scale_loss(loss: torch.Tensor, optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
               loss_id: int = 0, model: Any = None, delay_unscale: bool = False,
               delay_overflow_check: bool = False) -> contextlib.AbstractContextManager[torch.Tensor]:
    """Context manager around `backward()` yielding the scaled loss `loss.float() * scale`.

    On exit the grads are unscaled (into the FP32 masters, if any) and checked for inf/NaN;
    on overflow each optimizer's next `step()` is skipped and a dynamic scale backs off.

    Args:
        loss: the loss tensor (any float dtype).
        optimizers: the optimizer, or a list of them, that steps these grads (`initialize`'s).
        loss_id: which loss scaler, 0 to `num_losses - 1`. Default: 0.
        model: ignored (Apex's argument). Default: None.
        delay_unscale: leave the grads scaled and unchecked, to accumulate another loss first
            (Apex's; the last `scale_loss` before `step()` must not delay). Default: False.
        delay_overflow_check: decide the overflow at `step()` instead of here (no host sync
            at the end of backward). Default: False.

    Returns:
        A context manager whose value is the scaled FP32 loss to call `backward()` on.

    Raises:
        RuntimeError: no session (before `initialize` or after `deinitialize`), or an
            optimizer `initialize` was not given.
        TypeError: `loss` is not a tensor.
        ValueError: `loss_id` out of range.

    Example::

        >>> with amp.scale_loss(loss, optimizer) as scaled_loss:
        ...     scaled_loss.backward()
        >>> optimizer.step()  # skipped after an overflow
    """
    return _session("scale_loss").scale_loss(loss, optimizers, loss_id, model, delay_unscale,
                                             delay_overflow_check)


def master_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """The params `optimizer` steps, with the grads it steps them by: clip these. The FP32
    masters under O2/O5; with `master_weights="stochastic"`/`"kahan"` the bfloat16 weights
    themselves (their grads bfloat16); the model's own params where there are no masters.

    Args:
        optimizer: an optimizer `initialize` returned (any other yields its own params).

    Returns:
        An iterator over the tensors in `optimizer.param_groups`, group by group.

    Example::

        >>> torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), max_norm=1.0)
    """
    for group in optimizer.param_groups:
        yield from group["params"]


def state_dict(destination: dict[str, Any] | None = None) -> dict[str, Any]:
    """The loss scalers' state in Apex's format, plain Python numbers (a checkpoint loads
    with `torch.load(path, weights_only=True)`).

    Args:
        destination: a dict to update with the state and return. Default: None (a new dict).

    Returns:
        `{"loss_scaler0": {"loss_scale": float, "unskipped": int}, ...}`, one entry per loss.

    Raises:
        RuntimeError: no session (before `initialize` or after `deinitialize`).

    Example::

        >>> torch.save({"model": model.state_dict(), "amp": amp.state_dict()}, path)
    """
    sd = _session("state_dict").state_dict()
    if destination is not None:
        destination.update(sd)
        return destination
    return sd


def load_state_dict(state_dict: dict[str, Any]) -> None:
    """Restore the loss scalers' state that `state_dict()` saved (Apex's checkpoints too).

    Args:
        state_dict: what `amp.state_dict()` returned.

    Raises:
        RuntimeError: no session (before `initialize` or after `deinitialize`).
        KeyError: keys other than `loss_scalerN`, or none of this session's (also a ValueError).
        TypeError: not a dict, or an entry that is not one.

    Example::

        >>> amp.load_state_dict(torch.load(path, weights_only=True)["amp"])
    """
    _session("load_state_dict").load_state_dict(state_dict)


def loss_scale(loss_id: int = 0) -> float:
    """The current loss scale of `loss_id` (for gradient-penalty recipes, which unscale by hand).

    Args:
        loss_id: which loss scaler, 0 to `num_losses - 1`. Default: 0.

    Returns:
        The scale as a Python float (1.0 where the level does not scale).

    Raises:
        RuntimeError: no session (before `initialize` or after `deinitialize`).
        ValueError: `loss_id` out of range (also a TypeError when it is not an int).

    Example::

        >>> penalty = sum(g.div(amp.loss_scale()).pow(2).sum() for g in scaled_grads)
    """
    s = _session("loss_scale")
    _check_loss_id(loss_id, len(s.scalers), "amp.loss_scale(loss_id)")
    s.resolve_pending()
    return s.scalers[loss_id].scale


def last_step_skipped(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer`'s last `step()` was skipped (its grads overflowed): for a driver
    that must not advance an LR scheduler past a step that did not happen.

    Args:
        optimizer: an optimizer `initialize` returned.

    Returns:
        True after a skipped step; False after one that ran, and always when `enabled=False`.

    Raises:
        RuntimeError: no session, or an optimizer this session does not hold.

    Example::

        >>> if not amp.last_step_skipped(optimizer): scheduler.step()
    """
    s = _session("last_step_skipped")
    if not s.properties.enabled:  # nothing patched (enabled=False): no step is ever skipped
        return False
    return s.handle(optimizer, "amp.last_step_skipped").consecutive_skips > 0


def deinitialize() -> None:
    """Undo the session: torch's attributes back to the very same objects, models to their
    original dtypes (from the exact values where masters were kept), optimizers to their own
    params and methods, `fp8` layers to plain Linear ones. Without a session, nothing.

    Example::

        >>> amp.deinitialize(); torch.save(model.state_dict(), path)  # the FP32 model
    """
    session = _set_current(None)
    if session is not None:
        session.close()


def init(enabled: bool = True, loss_scale: Any = "dynamic", enable_caching: bool = True, verbose: bool = False,
         allow_banned: bool = False, patch_type: Any = None) -> Any:
    """Apex's older O1-only entry point (`initialize` is the API to use): patch torch, with no
    models or optimizers, and return a handle with `scale_loss(loss, optimizer)` & co.

    Args:
        enabled: False: nothing is patched and the handle does nothing. Default: True.
        loss_scale: a number, a numeric string or "dynamic". Default: "dynamic".
        enable_caching: accepted; the cast cache stays on (same results). Default: True.
        verbose: debug logging (`initialize`'s `verbosity=2`). Default: False.
        allow_banned: as `initialize`'s. Default: False.
        patch_type: the half dtype (torch.bfloat16: O4). Default: None (the device's).

    Returns:
        Apex's handle over that session (`ampatch.compat`).

    Example::

        >>> handle = amp.init()
    """
    apex_init = addons.module_attribute("init")  # ampatch.compat's, lent by frameworks.apex
    return apex_init(enabled, loss_scale, enable_caching, verbose, allow_banned, patch_type)


def report() -> Report:
    """What the session did: casts per op, cache hits, loss scales, skipped steps, bytes per
    parameter, `fp8`'s layers, time in ampatch (docs/reference.md, "report()").

    Returns:
        A `Report`: `print()` it for a table, `.to_dict()` for JSON.

    Raises:
        RuntimeError: no session (the plugins keep theirs: `last_report`, `ampatch_report`).

    Example::

        >>> print(amp.report())
    """
    return _session("report").report()


def __getattr__(name: str) -> Any:
    """`_amp_state`, Apex's global state, made on first use as a view of the live session;
    Apex `amp` names ampatch does not have (AmpHandle, LossScaler, ...) fail with the ampatch
    way. Both lent by `frameworks.apex` (`session.addons.module_attribute`)."""
    if name.startswith("__"):  # dunder probes (copy, pickle, doctest) are not Apex names
        raise AttributeError(f"module 'ampatch' has no attribute {name!r}")
    return addons.module_attribute(name)  # made once and kept there
