"""ampatch: automatic mixed precision for PyTorch in the style of Apex's `amp`.

    model, optimizer = amp.initialize(model, optimizer, opt_level="O1")
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()

This module is the public API and nothing else; each function delegates to the current
`Session` (see session.py). Apex's compatibility names (`_amp_state`, `init`) come from
`ampatch.compat`, imported only when first used.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from . import hardware, hf_models, levels
from .policyfile import takes_policy
from .patching import BFLOAT16, FLOAT, HALF, PROMOTE
from .patching import disable_casts as _disable_casts
from .policy import user as _user_policy
from .notices import set_verbosity, warn
from .scaler import INITIAL_LOSS_SCALE, check_scale_value
from .session import Session
from .session import current as _current
from .session import set_current as _set_current
from .settings import SETTINGS as _SETTINGS
from .telemetry import Report

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
        raise RuntimeError(f"amp.{what}() was called before amp.initialize(); call "
                           "`model, optimizer = amp.initialize(model, optimizer, opt_level=...)` first.")
    return s


def _as_list(x: Any, what: str, kind: type) -> tuple[list, bool]:
    if isinstance(x, (list, tuple)):
        items, single = list(x), False
    else:
        items, single = [x], True
    for i, item in enumerate(items):
        first = next(j for j, other in enumerate(items) if other is item)
        if first != i:
            raise ValueError(f"amp.initialize got the same {what[:-1]} twice: {what}[{i}] is {what}[{first}] "
                             f"({type(item).__name__}); pass each of the {what} once.")
        if what == "models" and isinstance(item, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            raise RuntimeError(f"amp.initialize got a model already wrapped in {type(item).__name__}; call "
                               "amp.initialize on the bare model first, then wrap the model it returns.")
        if not isinstance(item, kind):
            raise TypeError(f"amp.initialize expects {what} to be {kind.__name__} objects (or a list of them), "
                            f"got {type(item).__name__}.")
    return items, single


@takes_policy  # policy= and AMPATCH_POLICY: see policyfile.apply_policy
def initialize(models: Any, optimizers: Any = None, enabled: bool = True, opt_level: str = "O1",
               cast_model_type: Any = None, patch_torch_functions: Any = None, keep_batchnorm_fp32: Any = None,
               master_weights: Any = None, loss_scale: Any = None, cast_model_outputs: Any = None,
               num_losses: int = 1, verbosity: int = 1, min_loss_scale: float | None = None,
               max_loss_scale: float = 2.0 ** 24, half_dtype: Any = None, allow_banned: bool = False,
               patch_torch_functions_type: Any = None, process_group: Any = None, keep_fp32: Any = None,
               policy: Any = None) -> Any:
    """Set up mixed precision for `models` and `optimizers` at `opt_level` (O0-O5).

    Returns the models and optimizers in the shape they came in (only the models when no
    optimizers are given). Calling it again first undoes the previous session. A call that
    raises leaves the "ampatch" logger's level as it was. `keep_fp32` names modules (names
    as `named_modules()` gives them, "1.head" with several models; classes; callables
    `(name, module) -> bool`) that run in FP32 with everything inside them, at any level.
    `policy`: a policy file `ampatch tune` wrote (a path, or a dict): its fields set the
    keywords this call does not give (see `ampatch.policyfile`).
    """
    level_before = logger.level
    try:
        return _initialize(models, optimizers, enabled, opt_level, cast_model_type, patch_torch_functions,
                           keep_batchnorm_fp32, master_weights, loss_scale, cast_model_outputs, num_losses,
                           verbosity, min_loss_scale, max_loss_scale, half_dtype, allow_banned,
                           patch_torch_functions_type, process_group, keep_fp32)
    except BaseException:
        logger.setLevel(level_before)
        raise


def _initialize(models: Any, optimizers: Any, enabled: bool, opt_level: str, cast_model_type: Any,
                patch_torch_functions: Any, keep_batchnorm_fp32: Any, master_weights: Any, loss_scale: Any,
                cast_model_outputs: Any, num_losses: int, verbosity: int, min_loss_scale: float | None,
                max_loss_scale: float, half_dtype: Any, allow_banned: bool, patch_torch_functions_type: Any,
                process_group: Any, keep_fp32: Any) -> Any:
    model_list, single_model = _as_list(models, "models", nn.Module)
    if optimizers is None:
        opt_list, single_opt = [], True
    else:
        opt_list, single_opt = _as_list(optimizers, "optimizers", torch.optim.Optimizer)
    hf_models.check_not_accelerated(model_list, opt_list)
    if patch_torch_functions_type is not None:
        if half_dtype is not None and levels.parse_dtype(half_dtype, "half_dtype") != levels.parse_dtype(
                patch_torch_functions_type, "patch_torch_functions_type"):
            raise ValueError("half_dtype and patch_torch_functions_type (its ROCm Apex alias) disagree; pass one.")
        half_dtype = patch_torch_functions_type
    if not isinstance(num_losses, int) or isinstance(num_losses, bool) or num_losses < 1:
        raise ValueError(f"num_losses must be a positive int, got {num_losses!r}.")
    if not isinstance(verbosity, int):
        raise TypeError(f"verbosity must be an int (0 silences ampatch), got {verbosity!r}.")
    # before resolve(): its messages (a forced level dropping overrides) follow this call's verbosity
    set_verbosity(verbosity)
    if min_loss_scale is not None:
        min_loss_scale = check_scale_value(min_loss_scale, "min_loss_scale")
    max_loss_scale = check_scale_value(max_loss_scale, "max_loss_scale")
    if min_loss_scale is not None and min_loss_scale > max_loss_scale:
        raise ValueError(f"min_loss_scale={min_loss_scale} exceeds max_loss_scale={max_loss_scale}.")
    _check_process_group(process_group)
    device = hardware.model_device(model_list)  # the same device hardware.check_half describes
    props = levels.resolve(opt_level, device=device, enabled=enabled, half_dtype=half_dtype,
                           cast_model_outputs=cast_model_outputs, cast_model_type=cast_model_type,
                           patch_torch_functions=patch_torch_functions, keep_batchnorm_fp32=keep_batchnorm_fp32,
                           master_weights=master_weights, loss_scale=loss_scale,
                           hard_override=_SETTINGS.hard_override)
    if props.loss_scale != "dynamic":
        if min_loss_scale is not None or max_loss_scale != 2.0 ** 24:
            logger.info("ampatch: min_loss_scale/max_loss_scale bound a dynamic loss scale; this session's is "
                        "static (%g), so they do not apply.", props.loss_scale)
    elif min_loss_scale is not None and min_loss_scale > INITIAL_LOSS_SCALE:
        warn(f"ampatch: min_loss_scale={min_loss_scale:g} is above the initial dynamic loss scale "
             f"{INITIAL_LOSS_SCALE:g}: the scale starts at min_loss_scale.", verbosity)
    if not isinstance(allow_banned, bool):
        raise TypeError(f"allow_banned must be True or False, got {allow_banned!r}.")

    deinitialize()  # first: a model cast by the previous session is back in FP32
    if props.enabled:
        levels.check_models(model_list, _SETTINGS.allow_incoming_model_not_fp32, _SETTINGS.hard_override)
    session = Session(props, num_losses=num_losses, min_loss_scale=min_loss_scale,
                      max_loss_scale=float(max_loss_scale), allow_banned=allow_banned,
                      verbosity=verbosity, process_group=process_group, keep_fp32=keep_fp32)
    try:
        session.setup(model_list, opt_list)
    except BaseException:
        session.close()
        raise
    _set_current(session)

    out_models = model_list[0] if single_model else model_list
    if optimizers is None:
        return out_models
    return out_models, (opt_list[0] if single_opt else opt_list)


def _check_process_group(group: Any) -> None:
    """`process_group` is None (the world) or a torch.distributed group this rank belongs to."""
    if group is None:
        return
    if not torch.distributed.is_available():
        raise RuntimeError("process_group was given, but this torch build has no torch.distributed.")
    if isinstance(group, int) and group == torch.distributed.GroupMember.NON_GROUP_MEMBER:
        raise ValueError("process_group: this rank is not a member of that group (torch.distributed.new_group "
                         "returned NON_GROUP_MEMBER here); pass a group that contains this rank, or None.")
    if not isinstance(group, torch.distributed.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed process group (from "
                        f"torch.distributed.new_group) or None for the world, got {type(group).__name__}.")


def scale_loss(loss: torch.Tensor, optimizers: Any, loss_id: int = 0, model: Any = None,
               delay_unscale: bool = False, delay_overflow_check: bool = False):
    """Context manager yielding `loss.float() * scale`; on exit grads are unscaled and checked,
    and on overflow the optimizers' next `step()` is skipped."""
    return _session("scale_loss").scale_loss(loss, optimizers, loss_id, model, delay_unscale,
                                             delay_overflow_check)


def master_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """The params `optimizer` steps (FP32 masters under O2/O5): clip these."""
    for group in optimizer.param_groups:
        yield from group["params"]


def state_dict(destination: dict | None = None) -> dict[str, dict[str, float | int]]:
    """Loss-scaler state in Apex's format, plain Python numbers."""
    sd = _session("state_dict").state_dict()
    if destination is not None:
        destination.update(sd)
        return destination
    return sd


def load_state_dict(state_dict: dict) -> None:
    """Restore the loss-scaler state saved by `state_dict()`."""
    _session("load_state_dict").load_state_dict(state_dict)


def loss_scale(loss_id: int = 0) -> float:
    """The current loss scale of `loss_id` (for gradient-penalty recipes)."""
    s = _session("loss_scale")
    if not isinstance(loss_id, int) or isinstance(loss_id, bool):
        raise TypeError(f"amp.loss_scale(loss_id): loss_id must be an int from 0 to num_losses-1 "
                        f"({len(s.scalers) - 1} here), got {loss_id!r}.")
    if not 0 <= loss_id < len(s.scalers):
        raise ValueError(f"amp.loss_scale(loss_id): loss_id={loss_id} is out of range: initialize(num_losses="
                         f"{len(s.scalers)}) gives loss ids 0..{len(s.scalers) - 1}.")
    s.resolve_pending()
    return s.scalers[loss_id].scale


def last_step_skipped(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer`'s last `step()` was skipped (its grads overflowed): for a driver
    that must not advance an LR scheduler past a step that did not happen."""
    return _session("last_step_skipped").handle(optimizer).consecutive_skips > 0


def deinitialize() -> None:
    """Undo the session: torch's attributes back to the very same objects, models to their
    original dtypes, optimizers to their own params and methods."""
    session = _set_current(None)
    if session is not None:
        session.close()


def init(enabled: bool = True, loss_scale: Any = "dynamic", enable_caching: bool = True, verbose: bool = False,
         allow_banned: bool = False, patch_type: Any = None) -> Any:
    """Apex's older O1-only entry point: patch torch (no models or optimizers yet) and return
    a handle with `scale_loss(loss, optimizer)`, `wrap_optimizer`, `disable_casts`,
    `is_active` and `_deactivate`. `initialize` is the API to use."""
    from .compat import init as apex_init
    return apex_init(enabled, loss_scale, enable_caching, verbose, allow_banned, patch_type)


def report() -> Report:
    """What the session did: casts per op, cache hits, loss scales, skipped steps, time."""
    return _session("report").report()


@contextlib.contextmanager
def disable_casts() -> Iterator[None]:
    """No ampatch casting inside the block (this thread only)."""
    with _disable_casts():
        yield


# ------------------------------------------------------------------ registration
def _register(module: Any, name: str, kind: str) -> None:
    _user_policy.register(module, name, kind)
    s = _current()
    if s is not None:
        s.register_now(module, name, kind)


def register_half_function(module: Any, name: str) -> None:
    """Cast the floating args of module.name to the half dtype under O1/O4."""
    _register(module, name, HALF)


def register_float_function(module: Any, name: str) -> None:
    """Run module.name in FP32 under O1/O4."""
    _register(module, name, FLOAT)


def register_promote_function(module: Any, name: str) -> None:
    """Cast the args of module.name to their widest floating dtype under O1/O4."""
    _register(module, name, PROMOTE)


def register_bfloat16_function(module: Any, name: str) -> None:
    """Cast the floating args of module.name to bfloat16 under O1/O4."""
    _register(module, name, BFLOAT16)


def __getattr__(name: str) -> Any:
    """`_amp_state`, Apex's global state, made on first use as a view of the live session
    (ampatch.compat.state); Apex `amp` names ampatch does not have (AmpHandle, LossScaler,
    ...) fail with the ampatch way."""
    if name.startswith("__"):  # dunder probes (copy, pickle, doctest) are not Apex names
        raise AttributeError(f"module 'ampatch' has no attribute {name!r}")
    compat = importlib.import_module("ampatch.compat")  # not `from . import`: that asks this hook again
    if name == "_amp_state":
        state = globals()["_amp_state"] = compat.AmpState(_current)
        return state
    return compat.legacy_attribute(name)


def _decorator(kind: str) -> Callable[[Callable], Callable]:
    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            s = _current()
            if s is None or not s.properties.enabled or not s.properties.patch_torch_functions:
                return fn(*args, **kwargs)
            return s.decorated(kind, fn)(*args, **kwargs)
        return wrapper
    return decorate


half_function = _decorator(HALF)
half_function.__doc__ = "Decorator: under O1/O4 the function's floating args are cast to half."
float_function = _decorator(FLOAT)
float_function.__doc__ = "Decorator: under O1/O4 the function runs in FP32."
promote_function = _decorator(PROMOTE)
promote_function.__doc__ = "Decorator: under O1/O4 the function's args are promoted to the widest type."
bfloat16_function = _decorator(BFLOAT16)
bfloat16_function.__doc__ = "Decorator: under O1/O4 the function's floating args are cast to bfloat16."
