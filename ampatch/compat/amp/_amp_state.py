"""`amp._amp_state`: Apex's global state object, as a view of the live session.

Real Apex scripts read and write a few of its attributes: the starting loss scale
(`loss_scalers[0]._loss_scale = 2**20`), the current scale for logging, the growth interval
(`_scale_seq_len`), `update_scale()` after an all-reduce of their own (see
`scaler.LossScalerView`), `opt_properties`, `handle._deactivate()`, and the flags
`allow_incoming_model_not_fp32` and `hard_override`.
Every attribute here reads or writes the live `Session` (no second copy of its state);
the three flags are Apex's process-wide settings, kept in the core's `ampatch.config.settings`
(where `initialize` reads them) and read and written through this view. Before `initialize`
the view exists and is empty (`loss_scalers == []`).

Under the alias this module is `apex.amp._amp_state`.
"""
from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

from ...base.notices import set_verbosity
from ...config.settings import SETTINGS, Settings
from ...config.values import DEFAULT_MAX_LOSS_SCALE
from ...errors import ConfigTypeError, OrderError, OverrideError, ReadOnlyError
from ...optim.handle import OptimizerHandle
from ...optim.scaler import LossScaler
from ...session.session import current
from .scaler import LossScalerView

logger = logging.getLogger("ampatch")

__all__ = ["AmpState", "LossScalerView", "PropertiesView", "SessionOwner", "warn_or_err", "maybe_print"]

_SETTABLE = ("hard_override", "allow_incoming_model_not_fp32", "verbosity")


class SessionOwner:
    """The `ScalerOwner` of `_amp_state.loss_scalers[i]`: one amp session (held weakly, so a
    view kept past its session does not keep its models alive)."""

    __slots__ = ("_session", "_index")

    def __init__(self, session: Any, index: int) -> None:
        self._session = weakref.ref(session)
        self._index = index

    def _get(self) -> Any:
        s = self._session()
        if s is None or s.closed:
            raise OrderError("_amp_state.loss_scalers[i]: this loss scaler's amp session has ended (amp.initialize "
                             "was called again, or amp.deinitialize()); take amp._amp_state.loss_scalers[i] again.")
        return s

    def live(self) -> None:
        self._get().resolve_pending()  # a deferred overflow verdict may still change the scale

    def handles(self) -> list[OptimizerHandle]:
        return list(self._get().optimizers)

    def iteration(self) -> int:
        return self._get().iteration

    def describe(self) -> str:
        return f"_amp_state.loss_scalers[{self._index}]"

    def set_scale(self, scaler: LossScaler, value: Any) -> None:
        """Validated like `amp.load_state_dict`: a static scale stays, a dynamic one is clamped
        into its range; either way a write that does not take says so."""
        if isinstance(value, bool):  # float(True) would pass the state check
            raise ConfigTypeError(f"_loss_scale must be a number, got {value!r}.")
        asked = scaler.load_state_dict({**scaler.state_dict(), "loss_scale": value})
        if asked is None:
            return
        what = f"ampatch: {self.describe()}._loss_scale = {asked:g}"
        self._get().warn(
            f"{what} is outside this scaler's range [{scaler.floor:g}, {scaler.max_loss_scale:g}] (min_loss_scale, "
            f"max_loss_scale); it is now {scaler.scale:g}." if scaler.dynamic else
            f"{what} has no effect: this session's loss scale is static ({scaler.scale:g}); pass "
            f"loss_scale='dynamic' or loss_scale={asked:g} to amp.initialize instead.")


class PropertiesView:
    """`_amp_state.opt_properties`: the session's resolved properties under Apex's names."""

    __slots__ = ("_props",)
    _NAMES = ("enabled", "opt_level", "cast_model_type", "patch_torch_functions", "keep_batchnorm_fp32",
              "master_weights", "loss_scale")

    def __init__(self, props: Any) -> None:
        object.__setattr__(self, "_props", props)

    @property
    def options(self) -> dict[str, Any]:
        """Apex's `Properties.options` dict."""
        return {name: getattr(self._props, name) for name in self._NAMES}

    def __getattr__(self, name: str) -> Any:
        if name in self._NAMES or name == "half_dtype":
            return getattr(self._props, name)
        raise AttributeError(f"'Properties' object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise ReadOnlyError(f"opt_properties.{name} is read-only here: pass {name}=... to amp.initialize.")

    def __repr__(self) -> str:
        return "Properties(" + ", ".join(f"{k}={v!r}" for k, v in self.options.items()) + ")"


class AmpState:
    """Apex's `_amp_state` over the live session (`current()` returns it, or None)."""

    # set by object.__setattr__ (this class's __setattr__ takes only Apex's settable flags)
    _current: Callable[[], Any]
    _settings: Settings
    _views: tuple[weakref.ref[Any] | None, dict[int, LossScalerView]]

    def __init__(self, current: Callable[[], Any], settings: Settings = SETTINGS) -> None:
        object.__setattr__(self, "_current", current)
        object.__setattr__(self, "_settings", settings)
        # the views of the live session's scalers, made once each (a script's own attributes and
        # flag buffer stay with them): (the session, weakly; {id(scaler): view})
        object.__setattr__(self, "_views", (None, {}))

    def session(self) -> Any:
        """The live session, or None (for ampatch.compat; not an Apex attribute)."""
        return self._current()

    @property
    def loss_scalers(self) -> list[LossScalerView]:
        s = self._current()
        if s is None:
            return []
        ref, views = self._views
        if ref is None or ref() is not s:
            views = {}
            object.__setattr__(self, "_views", (weakref.ref(s), views))
        for i, scaler in enumerate(s.scalers):
            if id(scaler) not in views:
                views[id(scaler)] = LossScalerView(SessionOwner(s, i), scaler)
        return [views[id(scaler)] for scaler in s.scalers]

    @property
    def opt_properties(self) -> PropertiesView:
        s = self._current()
        if s is None:
            raise AttributeError("_amp_state.opt_properties exists once amp.initialize has run.")
        return PropertiesView(s.properties)

    @property
    def handle(self) -> Any:
        from .handle import Handle
        return Handle(self._current())

    @property
    def min_loss_scale(self) -> float | None:
        s = self._current()
        return s.scalers[0].min_loss_scale if s is not None else None

    @property
    def max_loss_scale(self) -> float:
        s = self._current()
        return s.scalers[0].max_loss_scale if s is not None else DEFAULT_MAX_LOSS_SCALE

    @property
    def hard_override(self) -> bool:
        """Apex's escape hatch: overrides and models Apex refused only warn."""
        return self._settings.hard_override

    @property
    def allow_incoming_model_not_fp32(self) -> bool:
        """Let `initialize` take float16 params and buffers (they get FP32 masters at O2)."""
        return self._settings.allow_incoming_model_not_fp32

    @property
    def verbosity(self) -> int:
        s = self._current()
        return s.verbosity if s is not None else self._settings.verbosity

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in _SETTABLE:
            raise ReadOnlyError(f"_amp_state.{name} cannot be set; the settable flags are {', '.join(_SETTABLE)}. "
                                "A loss scale is set through _amp_state.loss_scalers[i]._loss_scale.")
        if name == "verbosity":
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigTypeError(f"verbosity must be an int, got {value!r}.")
            s = self._current()
            if s is not None:  # what initialize(verbosity=...) sets: the session's and the logger's
                s.verbosity = value
                set_verbosity(value)
        elif not isinstance(value, bool):
            raise ConfigTypeError(f"_amp_state.{name} must be True or False, got {value!r}.")
        setattr(self._settings, name, value)

    def __repr__(self) -> str:
        s = self._current()
        live = "no session" if s is None else f"{s.properties.opt_level}, {len(s.scalers)} loss scaler(s)"
        return (f"<ampatch _amp_state: {live}; hard_override={self.hard_override}, "
                f"allow_incoming_model_not_fp32={self.allow_incoming_model_not_fp32}>")


def warn_or_err(msg: str) -> None:
    """Apex's helper: raise RuntimeError(msg), or only warn with `_amp_state.hard_override`."""
    if SETTINGS.hard_override:
        logger.warning("Warning: %s", msg)
    else:
        raise OverrideError(msg)


def maybe_print(msg: str, rank0: bool = False) -> None:
    """Apex's helper: log `msg` when the live session's verbosity is above 0 (rank 0 only with `rank0`)."""
    import torch.distributed as dist
    if rank0 and dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    s = current()
    if (s.verbosity if s is not None else SETTINGS.verbosity) > 0:  # as AmpState.verbosity reads it
        logger.info("%s", msg)


def __getattr__(name: str) -> Any:
    """As `apex.amp._amp_state` (the module): its `_amp_state` object and `master_params`,
    ampatch's own (read from the package lazily: it sits above compat)."""
    if name in ("_amp_state", "master_params"):
        import ampatch
        return getattr(ampatch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
