"""One object holding everything an `initialize` call set up; its one job: set up, step, close.

Opened on a checked call (`prepare.Prepared`): `build.build` makes the model and optimizer
handles, plain or sharded; what watches from outside (report at exit, the diagnose
recorder, end after N steps) is a list of `observers`; `telemetry` assembles the report.
`current()` is the live session of the process (one reference, not scattered globals):
the public API sets it, Apex's compatibility views and the plugins read it.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ..base.notices import warn
from ..base.patcher import Patcher
from ..config import levels
from ..config.env import NO_OVERRIDES, Overrides
from ..config.options import Options, Properties
from ..errors import ConfigError, ConfigTypeError, OrderError, reason
from ..machine import hardware, tips
from ..model import fp8, keep
from ..model.forwards import EAGER_UNDER_COMPILE
from ..o1 import lists
from ..o1.cache import ParamCastCache
from ..o1.install import O1Patches
from ..o1.lists import user as user_policy
from ..o1.wrappers import WrapContext
from ..optim.context import GradStage, HandleContext
from ..optim.handle import OptimizerHandle
from ..optim.scaler import LossScaler, Verdict, abort, check_loss_id, load_scalers_state_dict, scalers_state_dict
from ..optim.states import state_bytes
from . import build, observers
from .param_guard import ParamGuard
from .prepare import Prepared, check_incoming_dtypes
from .report import Report
from .telemetry import Telemetry

logger = logging.getLogger("ampatch")

DEFAULT_OPTIONS = Options()  # a session made without a call's options (tests, tools)


class _Live:
    session: Session | None = None


def current() -> Session | None:
    """The live session, or None before `initialize` and after `deinitialize`."""
    return _Live.session


def set_current(session: Session | None) -> Session | None:
    """Make `session` the live one; returns the one it replaces (the caller closes it)."""
    previous, _Live.session = _Live.session, session
    return previous


class Session:
    """The state of one `initialize`: properties, patches, cache, scalers, handles, telemetry."""

    def __init__(self, properties: Properties, options: Options = DEFAULT_OPTIONS, overrides: Overrides = NO_OVERRIDES,
                 attributes: Callable[[OptimizerHandle], dict[str, Any]] | None = None) -> None:
        self.properties, self.options, self.overrides = properties, options, overrides
        self.attributes = attributes  # what each patched optimizer carries besides (Apex's _amp_stash)
        self.verbosity = options.verbosity  # Apex's `_amp_state.verbosity` writes it
        self.patcher = Patcher()
        self.telemetry = Telemetry(record=overrides.report is not None, time_wrappers=overrides.time_wrappers,
                                   progress=overrides.progress)
        self.scalers = [self._scaler() for _ in range(options.num_losses)]
        self.models: list[Any] = []  # model.cast.ModelHandle, or model.sharded.ShardedModel
        self.optimizers: list[OptimizerHandle] = []
        self.kept: list[keep.Kept] = []  # the modules kept in FP32 (keep_fp32, AMPATCH_KEEP_FP32)
        self.observers: list[observers.Observer] = []
        self.fp8: fp8.Fp8Layers | None = None  # the layers run in FP8 (fp8=, AMPATCH_FP8)
        self.guard: ParamGuard | None = None  # parameters swapped after initialize (fully_shard, ...)
        self.device: hardware.SessionDevice | None = None  # hardware.check_half: the device, its half dtype
        self.closed = False
        self._last_loss: torch.Tensor | None = None

    @classmethod
    def open(cls, prepared: Prepared, attributes: Callable[[OptimizerHandle], dict[str, Any]] | None = None,
             recorder: observers.RecorderFactory | None = None) -> Session:
        """A session set up on the prepared models and optimizers: models cast, masters made,
        optimizers and (O1/O4) torch patched. One that fails half-way is closed (everything it
        changed undone) before the error propagates. `attributes`: see
        `HandleContext.attributes`; `recorder`: what starts diagnose's recorder when
        ``AMPATCH_DIAGNOSE`` asks for one (`observers.attach`)."""
        session = cls(prepared.properties, prepared.options, prepared.overrides, attributes)
        try:
            session._set_up(prepared.models, prepared.optimizers, recorder)
        except BaseException:
            session.close()
            raise
        return session

    def _set_up(self, models: list[nn.Module], optimizers: list[torch.optim.Optimizer],
                recorder: observers.RecorderFactory | None) -> None:
        props = self.properties
        self.device = hardware.check_half(models, props.half_dtype if props.enabled and props.half_name else None,
                                          self.verbosity)
        if props.enabled:
            check_incoming_dtypes(models)
        if self.options.keep_fp32 is not None or self.overrides.keep_fp32:
            self.kept = keep.select(models, self.options.keep_fp32, self.overrides.keep_fp32,
                                    props.enabled and props.casts_model, self.warn, self.overrides.keep_source)
        if not props.enabled:
            return
        if levels.uses_half(props.opt_level):
            hardware.log_dims_tip(models, self.verbosity)
        kept = build.keep_forwards(self.kept, props, self.patcher) if self.kept else frozenset()
        self.models, self.optimizers = build.build(props, models, optimizers, self.patcher, self._handle_context(),
                                                   kept)
        build.wrap_model_outputs(models, props, self.patcher, kept)
        if props.fp8 is not None:  # after the cast: the sharded weights the FP8 all-gather wraps are final
            try:
                self.fp8 = fp8.convert(models, props.fp8, props.fp8_modules, kept, hardware.model_device(models))
            except ValueError as exc:  # a layer choice from outside: the message names where it came from
                if self.overrides.fp8_modules is None or props.fp8_modules != self.overrides.fp8_modules:
                    raise
                raise ConfigError(f"{self.overrides.quote('fp8_modules')}: {reason(exc)}") from None
            self._announce_fp8()
        self.guard = ParamGuard(models, self.optimizers)
        for h in self.optimizers:
            h.install(self.patcher, self.guard)
        lost = hardware.eps_lost_in_float16(optimizers) if props.half_dtype == torch.float16 else []
        if lost:
            self.warn(hardware.eps_lost_warning(lost, props.opt_level))
        if props.patch_torch_functions:
            self.o1.install(user_policy.REGISTERED, lists.NAMESPACES, EAGER_UNDER_COMPILE)
        if self.overrides.report or self.overrides.diagnose or self.overrides.max_steps is not None:
            observers.attach(self, models, self.overrides, recorder, lost)
        logger.info("ampatch: %s (%s), %s", props.opt_level, props.half_dtype, props)

    def _announce_fp8(self) -> None:
        """The start-up notice of fp8: a warning where it is emulated or converts nothing (a run
        slower than without it, or no different), the layers with their reasons at INFO."""
        layers = self.fp8
        if layers is None:
            return
        if layers.emulated or not layers.converted:
            self.warn(f"ampatch: {layers.summary()}; report() lists the layers with their reasons.")
        elif self.verbosity >= 1:
            logger.info("ampatch: %s", layers.summary())
        for line in layers.lines():
            logger.info("ampatch:   %s", line)

    def _scaler(self) -> LossScaler:
        return LossScaler(self.properties.loss_scale, self.options.min_loss_scale, self.options.max_loss_scale)

    def _handle_context(self) -> HandleContext:
        """What each optimizer handle needs from this session."""
        return HandleContext(process_group=self.options.process_group, on_step=self.on_step,
                             on_skips=self._warn_skipping,
                             scales_loss=lambda: any(not s.is_identity for s in self.scalers),
                             master_owner=self._master_owner, level=self.properties.opt_level,
                             attributes=self.attributes)

    def _master_owner(self, p: torch.Tensor) -> OptimizerHandle | None:
        return next((h for h in self.optimizers if h.owns_master(p)), None)

    def add_optimizer(self, optimizer: torch.optim.Optimizer, num_losses: int = 1) -> OptimizerHandle:
        """Bring an optimizer into the live session, with at least `num_losses` loss scalers
        (Apex's `amp.init()` handle takes its optimizers after the session started)."""
        h = self.find(optimizer)
        if h is None:
            _, (h,) = build.build(self.properties, [], [optimizer], self.patcher, self._handle_context(),
                                  first_index=len(self.optimizers))
            h.install(self.patcher)
            self.optimizers.append(h)
        self.scalers += [self._scaler() for _ in range(num_losses - len(self.scalers))]
        return h

    @functools.cached_property
    def o1(self) -> O1Patches:
        """This session's O1 patches and cast cache (made on first use: O1/O4 patch torch,
        decorators wrap; a cast model has no casts to cache)."""
        cache = ParamCastCache()
        timer = self.telemetry.add_wrapper_time if self.telemetry.time_wrappers else None
        ctx = WrapContext(cache.caster, self.properties.half_dtype, self.telemetry.counters,
                          self.options.allow_banned, timer)
        return O1Patches(self.patcher, cache, ctx)

    @property
    def cache(self) -> ParamCastCache:
        """The O1 cast cache."""
        return self.o1.cache

    def clear_casts(self) -> None:
        """The casts made so far are stale (the iteration ended, or the params changed)."""
        o1 = self.__dict__.get("o1")
        if o1 is not None:
            o1.cache.clear()

    def decorated(self, kind: str, fn: Any) -> Any:
        """The cast wrapper of a function decorated with `amp.half_function` & co."""
        return self.o1.decorated(kind, fn)

    def register_now(self, owner: Any, name: str, kind: str) -> None:
        """A registration made while this session patches torch takes effect at once."""
        if self.properties.patches_torch and not self.closed:
            self.o1.register(owner, name, kind)

    # ------------------------------------------------------------------ training loop
    def find(self, optimizer: torch.optim.Optimizer) -> OptimizerHandle | None:
        """The handle of `optimizer`, or None when this session does not hold it."""
        return next((h for h in self.optimizers if h.optimizer is optimizer), None)

    def handle(self, optimizer: torch.optim.Optimizer, what: str = "scale_loss") -> OptimizerHandle:
        """The handle of `optimizer`; `what` names the caller in the error for a stranger."""
        h = self.find(optimizer)
        if h is not None:
            return h
        raise OrderError(f"{what} got an optimizer that was not passed to amp.initialize; pass every "
                         "optimizer to initialize (they come back patched). A later amp.initialize ends the "
                         "earlier session: its optimizers are plain torch optimizers again.")

    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor, optimizers: Any, loss_id: int = 0, model: Any = None,
                   delay_unscale: bool = False, delay_overflow_check: bool = False) -> Iterator[torch.Tensor]:
        if not isinstance(loss, torch.Tensor):
            raise ConfigTypeError(f"scale_loss expects the loss tensor, got {type(loss).__name__}.")
        check_loss_id(loss_id, len(self.scalers))
        opts = optimizer_list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
        if not self.properties.enabled:
            yield loss
            return
        handles = [self.handle(o) for o in opts]
        if loss_id == 0:
            self.telemetry.on_loss(loss)
            for o in self.observers:
                o.on_loss(loss, self.scalers[0].scale)
        self._last_loss = loss.detach()  # only read when steps keep being skipped
        scaler = self.scalers[loss_id]
        if scaler.is_identity and not any(h.use_masters for h in handles):  # nothing to unscale or check
            try:
                yield loss if loss.dtype == torch.float32 else loss.float()
            finally:
                self.clear_casts()
            return
        start = time.perf_counter()
        for h in handles:
            h.run_deferred()  # a deferred verdict may still change the scale
        scale = scaler.scale
        for h in handles:
            h.before_backward(scale)
        self.telemetry.scale_loss_time += time.perf_counter() - start
        try:
            yield loss.float() * scale
        except BaseException:
            try:
                abort(handles, scale)
            finally:
                self.clear_casts()
            raise
        start = time.perf_counter()
        try:
            found_inf = None
            for h in handles:
                found_inf = h.after_backward(scale, found_inf, delay_unscale)
            # sharded with its sync off: the grads are kept scaled
            if not delay_unscale and not any(h.stage is GradStage.SCALED for h in handles):
                verdict = Verdict(scaler, found_inf, process_group=self.options.process_group,
                                  iteration=lambda: self.iteration, on_overflow=self._skipper(handles, loss_id))
                if delay_overflow_check:
                    for h in handles:
                        h.defer(verdict)
                else:
                    verdict()
        finally:
            self.clear_casts()
            self.telemetry.scale_loss_time += time.perf_counter() - start

    def _skipper(self, handles: Sequence[OptimizerHandle], loss_id: int) -> Callable[[float, float], None]:
        """What an overflow verdict does: the optimizers skip their next step, and it is logged."""
        def on_overflow(before: float, after: float) -> None:
            for h in handles:
                h.skip_next_step()
            if self.verbosity >= 1:  # the session's choice, whatever the logger's level
                logger.info("ampatch: gradient overflow, skipping step; loss scaler %d scale %g -> %g",
                            loss_id, before, after)
        return on_overflow

    def on_step(self, handle: OptimizerHandle, skipped: bool) -> None:
        """Called by every patched optimizer.step(): the params changed, so the casts are stale."""
        self.clear_casts()
        if self.fp8 is not None and not skipped:
            self.fp8.precompute()  # the FP8 all-gather's weight scales, from the weights just stepped
        iteration = handle.steps - 1
        if handle.index == 0:
            self.telemetry.on_step(iteration, skipped)
            for o in self.observers:
                o.on_step(skipped)
        elif skipped and iteration not in self.telemetry.skipped[-len(self.optimizers):]:
            self.telemetry.skipped.append(iteration)  # an iteration is listed once, however many skipped

    def _warn_skipping(self, handle: OptimizerHandle, count: int) -> None:
        """`count` steps of `handle` in a row were skipped: say why, as far as the loss tells."""
        which = handle.index if len(self.optimizers) > 1 else None
        self.warn(tips.skipping_warning(count, self._last_loss, self.scalers, which), RuntimeWarning)

    def warn(self, message: str, category: type[Warning] = UserWarning) -> None:
        warn(message, self.verbosity, category)

    @property
    def iteration(self) -> int:
        return self.optimizers[0].steps if self.optimizers else 0

    # ------------------------------------------------------------------ state
    def resolve_pending(self) -> None:
        for h in self.optimizers:
            h.run_deferred()

    def state_dict(self) -> dict[str, dict[str, float | int]]:
        self.resolve_pending()
        return scalers_state_dict(self.scalers)

    def load_state_dict(self, state_dict: dict) -> None:
        load_scalers_state_dict(self.scalers, state_dict, self.warn, self.properties.opt_level)

    def report(self) -> Report:
        self.resolve_pending()
        o1 = self.__dict__.get("o1")
        cache = {"hits": o1.cache.hits, "misses": o1.cache.misses} if o1 is not None else {"hits": 0, "misses": 0}
        underflow = [h.states.underflow() for h in self.optimizers]  # (elements at the bottom, elements) each
        return self.telemetry.report(self.properties, cache,
                                     self.scalers, self.device, [k.label for k in self.kept],
                                     [h.masters.footprint() for h in self.optimizers],
                                     sum(state_bytes(h.optimizer) + h.states.nbytes() for h in self.optimizers),
                                     self.fp8, (sum(u[0] for u in underflow), sum(u[1] for u in underflow)))

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Undo everything: masters back out of optimizers, models to their dtypes, torch restored."""
        if self.closed:
            return
        try:
            for o in self.observers:  # the report keeps what it would write; the recorder's hooks go
                o.close()
        finally:
            self.closed = True
            self._last_loss = None
            try:
                if self.fp8 is not None:
                    self.fp8.restore()
                build.undo(self.models, self.optimizers)
            finally:  # whatever failed above, torch itself is restored
                self.patcher.restore_all()
                self.clear_casts()


def optimizer_list(optimizers: Sequence[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
    """`scale_loss`'s optimizers (a list/tuple) as a list: at least one, each once."""
    opts = list(optimizers)
    if not opts:
        raise ConfigError("scale_loss got no optimizer: pass the optimizer(s) whose params this loss's "
                          "backward reaches (they unscale the grads and skip the step on overflow).")
    for i, o in enumerate(opts):
        if any(o is other for other in opts[:i]):
            raise ConfigError(f"scale_loss got the same optimizer twice (optimizers[{i}]); pass each once, or "
                              "its grads would be unscaled twice.")
    return opts
