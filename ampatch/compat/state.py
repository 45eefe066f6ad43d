"""`amp._amp_state`: Apex's global state object, as a view of the live session.

Real Apex scripts read and write a few of its attributes: the starting loss scale
(`loss_scalers[0]._loss_scale = 2**20`), the current scale for logging, `opt_properties`,
`handle._deactivate()`, and the flags `allow_incoming_model_not_fp32` and `hard_override`.
Every attribute here reads or writes the live `Session` (no second copy of its state);
the three flags are Apex's process-wide settings, kept in the core's `ampatch.settings`
(where `initialize` reads them) and read and written through this view. Before `initialize` the view exists and is empty (`loss_scalers == []`).

Under the alias this module is also `apex.amp._amp_state`.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import ampatch

from ..notices import set_verbosity
from ..settings import SETTINGS, Settings

logger = logging.getLogger("ampatch")

__all__ = ["AmpState", "LossScalerView", "PropertiesView"]

_SETTABLE = ("hard_override", "allow_incoming_model_not_fp32", "verbosity")


class LossScalerView:
    """`_amp_state.loss_scalers[i]`: Apex's `LossScaler` attributes over the session's scaler.

    `_loss_scale` and `_unskipped` can be written: the write is validated like
    `amp.load_state_dict` and goes straight into the live scaler.
    """

    __slots__ = ("_session", "_scaler")

    def __init__(self, session: Any, scaler: Any) -> None:
        object.__setattr__(self, "_session", session)
        object.__setattr__(self, "_scaler", scaler)

    def _resolved(self) -> Any:
        if self._session.closed:
            raise RuntimeError("_amp_state.loss_scalers[i]: this loss scaler's amp session has ended (amp.initialize "
                               "was called again, or amp.deinitialize()); take amp._amp_state.loss_scalers[i] again.")
        self._session.resolve_pending()  # a deferred overflow verdict may still change the scale
        return self._scaler

    def _load(self, **change: Any) -> float | None:
        """Write `change` into the live scaler through its own `load_state_dict`, which
        validates it as `amp.load_state_dict` does; returns the scale when it was not taken."""
        scaler = self._resolved()
        return scaler.load_state_dict({**scaler.state_dict(), **change})

    def loss_scale(self) -> float:
        """The current scale (Apex's method)."""
        return self._resolved().scale

    @property
    def _loss_scale(self) -> float:
        return self.loss_scale()

    @_loss_scale.setter
    def _loss_scale(self, value: float) -> None:
        if isinstance(value, bool):  # float(True) would pass the state check
            raise TypeError(f"_loss_scale must be a number, got {value!r}.")
        asked = self._load(loss_scale=value)
        if asked is not None:  # not taken, as in amp.load_state_dict: a static scale stays, a dynamic one is clamped
            s, i = self._scaler, self._session.scalers.index(self._scaler)
            what = f"ampatch: _amp_state.loss_scalers[{i}]._loss_scale = {asked:g}"
            self._session.warn(
                f"{what} is outside this scaler's range [{s.floor:g}, {s.max_loss_scale:g}] (min_loss_scale, "
                f"max_loss_scale); it is now {s.scale:g}." if s.dynamic else
                f"{what} has no effect: this session's loss scale is static ({s.scale:g}); pass "
                f"loss_scale='dynamic' or loss_scale={asked:g} to amp.initialize instead.")

    @property
    def _unskipped(self) -> int:
        return self._resolved().unskipped

    @_unskipped.setter
    def _unskipped(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int):  # int(-1.5) would pass the state check
            raise TypeError(f"_unskipped must be a non-negative int, got {value!r}.")
        self._load(unskipped=value)

    @property
    def _has_overflow(self) -> bool:
        return bool(self._resolved().last_overflow)

    @property
    def dynamic(self) -> bool:
        return self._scaler.dynamic

    @property
    def _max_loss_scale(self) -> float:
        return self._scaler.max_loss_scale

    @property
    def _min_loss_scale(self) -> float | None:
        return self._scaler.min_loss_scale

    @property
    def _scale_seq_len(self) -> int:
        return self._scaler.growth_interval

    def __setattr__(self, name: str, value: Any) -> None:
        prop = getattr(type(self), name, None)
        if isinstance(prop, property) and prop.fset is not None:
            prop.fset(self, value)
            return
        raise AttributeError(f"_amp_state.loss_scalers[i].{name} cannot be set; only _loss_scale and _unskipped "
                             "can (min/max scale and dynamic scaling are amp.initialize arguments).")

    def __repr__(self) -> str:
        s = self._scaler
        return (f"LossScalerView(loss_scale={s.scale}, dynamic={s.dynamic}, unskipped={s.unskipped}, "
                f"has_overflow={s.last_overflow})")


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
        raise AttributeError(f"opt_properties.{name} is read-only here: pass {name}=... to amp.initialize.")

    def __repr__(self) -> str:
        return "Properties(" + ", ".join(f"{k}={v!r}" for k, v in self.options.items()) + ")"


class AmpState:
    """Apex's `_amp_state` over the live session (`current()` returns it, or None)."""

    def __init__(self, current: Callable[[], Any], settings: Settings = SETTINGS) -> None:
        object.__setattr__(self, "_current", current)
        object.__setattr__(self, "_settings", settings)

    def session(self) -> Any:
        """The live session, or None (for ampatch.compat; not an Apex attribute)."""
        return self._current()

    @property
    def loss_scalers(self) -> list[LossScalerView]:
        s = self._current()
        return [] if s is None else [LossScalerView(s, scaler) for scaler in s.scalers]

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
        return s.scalers[0].max_loss_scale if s is not None else 2.0 ** 24

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
            raise AttributeError(f"_amp_state.{name} cannot be set; the settable flags are {', '.join(_SETTABLE)}. "
                                 "A loss scale is set through _amp_state.loss_scalers[i]._loss_scale.")
        if name == "verbosity":
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"verbosity must be an int, got {value!r}.")
            s = self._current()
            if s is not None:  # what initialize(verbosity=...) sets: the session's and the logger's
                s.verbosity = value
                set_verbosity(value)
        elif not isinstance(value, bool):
            raise TypeError(f"_amp_state.{name} must be True or False, got {value!r}.")
        setattr(self._settings, name, value)

    def __repr__(self) -> str:
        s = self._current()
        live = "no session" if s is None else f"{s.properties.opt_level}, {len(s.scalers)} loss scaler(s)"
        return (f"<ampatch _amp_state: {live}; hard_override={self.hard_override}, "
                f"allow_incoming_model_not_fp32={self.allow_incoming_model_not_fp32}>")


def __getattr__(name: str) -> Any:
    """As `apex.amp._amp_state` (the module): its `_amp_state` object and `master_params`."""
    if name in ("_amp_state", "master_params"):
        return getattr(ampatch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
