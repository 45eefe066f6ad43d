"""ampatch: automatic mixed precision for PyTorch in the style of Apex's `amp`.

    model, optimizer = amp.initialize(model, optimizer, opt_level="O1")
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()

This module is the public API and nothing else: `initialize` turns its keywords into one
checked `config.options.Options`, with the environment read once (`session.outside.outside`);
`session.prepare.prepare` checks the call as a whole before anything changes, and each
function delegates to the live `Session` (`session.session.current()`).
Apex's compatibility names (`_amp_state`, `init`, the optimizers' `_amp_stash`) are lent by
`ampatch.frameworks.apex` (`session.addons`: compat is loaded when one is first used, never
imported here), and diagnose's recorder comes from `ampatch.record` on first use; no
framework is imported here either.
"""
from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .base.notices import set_verbosity
from .base.patcher import disable_casts as _disable_casts
from .config.options import Options
from .config.values import DEFAULT_MAX_LOSS_SCALE
from .frameworks import apex, hf_conventions, scheduler_guard  # noqa: F401 - they register with the core
from .o1.lists import user as _user_policy
from .o1.plans import BFLOAT16, FLOAT, HALF, PROMOTE
from .optim.scaler import check_loss_id as _check_loss_id
from .session import addons
from .session.outside import outside, takes_policy
from .session.prepare import prepare
from .session.report import Report
from .session.session import Session
from .session.session import current as _current
from .session.session import set_current as _set_current

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
        raise RuntimeError(f"amp.{what}() was called with no ampatch session: before amp.initialize() or after "
                           "amp.deinitialize(); call `model, optimizer = amp.initialize(model, optimizer, "
                           "opt_level=...)` first. (Lightning's teardown and the Transformers Trainer's train() end "
                           "the session; the plugin's `last_report` and the Trainer's `ampatch_report` keep its "
                           "report().)")
    return s


def _recorder(session: Session, models: Sequence[torch.nn.Module], path: str, eps_lost: Sequence[str]) -> Any:
    """Diagnose's recorder (``AMPATCH_DIAGNOSE``), which sits beside the session, not below it."""
    from .record.child import attach
    return attach(session, models, path, eps_lost)


@takes_policy  # policy=: its fields set the keywords the call does not give
def initialize(models: Any, optimizers: Any = None, enabled: bool = True, opt_level: str = "O1",
               cast_model_type: Any = None, patch_torch_functions: Any = None, keep_batchnorm_fp32: Any = None,
               master_weights: Any = None, loss_scale: Any = None, cast_model_outputs: Any = None,
               num_losses: int = 1, verbosity: int = 1, min_loss_scale: float | None = None,
               max_loss_scale: float = DEFAULT_MAX_LOSS_SCALE, half_dtype: Any = None, allow_banned: bool = False,
               patch_torch_functions_type: Any = None, process_group: Any = None, keep_fp32: Any = None,
               fp8: Any = None, fp8_modules: Any = None, optimizer_states: Any = "float32", policy: Any = None) -> Any:
    """Set up mixed precision for `models` and `optimizers` at `opt_level` (O0-O5).

    Returns the models and optimizers in the shape they came in (only the models when no
    optimizers are given). Calling it again first undoes the previous session. Every keyword
    is checked, with the environment's overrides, before anything changes: a call rejected
    there leaves the previous session and the "ampatch" logger as they were.
    `keep_fp32` names modules (names as `named_modules()` gives them, "1.head" with several
    models; classes; callables `(name, module) -> bool`) that run in FP32 with everything
    inside them, at any level. `policy`: a policy file `ampatch tune` wrote (a path, or a
    dict): its fields set the keywords this call does not give (see `ampatch.config.policy_file`).
    `fp8`: torchao's float8 training (the `fp8` extra) on the model's Linear layers: True
    (= "tensorwise"), a recipe name ("rowwise", "rowwise_with_gw_hp") or a torchao
    `Float8LinearConfig`; `fp8_modules` picks the layers (names, globs, or a callable
    `(module, fqn) -> bool`; default: every Linear with dims multiples of 16 but the output
    head). Converted in place, put back by `deinitialize` (docs/fp8.md).
    `optimizer_states`: what the optimizers' state is stored in between steps, "float32" (the
    optimizer's own), "bfloat16" (rounded stochastically) or "int8" (block-wise codes), for
    any elementwise torch.optim optimizer at any level (docs/optimizer_states.md).
    """
    keywords = dict(locals())
    options = Options(**{k: v for k, v in keywords.items() if k not in ("models", "optimizers", "policy")})
    prepared = prepare(options, models, optimizers, outside(options.verbosity))
    deinitialize()  # first: a model cast by the previous session is back in FP32
    set_verbosity(options.verbosity)
    prepared.announce()
    _set_current(Session.open(prepared, attributes=addons.optimizer_attributes, recorder=_recorder))
    return prepared.returned()


def scale_loss(loss: torch.Tensor, optimizers: Any, loss_id: int = 0, model: Any = None,
               delay_unscale: bool = False, delay_overflow_check: bool = False):
    """Context manager yielding `loss.float() * scale`; on exit grads are unscaled and checked,
    and on overflow the optimizers' next `step()` is skipped."""
    return _session("scale_loss").scale_loss(loss, optimizers, loss_id, model, delay_unscale,
                                             delay_overflow_check)


def master_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """The params `optimizer` steps: clip these. FP32 masters under O2/O5; with
    `master_weights="stochastic"`/`"kahan"` the bfloat16 weights themselves (their grads
    bfloat16); the model's own params where there are no masters."""
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
    _check_loss_id(loss_id, len(s.scalers), "amp.loss_scale(loss_id)")
    s.resolve_pending()
    return s.scalers[loss_id].scale


def last_step_skipped(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer`'s last `step()` was skipped (its grads overflowed): for a driver
    that must not advance an LR scheduler past a step that did not happen."""
    s = _session("last_step_skipped")
    if not s.properties.enabled:  # nothing patched (enabled=False): no step is ever skipped
        return False
    return s.handle(optimizer, "amp.last_step_skipped").consecutive_skips > 0


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
    apex_init = addons.module_attribute("init")  # ampatch.compat's, lent by frameworks.apex
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
    """`_amp_state`, Apex's global state, made on first use as a view of the live session;
    Apex `amp` names ampatch does not have (AmpHandle, LossScaler, ...) fail with the ampatch
    way. Both lent by `frameworks.apex` (`session.addons.module_attribute`)."""
    if name.startswith("__"):  # dunder probes (copy, pickle, doctest) are not Apex names
        raise AttributeError(f"module 'ampatch' has no attribute {name!r}")
    return addons.module_attribute(name)  # made once and kept there


def _decorator(kind: str) -> Callable[[Callable], Callable]:
    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            s = _current()
            if s is None or not s.properties.patches_torch:
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
